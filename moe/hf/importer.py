"""Import: a local Hugging Face folder (config.json, safetensors shards with or without
model.safetensors.index.json, tokenizer files) as our `MoETransformer` with the same function
(`load_hf_model`), as a safetensors file in our names written tensor by tensor
(`stream_hf_weights`), or as our model folder (`import_model`, `moe-pipeline model import`).

The architecture comes from moe/hf/architecture.py, each tensor's name and layout from the
checkpoint's family (moe/hf/families/); dense models are upcycled. Every tensor of the
checkpoint must find its place and every parameter must get weights. Weights are read one
tensor at a time from memory-mapped shards into a model built on the meta device, so an
import holds one copy of the weights (bench/RESULTS.md measures it)."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from moe.hf.architecture import Architecture, read_architecture
from moe.hf.errors import refuse
from moe.hf.families.protocol import Family, LayerNames
from moe.hf.families.registry import FAMILIES
from moe.hf.model_dir import write_model_spec
from moe.hf.safetensors_io import Shards, StreamingSafetensors, shard_files
from moe.hf.tokenizer_files import check_tokenizer, copy_tokenizer
from moe.model.buffers import init_buffers
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import Block, MoELayer, MoETransformer

# --------------------------------------------------------------------------- tensor names


def _attention_in(
    c: ModelConfig, src: Shards, family: Family, p: str, ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block's norms and attention."""
    yield ours + "norm1.weight", src.get(p + "input_layernorm.weight")
    yield ours + "norm2.weight", src.get(p + "post_attention_layernorm.weight")
    if c.attention == "mla":
        yield from _latent_attention_in(c, src, family, p + "self_attn.", ours + "attn.")
        return
    q = src.get(p + "self_attn.q_proj.weight")
    k = src.get(p + "self_attn.k_proj.weight")
    q, k = family.qk_from_hf(q, k, c)
    v = src.get(p + "self_attn.v_proj.weight")
    yield ours + "attn.qkv.weight", torch.cat([q, k, v])
    if c.attn_bias:
        yield (
            ours + "attn.qkv.bias",
            torch.cat([src.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
        )
    yield ours + "attn.proj.weight", src.get(p + "self_attn.o_proj.weight")
    if c.attn_out_bias:
        yield ours + "attn.proj.bias", src.get(p + "self_attn.o_proj.bias")
    if c.attn_sinks:
        yield ours + "attn.sinks", src.get(p + "self_attn.sinks")
    if c.qk_norm != "none":
        yield ours + "attn.q_norm.weight", src.get(p + "self_attn.q_norm.weight")
        yield ours + "attn.k_norm.weight", src.get(p + "self_attn.k_norm.weight")


def _latent_attention_in(
    c: ModelConfig, src: Shards, family: Family, a: str, ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Multi-head latent attention (DeepSeek-V3): the compressed projections, their norms,
    and the rotated rows in our order (the family's qk_from_hf)."""
    q = src.get(a + ("q_b_proj.weight" if c.mla_q_rank else "q_proj.weight"))
    kv_a = src.get(a + "kv_a_proj_with_mqa.weight")
    q, kv_a = family.qk_from_hf(q, kv_a, c)
    if c.mla_q_rank:
        yield ours + "q_a.weight", src.get(a + "q_a_proj.weight")
        yield ours + "q_norm.weight", src.get(a + "q_a_layernorm.weight")
        yield ours + "q_b.weight", q
    else:
        yield ours + "q.weight", q
    yield ours + "kv_a.weight", kv_a
    yield ours + "kv_norm.weight", src.get(a + "kv_a_layernorm.weight")
    yield ours + "kv_b.weight", src.get(a + "kv_b_proj.weight")
    yield ours + "proj.weight", src.get(a + "o_proj.weight")


def _dense_ffn_in(
    block: Block, src: Shards, p: str, ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A dense feed-forward, or an upcycled one: copied into every expert (the router keeps
    its fresh initialisation)."""
    mlp = p + "mlp."
    w1 = src.get(mlp + "gate_proj.weight")
    w3 = src.get(mlp + "up_proj.weight")
    w2 = src.get(mlp + "down_proj.weight")
    if not isinstance(block.ffn, MoELayer):
        yield ours + "ffn.w1.weight", w1
        yield ours + "ffn.w3.weight", w3
        yield ours + "ffn.w2.weight", w2
        return
    E = block.ffn.experts.num_experts
    w13 = torch.cat([w1.t(), w3.t()], dim=1)
    yield ours + "ffn.experts.w13_EDG", w13.unsqueeze(0).expand(E, *w13.shape)
    yield ours + "ffn.experts.w2_EFD", w2.t().unsqueeze(0).expand(E, *w2.t().shape)


def _moe_ffn_in(
    ffn: MoELayer, src: Shards, family: Family, n: LayerNames, ours: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """An MoE block: router, experts stacked, shared expert and its gate, selection bias."""
    yield ours + "ffn.router.gate.weight", src.get(n.gate)
    if ffn.router.gate.bias is not None:
        yield ours + "ffn.router.gate.bias", src.get(n.gate.removesuffix("weight") + "bias")
    for name, tensor in family.experts_from_hf(src, n, ffn.experts):
        yield ours + "ffn.experts." + name, tensor
    if ffn.shared is not None:
        s = n.shared
        yield ours + "ffn.shared.w1.weight", src.get(s + "gate_proj.weight")
        yield ours + "ffn.shared.w3.weight", src.get(s + "up_proj.weight")
        yield ours + "ffn.shared.w2.weight", src.get(s + "down_proj.weight")
    if ffn.shared_gate is not None:
        yield ours + "ffn.shared_gate.weight", src.get(n.mlp + "shared_expert_gate.weight")
    if family.selection_bias:
        bias = family.bias_from_hf(src.get(n.mlp + family.selection_bias))
        yield ours + "ffn.router.expert_bias_E", bias


def _our_tensors(
    model: MoETransformer, src: Shards, family: Family, upcycled: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter or buffer name, tensor) for every weight, read from the shards."""
    c = model.cfg
    yield "embed.weight", src.get("model.embed_tokens.weight")
    if not c.tie_embeddings:
        yield "lm_head.weight", src.get("lm_head.weight")
    elif "lm_head.weight" in src:
        src.used.add("lm_head.weight")
    yield "norm.weight", src.get("model.norm.weight")
    for i, block in enumerate(model.blocks):
        n = family.names(i)
        ours = f"blocks.{i}."
        yield from _attention_in(c, src, family, n.p, ours)
        if upcycled or not isinstance(block.ffn, MoELayer):
            yield from _dense_ffn_in(block, src, n.p, ours)
        else:
            yield from _moe_ffn_in(block.ffn, src, family, n, ours)
    if family.extra_layers:  # multi-token-prediction layers: not part of the model
        past = [k for k in src.where if _layer_of(k) >= c.n_layer]
        src.used.update(past)


def _layer_of(name: str) -> int:
    """The decoder layer a tensor name belongs to (-1 for none)."""
    if not name.startswith("model.layers."):
        return -1
    index = name.split(".")[2]
    return int(index) if index.isdigit() else -1


def _check_complete(folder: Path, missing: list[str], src: Shards) -> None:
    """Refuse an import where a parameter got no weights or a tensor found no place."""
    if missing:
        raise refuse(folder, f"no weights for {', '.join(missing[:5])}")
    left = src.unused()
    if left:
        raise refuse(
            folder,
            f"{len(left)} tensor(s) of the checkpoint have no place in the model (first:"
            f" {left[0]}); the config does not describe these weights",
        )


def _read(
    folder: Path, model: MoETransformer, src: Shards, arch: Architecture
) -> Iterator[tuple[str, torch.Tensor]]:
    """`_our_tensors`, with a shape that config.json contradicts refused by tensor: the
    readers concatenate and stack (q, k, v; the experts), where a wrong shape would end in
    torch's own error naming neither the tensor nor the field."""
    tensors = _our_tensors(model, src, FAMILIES[arch.model_type], arch.upcycled)
    while True:
        src.read.clear()
        try:
            yield next(tensors)
        except StopIteration:
            return
        except RuntimeError as e:
            raise refuse(
                folder,
                f"tensor {src.last!r} has shape {src.shape(src.last)}, which config.json's "
                f"fields (hidden_size, heads, head_dim, intermediate sizes, experts) do not "
                f"give ({str(e).splitlines()[0]})",
            ) from e


def _check_shape(
    folder: Path, arch: Architecture, name: str, want: Any, tensor: Any, src: Shards
) -> None:
    if want is None:
        raise refuse(folder, f"internal: no parameter {name} for {arch.model_type}")
    if tuple(want.shape) != tuple(tensor.shape):
        given = ", ".join(f"{k} {src.shape(k)}" for k in src.read) or name
        raise refuse(
            folder,
            f"{given}: shape(s) that config.json's fields do not give: they make"
            f" {tuple(tensor.shape)} where the config implies {tuple(want.shape)} (our {name})",
        )


# --------------------------------------------------------------------------- import


def load_hf_model(
    folder: Path, moe_defaults: MoEConfig, seq_len: int, dtype: torch.dtype | None = None
) -> tuple[MoETransformer, Architecture]:
    """The Hugging Face model in `folder` as our model (dense ones upcycled), weights in
    `dtype` (default: the checkpoint's own). Every tensor of the checkpoint must be used."""
    folder = Path(folder)
    arch = read_architecture(folder, moe_defaults, seq_len)
    src = Shards(folder)
    if dtype is None:
        dtype = src.dtype("model.embed_tokens.weight")
    with torch.device("meta"):
        model = MoETransformer(arch.model, arch.moe, arch.vocab_size)
    model = model.to_empty(device="cpu").to(dtype)
    init_buffers(model)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in _read(folder, model, src, arch):
            target = params.get(name, buffers.get(name))
            _check_shape(folder, arch, name, target, tensor, src)
            target.copy_(tensor)  # type: ignore[union-attr]
            filled.add(name)
        if arch.upcycled:  # a fresh router for each upcycled layer
            gen = torch.Generator().manual_seed(0)
            for i, block in enumerate(model.blocks):
                if isinstance(block.ffn, MoELayer):
                    w = block.ffn.router.gate.weight
                    w.copy_(torch.randn(w.shape, generator=gen) * model.cfg.init_std)
                    filled.add(f"blocks.{i}.ffn.router.gate.weight")
    _check_complete(folder, [n for n in params if n not in filled], src)
    return model, arch


def _write_routers(model: MoETransformer, writer: StreamingSafetensors, upcycled: bool) -> None:
    """What no checkpoint holds, as `load_hf_model` makes it: the fresh routers of upcycled
    layers, and the routing state at its defaults."""
    gen = torch.Generator().manual_seed(0)
    for i, block in enumerate(model.blocks):
        if not isinstance(block.ffn, MoELayer):
            continue
        p = f"blocks.{i}.ffn.router."
        if upcycled:
            shape = tuple(block.ffn.router.gate.weight.shape)
            writer.write(p + "gate.weight", torch.randn(shape, generator=gen) * model.cfg.init_std)
        E = block.ffn.experts.num_experts
        for buf, value in (("expert_bias_E", 0.0), ("util_E", 1.0), ("logit_offset_E", 0.0)):
            if p + buf in writer.left:
                writer.write(p + buf, torch.full((E,), value))


def stream_hf_weights(
    folder: Path,
    out: Path,
    moe_defaults: MoEConfig,
    seq_len: int,
    dtype: torch.dtype | None = None,
) -> tuple[MoETransformer, Architecture]:
    """The weights of the Hugging Face model in `folder`, in our names, written to the
    safetensors file `out` one tensor at a time (one MoE layer's experts at most in memory):
    what `load_hf_model` then `save_model_dir` write, without the model ever being whole in
    this process. Returns the model on the meta device (its shapes) and the architecture.
    `dtype`: the file's (default: the checkpoint's own)."""
    folder = Path(folder)
    arch = read_architecture(folder, moe_defaults, seq_len)
    src = Shards(folder)
    dtype = dtype or src.dtype("model.embed_tokens.weight")
    with torch.device("meta"):
        model = MoETransformer(arch.model, arch.moe, arch.vocab_size)
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    writer = StreamingSafetensors(out, {k: (dtype, tuple(t.shape)) for k, t in state.items()})
    try:
        for name, tensor in _read(folder, model, src, arch):
            _check_shape(folder, arch, name, state.get(name), tensor, src)
            writer.write(name, tensor)
        _write_routers(model, writer, arch.upcycled)
        params = {n for n, _ in model.named_parameters()}
        _check_complete(folder, sorted(n for n in writer.left if n in params), src)
        writer.close()
    except BaseException:
        writer.f.close()
        Path(out).unlink(missing_ok=True)
        raise
    return model, arch


def file_hashes(folder: Path, names: list[str]) -> dict[str, str]:
    """The sha256 of each named file of `folder`."""
    out = {}
    for name in names:
        h = hashlib.sha256()
        with open(Path(folder) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def import_model(src: Path, out_dir: Path, moe_defaults: MoEConfig, seq_len: int) -> dict[str, Any]:
    """`moe-pipeline model import`: a Hugging Face folder as our model folder, with its
    tokenizer files and the sha256 of every file it was made from. Written to a temporary
    folder first: an interrupted import leaves `out_dir` as it was."""
    src, out_dir = Path(src), Path(out_dir)
    weights, _ = shard_files(src)
    inputs = ["config.json", *weights]
    if (src / "model.safetensors.index.json").is_file():
        inputs.append("model.safetensors.index.json")
    check_tokenizer(src)  # before the weights: a bad file is refused at once
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Tensor by tensor into the folder's model.safetensors: never whole in memory.
        model, arch = stream_hf_weights(src, tmp / "model.safetensors", moe_defaults, seq_len)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokenizer = copy_tokenizer(src, tmp)
    for name in ("generation_config.json",):
        if (src / name).is_file():
            shutil.copyfile(src / name, tmp / name)
    source = {
        "path": str(src.resolve()),
        "model_type": arch.model_type,
        "upcycled": arch.upcycled,
        "max_position_embeddings": arch.max_position_embeddings,
        "special_ids": arch.special_ids,
        "files": file_hashes(src, sorted(set(inputs + tokenizer))),
    }
    write_model_spec(model, tmp, {"source": source})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return source
