"""Hugging Face checkpoints in and out: the format adapter between our model and transformers.

Import (`read_architecture`, `load_hf_model`): a local Hugging Face folder (config.json,
safetensors shards with or without model.safetensors.index.json, tokenizer files) becomes a
`MoETransformer` with the same function. Supported: Qwen3-MoE, Qwen2-MoE (sigmoid-gated
shared expert), Mixtral, OLMoE, ERNIE-4.5-MoE, and dense Llama, Qwen2 and Qwen3 *upcycled*
(Komatsuzaki et al. 2022): every feed-forward copied into each expert, routing renormalised so
the combine weights sum to one, so the upcycled model computes the dense one's function at
step 0 whatever the router chooses. A config field that changes the forward pass and that we
do not implement (a RoPE scaling, sliding windows, qkv clipping, another activation...) is
refused by name, never ignored.

Export (`export_plan`, `export_hf`): our model as the transformers architecture that represents
it exactly, with per-expert tensors as transformers itself saves them (what vLLM reads):

- the aux-free selection bias (a bias that chooses experts but does not weight them) is
  ERNIE-4.5-MoE's `moe_statics.e_score_correction_bias`, the one architecture in transformers
  with exactly that semantics over softmax scores; with the bias at zero any matching
  architecture will do;
- ERNIE applies RoPE to interleaved pairs where we rotate halves: its q and k projection rows
  are our rows permuted per head, which leaves every attention score unchanged;
- what no architecture represents is refused with the reason: utilisation-aware routing (the
  scores depend on a running average), a growth ramp in progress, unequal expert counts.

Weights are read one tensor at a time from memory-mapped shards into a model built on the
meta device, so an import holds one copy of the weights (bench/RESULTS.md measures it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe.config import GrowthConfig, ModelConfig, MoEConfig
from moe.errors import InputError
from moe.model.transformer import MoELayer, MoETransformer, rotary_tables

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "ernie4_5_moe")
DENSE_TYPES = ("llama", "qwen2", "qwen3")  # imported by upcycling

# Config fields every architecture may carry without changing the forward pass.
_HARMLESS = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "attention_dropout",
    "max_window_layers",
    "layer_types",
    "pretraining_tp",
    "router_jitter_noise",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "sliding_window",
    "use_sliding_window",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "tokenizer_class",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "torchscript",
    "use_return_dict",
    "router_z_loss_coef",
}
# Fields each architecture adds, which the reader below interprets.
_KNOWN = {
    "qwen3_moe": {
        "attention_bias",
        "decoder_sparse_step",
        "mlp_only_layers",
        "moe_intermediate_size",
        "norm_topk_prob",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
    },
    "qwen2_moe": {
        "qkv_bias",
        "decoder_sparse_step",
        "mlp_only_layers",
        "moe_intermediate_size",
        "norm_topk_prob",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "shared_expert_intermediate_size",
    },
    "mixtral": {"num_local_experts", "num_experts_per_tok"},
    "olmoe": {
        "attention_bias",
        "clip_qkv",
        "norm_topk_prob",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
    },
    "ernie4_5_moe": {
        "use_bias",
        "moe_intermediate_size",
        "moe_k",
        "moe_num_experts",
        "moe_layer_start_index",
        "moe_layer_end_index",
        "moe_layer_interval",
        "moe_norm_min",
        "moe_num_shared_experts",
        "moe_capacity",
        "moe_gate",
        "moe_use_aux_free",
    },
    "llama": {"attention_bias", "mlp_bias"},
    "qwen2": {"qkv_bias"},
    "qwen3": {"attention_bias"},
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
)
FORMAT = "moe-pipeline-model/1"

log = logging.getLogger(__name__)
# safetensors' dtype names
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


@dataclass
class Architecture:
    """What a Hugging Face config means for our model."""

    model_type: str
    model: ModelConfig
    moe: MoEConfig
    vocab_size: int
    upcycled: bool
    max_position_embeddings: int
    special_ids: dict[str, int | None] = field(default_factory=dict)


def _refuse(path: Path, why: str) -> InputError:
    return InputError(f"{path}: {why}")


def read_config(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.exists():
        hint = (
            " (it looks like a Hugging Face Hub id: this machine cannot download from the Hub;"
            " download it elsewhere with `huggingface-cli download` and name the folder)"
            if str(folder).count("/") == 1 and not str(folder).startswith((".", "/"))
            else ""
        )
        raise InputError(f"model.init = {str(folder)!r}: no such folder{hint}")
    if not path.is_file():
        raise _refuse(folder, "no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise _refuse(path, f"not JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise _refuse(path, "has no model_type")
    return cfg


def _rope_theta(path: Path, hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for what in (params, scaling):
        kind = what.get("rope_type", what.get("type", "default"))
        if kind not in ("default", None):
            raise _refuse(
                path,
                f"RoPE scaling {kind!r} is not implemented (only plain RoPE); the model cannot"
                " be imported exactly",
            )
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        raise _refuse(path, "partial_rotary_factor != 1 is not implemented")
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    return float(theta)


def read_architecture(folder: Path, moe_defaults: MoEConfig, seq_len: int) -> Architecture:
    """Our ModelConfig and MoEConfig for the Hugging Face model in `folder`. A dense model is
    upcycled with `moe_defaults.num_experts` experts and top_k; routing and balancing knobs
    (how it will train) come from `moe_defaults`, the shape from the checkpoint."""
    folder = Path(folder)
    hf = read_config(folder)
    path = folder / "config.json"
    mtype = hf["model_type"]
    if mtype not in MOE_TYPES + DENSE_TYPES:
        raise _refuse(
            path,
            f"model_type {mtype!r} is not supported; supported: {', '.join(MOE_TYPES)} (MoE)"
            f" and {', '.join(DENSE_TYPES)} (dense, upcycled to MoE)",
        )
    for key, value in hf.items():
        if key in _HARMLESS or key in _KNOWN[mtype] or key.startswith("_"):
            continue
        if value in (None, False, 0, 0.0, [], {}, ""):
            continue
        raise _refuse(path, f"field {key!r} = {value!r} is not supported for {mtype}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise _refuse(path, f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if hf.get("use_sliding_window") or (
        mtype == "mixtral" and hf.get("sliding_window") not in (None, 0)
    ):
        raise _refuse(path, "sliding-window attention is not implemented")
    if hf.get("clip_qkv") is not None:
        raise _refuse(path, f"clip_qkv = {hf['clip_qkv']} is not implemented")
    if hf.get("mlp_bias"):
        raise _refuse(path, "mlp_bias = true is not implemented")
    if mtype == "ernie4_5_moe" and hf.get("use_bias"):
        raise _refuse(path, "use_bias = true (biases on every projection) is not implemented")
    D, H = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_layer = int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or 0)
    if head_dim == D // H:
        head_dim = 0
    theta = _rope_theta(path, hf)
    attn_bias = bool(
        hf.get("attention_bias") or hf.get("qkv_bias", mtype in ("qwen2", "qwen2_moe"))
    )
    qk_norm = {"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(mtype, "none")
    moe_every, dense_layers = 1, []
    shared, shared_hidden, shared_gate = False, 0, False
    upcycled = mtype in DENSE_TYPES
    if upcycled:
        E, K = moe_defaults.num_experts, moe_defaults.top_k
        if K < 2:
            raise InputError(
                f"moe.top_k = {K}: upcycling {mtype} needs top_k >= 2. The upcycled model equals"
                " the dense one because the renormalised weights of its K copies sum to 1; at"
                " K = 1 that weight would be a constant 1 and the router would never learn"
            )
        expert_hidden, renorm = int(hf["intermediate_size"]), True
    elif mtype == "ernie4_5_moe":
        E, K = int(hf["moe_num_experts"]), int(hf["moe_k"])
        expert_hidden, renorm = int(hf["moe_intermediate_size"]), True
        moe_every = int(hf.get("moe_layer_interval", 1))
        start = int(hf.get("moe_layer_start_index", 0))
        end = int(hf.get("moe_layer_end_index", n_layer - 1))
        if end < 0:
            end = n_layer - 1
        dense_layers = [
            i for i in range(n_layer) if (i + 1) % moe_every == 0 and not start <= i <= end
        ]
        n_shared = int(hf.get("moe_num_shared_experts", 0))
        shared, shared_hidden = n_shared > 0, n_shared * expert_hidden
    else:
        E = int(hf.get("num_experts") or hf.get("num_local_experts"))
        K = int(hf["num_experts_per_tok"])
        expert_hidden = int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
        renorm = mtype == "mixtral" or bool(hf.get("norm_topk_prob", False))
        moe_every = int(hf.get("decoder_sparse_step", 1))
        dense_layers = [int(i) for i in hf.get("mlp_only_layers") or []]
        if mtype == "qwen2_moe":
            shared, shared_gate = True, True
            shared_hidden = int(hf["shared_expert_intermediate_size"])
    model = ModelConfig(
        init=str(folder),
        n_layer=n_layer,
        n_head=H,
        n_kv_head=int(hf.get("num_key_value_heads") or H),
        head_dim=head_dim,
        d_model=D,
        seq_len=seq_len,
        moe_every=moe_every,
        dense_layers=dense_layers,
        dense_hidden=int(hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        attn_bias=attn_bias,
        rope_theta=theta,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )
    if model.n_kv_head == H:
        model.n_kv_head = 0
    moe = MoEConfig(**{**asdict(moe_defaults), "growth": GrowthConfig()})
    moe.num_experts, moe.top_k, moe.expert_hidden = E, K, expert_hidden
    moe.renormalize = renorm
    moe.shared_expert, moe.shared_expert_hidden = shared, shared_hidden
    moe.shared_expert_gate = shared_gate
    if shared_hidden == expert_hidden:
        moe.shared_expert_hidden = 0
    ids = {k: hf.get(f"{k}_token_id") for k in ("bos", "eos", "pad")}
    return Architecture(
        mtype,
        model,
        moe,
        int(hf["vocab_size"]),
        upcycled,
        int(hf.get("max_position_embeddings") or seq_len),
        {k: v if isinstance(v, int) else None for k, v in ids.items()},
    )


# --------------------------------------------------------------------------- tensors


def shard_files(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of a checkpoint folder (named by its index when it has one) and
    the index's tensor -> file map ({} without an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = {}
    if not files:
        raise _refuse(folder, "no *.safetensors weights (a .bin checkpoint: convert it first)")
    return files, weight_map


class _Shards:
    """The tensors of a folder's safetensors files, read lazily through memory maps."""

    def __init__(self, folder: Path) -> None:
        files, weight_map = shard_files(folder)
        self.folder = folder
        self.handles = {}
        for name in files:
            if not (folder / name).is_file():
                raise _refuse(folder, f"{name} is named in the index but missing")
            self.handles[name] = safe_open(str(folder / name), framework="pt")
        self.where = {k: weight_map.get(k) for k in weight_map}
        for name, h in self.handles.items():
            for k in h.keys():
                self.where[k] = name
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise _refuse(self.folder, f"tensor {key!r} is missing from the checkpoint")
        self.used.add(key)
        return self.handles[self.where[key]].get_tensor(key)

    def dtype(self, key: str) -> torch.dtype:
        """A tensor's dtype from the file's header, without reading the tensor."""
        if key not in self.where:
            raise _refuse(self.folder, f"tensor {key!r} is missing from the checkpoint")
        return _DTYPES[self.handles[self.where[key]].get_slice(key).get_dtype()]

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.used)


def _interleave_rows(w: torch.Tensor, heads: int, head_dim: int, inverse: bool) -> torch.Tensor:
    """Rows of a q/k projection from rotate-half order to interleaved pairs (ERNIE), per head."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    if inverse:
        perm = torch.argsort(perm)
    idx = (torch.arange(heads)[:, None] * head_dim + perm[None, :]).flatten()
    return w[idx]


def _hf_names(mtype: str, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    mlp = p + ("block_sparse_moe." if mtype == "mixtral" else "mlp.")
    return {
        "p": p,
        "mlp": mlp,
        "gate": mlp + "gate.weight",
        "expert": mlp + "experts.{e}.",
        "w1": "w1" if mtype == "mixtral" else "gate_proj",
        "w3": "w3" if mtype == "mixtral" else "up_proj",
        "w2": "w2" if mtype == "mixtral" else "down_proj",
        "shared": mlp + ("shared_experts." if mtype == "ernie4_5_moe" else "shared_expert."),
    }


def _our_tensors(
    model: MoETransformer, src: _Shards, mtype: str, upcycled: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter or buffer name, tensor) for every weight, read from the shards."""
    c = model.cfg
    yield "embed.weight", src.get("model.embed_tokens.weight")
    if not c.tie_embeddings:
        yield "lm_head.weight", src.get("lm_head.weight")
    elif "lm_head.weight" in src:
        src.used.add("lm_head.weight")
    yield "norm.weight", src.get("model.norm.weight")
    ernie = mtype == "ernie4_5_moe"
    for i, block in enumerate(model.blocks):
        moe_block = isinstance(block.ffn, MoELayer)
        n = _hf_names(mtype, i)
        p, ours = n["p"], f"blocks.{i}."
        yield ours + "norm1.weight", src.get(p + "input_layernorm.weight")
        yield ours + "norm2.weight", src.get(p + "post_attention_layernorm.weight")
        q = src.get(p + "self_attn.q_proj.weight")
        k = src.get(p + "self_attn.k_proj.weight")
        if ernie:
            q = _interleave_rows(q, c.n_head, c.head_width, inverse=True)
            k = _interleave_rows(k, c.kv_heads, c.head_width, inverse=True)
        v = src.get(p + "self_attn.v_proj.weight")
        yield ours + "attn.qkv.weight", torch.cat([q, k, v])
        if c.attn_bias:
            yield (
                ours + "attn.qkv.bias",
                torch.cat([src.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"]),
            )
        yield ours + "attn.proj.weight", src.get(p + "self_attn.o_proj.weight")
        if c.qk_norm != "none":
            yield ours + "attn.q_norm.weight", src.get(p + "self_attn.q_norm.weight")
            yield ours + "attn.k_norm.weight", src.get(p + "self_attn.k_norm.weight")
        if upcycled or not moe_block:
            mlp = p + "mlp."
            w1 = src.get(mlp + "gate_proj.weight")
            w3 = src.get(mlp + "up_proj.weight")
            w2 = src.get(mlp + "down_proj.weight")
            if not moe_block:
                yield ours + "ffn.w1.weight", w1
                yield ours + "ffn.w3.weight", w3
                yield ours + "ffn.w2.weight", w2
                continue
            E = block.ffn.experts.num_experts
            w13 = torch.cat([w1.t(), w3.t()], dim=1)
            yield ours + "ffn.experts.w13_EDG", w13.unsqueeze(0).expand(E, *w13.shape)
            yield ours + "ffn.experts.w2_EFD", w2.t().unsqueeze(0).expand(E, *w2.t().shape)
            continue  # the router keeps its fresh initialisation
        yield ours + "ffn.router.gate.weight", src.get(n["gate"])
        experts = block.ffn.experts
        w13 = torch.empty_like(experts.w13_EDG, device="cpu")
        w2 = torch.empty_like(experts.w2_EFD, device="cpu")
        F_ = experts.hidden
        for e in range(experts.num_experts):
            ep = n["expert"].format(e=e)
            w13[e, :, :F_] = src.get(ep + n["w1"] + ".weight").t()
            w13[e, :, F_:] = src.get(ep + n["w3"] + ".weight").t()
            w2[e] = src.get(ep + n["w2"] + ".weight").t()
        yield ours + "ffn.experts.w13_EDG", w13
        yield ours + "ffn.experts.w2_EFD", w2
        if block.ffn.shared is not None:
            s = n["shared"]
            yield ours + "ffn.shared.w1.weight", src.get(s + "gate_proj.weight")
            yield ours + "ffn.shared.w3.weight", src.get(s + "up_proj.weight")
            yield ours + "ffn.shared.w2.weight", src.get(s + "down_proj.weight")
        if block.ffn.shared_gate is not None:
            yield ours + "ffn.shared_gate.weight", src.get(n["mlp"] + "shared_expert_gate.weight")
        if ernie:
            bias = src.get(n["mlp"] + "moe_statics.e_score_correction_bias").reshape(-1)
            yield ours + "ffn.router.expert_bias_E", bias


def init_buffers(model: MoETransformer) -> None:
    """What a meta-device build leaves unset: rotary tables, routing state, and the tie of
    the output head to the embedding (`to_empty` gives each module its own storage)."""
    c = model.cfg
    if c.tie_embeddings and model.lm_head.weight is not model.embed.weight:
        model.lm_head.weight = model.embed.weight
    device = model.embed.weight.device
    cos, sin = rotary_tables(c.seq_len, c.head_width, c.rope_theta)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    for layer in model.moe_layers:
        r = layer.router
        r.expert_bias_E.zero_()
        r.util_E.fill_(1.0)
        r.logit_offset_E.zero_()
        r.load_E.zero_()


def load_hf_model(
    folder: Path, moe_defaults: MoEConfig, seq_len: int, dtype: torch.dtype | None = None
) -> tuple[MoETransformer, Architecture]:
    """The Hugging Face model in `folder` as our model (dense ones upcycled), weights in
    `dtype` (default: the checkpoint's own). Every tensor of the checkpoint must be used."""
    folder = Path(folder)
    arch = read_architecture(folder, moe_defaults, seq_len)
    src = _Shards(folder)
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
        for name, tensor in _our_tensors(model, src, arch.model_type, arch.upcycled):
            target = params.get(name, buffers.get(name))
            if target is None:
                raise _refuse(folder, f"internal: no parameter {name} for {arch.model_type}")
            if tuple(target.shape) != tuple(tensor.shape):
                raise _refuse(
                    folder,
                    f"tensor for {name} has shape {tuple(tensor.shape)}, config.json implies"
                    f" {tuple(target.shape)}",
                )
            target.copy_(tensor)
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


def _check_complete(folder: Path, missing: list[str], src: _Shards) -> None:
    """Refuse an import where a parameter got no weights or a tensor found no place."""
    if missing:
        raise _refuse(folder, f"no weights for {', '.join(missing[:5])}")
    left = src.unused()
    if left:
        raise _refuse(
            folder,
            f"{len(left)} tensor(s) of the checkpoint have no place in the model (first:"
            f" {left[0]}); the config does not describe these weights",
        )


class StreamingSafetensors:
    """A safetensors file written one tensor at a time, in any order: the header (every
    name, dtype, shape and offset, known from the model's shapes) first, then each tensor's
    bytes at its offset as it comes. `safetensors.torch.save_file` needs every tensor in
    memory at once; an import of a 30B-parameter model cannot afford that. What it writes is
    read back by safetensors itself (tests/test_hf.py)."""

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        names = {v: k for k, v in _DTYPES.items()}
        header: dict[str, Any] = {}
        offset = 0
        for name, (dtype, shape) in layout.items():
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": names[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.layout, self.header, self.left = layout, header, set(layout)
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.base = 8 + len(raw)
        self.f.truncate(self.base + offset)

    def write(self, name: str, t: torch.Tensor) -> None:
        dtype, shape = self.layout[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the file expects {shape}")
        start, end = self.header[name]["data_offsets"]
        data = t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == end - start
        self.f.seek(self.base + start)
        self.f.write(data.numpy().tobytes())
        self.left.discard(name)

    def close(self) -> None:
        if self.left:
            raise ValueError(f"{self.path}: no data for {sorted(self.left)[:5]}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


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
    src = _Shards(folder)
    dtype = dtype or src.dtype("model.embed_tokens.weight")
    with torch.device("meta"):
        model = MoETransformer(arch.model, arch.moe, arch.vocab_size)
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight")
    writer = StreamingSafetensors(out, {k: (dtype, tuple(t.shape)) for k, t in state.items()})
    try:
        for name, tensor in _our_tensors(model, src, arch.model_type, arch.upcycled):
            if name not in state:
                raise _refuse(folder, f"internal: no parameter {name} for {arch.model_type}")
            if tuple(state[name].shape) != tuple(tensor.shape):
                raise _refuse(
                    folder,
                    f"tensor for {name} has shape {tuple(tensor.shape)}, config.json implies"
                    f" {tuple(state[name].shape)}",
                )
            writer.write(name, tensor)
        gen = torch.Generator().manual_seed(0)  # fresh routers of upcycled layers, as load_hf_model
        for i, block in enumerate(model.blocks):
            if not isinstance(block.ffn, MoELayer):
                continue
            p = f"blocks.{i}.ffn.router."
            if arch.upcycled:
                shape = tuple(block.ffn.router.gate.weight.shape)
                writer.write(
                    p + "gate.weight", torch.randn(shape, generator=gen) * model.cfg.init_std
                )
            E = block.ffn.experts.num_experts  # routing state no checkpoint holds: defaults
            for buf, value in (("expert_bias_E", 0.0), ("util_E", 1.0), ("logit_offset_E", 0.0)):
                if p + buf in writer.left:
                    writer.write(p + buf, torch.full((E,), value))
        params = {n for n, _ in model.named_parameters()}
        _check_complete(folder, sorted(n for n in writer.left if n in params), src)
        writer.close()
    except BaseException:
        writer.f.close()
        Path(out).unlink(missing_ok=True)
        raise
    return model, arch


def file_hashes(folder: Path, names: list[str]) -> dict[str, str]:
    out = {}
    for name in names:
        h = hashlib.sha256()
        with open(Path(folder) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def copy_tokenizer(src: Path, dest: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, Path(dest) / name)
            copied.append(name)
    return copied


# --------------------------------------------------------------------------- export


@dataclass
class ExportPlan:
    model_type: str
    architecture: str
    notes: list[str]


def _selection_bias(model: MoETransformer) -> bool:
    if "aux_free" not in model.mcfg.balancing:
        return False
    return any(bool(layer.router.expert_bias_E.abs().max() > 0) for layer in model.moe_layers)


def _ernie_layers(c: ModelConfig) -> tuple[int, int] | None:
    moe = [i for i in range(c.n_layer) if c.is_moe_block(i)]
    if not moe:
        return None
    start, end = moe[0], moe[-1]
    same = [i for i in range(c.n_layer) if (i + 1) % c.moe_every == 0 and start <= i <= end]
    return (start, end) if same == moe else None


def export_plan(model: MoETransformer, prefer: str = "") -> ExportPlan:
    """The transformers architecture that represents `model` exactly, or InputError saying
    why none does. `prefer` (the architecture it was imported from) wins when it fits."""
    c, m = model.cfg, model.mcfg
    counts = model.experts_per_layer()
    if len(set(counts)) > 1:
        raise InputError(
            f"cannot export: the MoE layers have unequal expert counts {counts} (after growth"
            " or pruning); no transformers architecture has per-layer expert counts"
        )
    if "util_aware" in m.balancing:
        raise InputError(
            "cannot export: utilisation-aware routing (moe.balancing: util_aware) scales the"
            " router's scores by a running average no transformers architecture computes"
        )
    if any(bool(layer.router.logit_offset_E.abs().max() > 0) for layer in model.moe_layers):
        raise InputError(
            "cannot export: an expert added by growth is still ramping in (its router offset"
            " is not 0); train past moe.growth.ramp_steps and export again"
        )
    if m.force_balanced:
        raise InputError("cannot export: moe.force_balanced (debug round-robin routing) is on")
    if not model.moe_layers:
        raise InputError("cannot export: the model has no MoE layer")
    bias = _selection_bias(model)
    all_moe = all(c.is_moe_block(i) for i in range(c.n_layer))
    why: dict[str, str] = {}

    def fits(t: str) -> bool:
        reasons = []
        if bias and t != "ernie4_5_moe":
            reasons.append("it has no selection bias (aux-free balancing is on)")
        if t == "qwen3_moe":
            reasons += ["q/k norm is not per head"] * (c.qk_norm != "head")
            reasons += ["it has no shared expert"] * m.shared_expert
        elif t == "qwen2_moe":
            reasons += ["q/k norm"] * (c.qk_norm != "none")
            reasons += ["its shared expert is gated"] * (
                not (m.shared_expert and m.shared_expert_gate)
            )
        elif t == "mixtral":
            reasons += ["q/k norm"] * (c.qk_norm != "none")
            reasons += ["attention biases"] * c.attn_bias
            reasons += ["it has no shared expert"] * m.shared_expert
            reasons += ["it renormalises top-k weights"] * (not m.renormalize and m.top_k > 1)
            reasons += ["it has no dense blocks"] * (not all_moe)
        elif t == "olmoe":
            reasons += ["q/k norm is over the full width"] * (c.qk_norm != "full")
            reasons += ["attention biases"] * c.attn_bias
            reasons += ["it has no shared expert"] * m.shared_expert
            reasons += ["it has no dense blocks"] * (not all_moe)
            reasons += ["q width must equal d_model"] * (c.n_head * c.head_width != c.d_model)
        elif t == "ernie4_5_moe":
            reasons += ["q/k norm"] * (c.qk_norm != "none")
            reasons += ["it always renormalises top-k weights"] * (
                not m.renormalize and m.top_k > 1
            )
            reasons += ["its dense blocks form no start/end/interval pattern"] * (
                _ernie_layers(c) is None
            )
            reasons += ["its shared expert is ungated"] * m.shared_expert_gate
            if m.shared_expert and (m.shared_expert_hidden or m.expert_hidden) % m.expert_hidden:
                reasons.append("its shared width is a multiple of the expert width")
        if reasons:
            why[t] = "; ".join(reasons)
        return not reasons

    order = [prefer] if prefer in MOE_TYPES else []
    order += [
        t for t in ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "ernie4_5_moe") if t not in order
    ]
    for t in order:
        if fits(t):
            notes = [
                "Exported dropless: capacity dropping, router jitter and expert warm-up are"
                " training-only and not part of the exported model."
            ]
            if bias:
                notes.append(
                    "The aux-free selection bias is ERNIE-4.5-MoE's e_score_correction_bias:"
                    " it chooses experts and does not weight them, as in training."
                )
            return ExportPlan(t, _ARCH_CLASS[t], notes)
    raise InputError(
        "cannot export exactly to any supported architecture: "
        + "; ".join(f"{t}: {r}" for t, r in why.items())
    )


_ARCH_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
}


def hf_config(
    model: MoETransformer,
    plan: ExportPlan,
    special_ids: dict[str, int | None],
    max_positions: int = 0,
) -> dict[str, Any]:
    c, m = model.cfg, model.mcfg
    t = plan.model_type
    cfg: dict[str, Any] = {
        "architectures": [plan.architecture],
        "model_type": t,
        "vocab_size": model.vocab_size,
        "hidden_size": c.d_model,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.kv_heads,
        "head_dim": c.head_width,
        "hidden_act": "silu",
        "rms_norm_eps": c.norm_eps,
        "max_position_embeddings": max(max_positions, c.seq_len),
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": c.tie_embeddings,
        "use_cache": True,
        "attention_dropout": 0.0,
        "initializer_range": c.init_std,
        "torch_dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        **{f"{k}_token_id": v for k, v in special_ids.items()},
    }
    if t == "ernie4_5_moe":
        start, end = _ernie_layers(c)  # type: ignore[misc]
        shared = (m.shared_expert_hidden or m.expert_hidden) // m.expert_hidden
        cfg.update(
            intermediate_size=c.dense_hidden,
            moe_intermediate_size=m.expert_hidden,
            moe_num_experts=m.num_experts,
            moe_k=m.top_k,
            moe_layer_start_index=start,
            moe_layer_end_index=end,
            moe_layer_interval=c.moe_every,
            moe_num_shared_experts=shared if m.shared_expert else 0,
            moe_norm_min=1e-12,
            use_bias=c.attn_bias,
        )
    else:
        cfg.update(num_experts_per_tok=m.top_k, num_experts=m.num_experts)
        if t == "mixtral":
            cfg.update(
                intermediate_size=m.expert_hidden,
                num_local_experts=m.num_experts,
                sliding_window=None,
            )
            del cfg["num_experts"]
        else:
            cfg.update(norm_topk_prob=m.renormalize)
        if t in ("qwen3_moe", "qwen2_moe"):
            cfg.update(
                intermediate_size=c.dense_hidden,
                moe_intermediate_size=m.expert_hidden,
                decoder_sparse_step=c.moe_every,
                mlp_only_layers=list(c.dense_layers),
                use_sliding_window=False,
                sliding_window=None,
            )
        if t == "qwen3_moe":
            cfg.update(attention_bias=c.attn_bias)
        if t == "qwen2_moe":
            cfg.update(
                qkv_bias=True,
                shared_expert_intermediate_size=m.shared_expert_hidden or m.expert_hidden,
            )
        if t == "olmoe":
            cfg.update(intermediate_size=m.expert_hidden, attention_bias=False, clip_qkv=None)
    return cfg


def hf_tensors(model: MoETransformer, plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) for every weight of the exported model, per expert."""
    c, t = model.cfg, plan.model_type
    ernie = t == "ernie4_5_moe"
    yield "model.embed_tokens.weight", model.embed.weight
    if not c.tie_embeddings:
        yield "lm_head.weight", model.lm_head.weight
    if ernie and c.attn_bias:  # ERNIE's use_bias: every projection but the experts'
        yield "lm_head.bias", torch.zeros(model.vocab_size, dtype=model.embed.weight.dtype)
    yield "model.norm.weight", model.norm.weight
    for i, block in enumerate(model.blocks):
        moe_block = isinstance(block.ffn, MoELayer)
        n = _hf_names(t, i)
        p, a = n["p"], block.attn
        yield p + "input_layernorm.weight", block.norm1.weight
        yield p + "post_attention_layernorm.weight", block.norm2.weight
        q, k, v = a.qkv.weight.split(a.widths)
        if ernie:
            q = _interleave_rows(q, c.n_head, c.head_width, inverse=False)
            k = _interleave_rows(k, c.kv_heads, c.head_width, inverse=False)
        for name, w in zip("qkv", (q, k, v), strict=True):
            yield p + f"self_attn.{name}_proj.weight", w
        bias_needed = c.attn_bias or t == "qwen2_moe"
        if bias_needed:
            if a.qkv.bias is not None:
                qb, kb, vb = a.qkv.bias.split(a.widths)
                if ernie:
                    qb = _interleave_rows(qb, c.n_head, c.head_width, inverse=False)
                    kb = _interleave_rows(kb, c.kv_heads, c.head_width, inverse=False)
            else:
                qb, kb, vb = (torch.zeros(w, dtype=a.qkv.weight.dtype) for w in a.widths)
            for name, b in zip("qkv", (qb, kb, vb), strict=True):
                yield p + f"self_attn.{name}_proj.bias", b
        yield p + "self_attn.o_proj.weight", a.proj.weight
        zeros = ernie and c.attn_bias
        if zeros:
            yield p + "self_attn.o_proj.bias", torch.zeros(c.d_model, dtype=a.proj.weight.dtype)
        if a.q_norm is not None:
            yield p + "self_attn.q_norm.weight", a.q_norm.weight
            yield p + "self_attn.k_norm.weight", a.k_norm.weight  # type: ignore[union-attr]
        if not moe_block:
            ffn = block.ffn
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                w = getattr(ffn, ours).weight
                yield p + f"mlp.{theirs}.weight", w
                if zeros:
                    yield p + f"mlp.{theirs}.bias", torch.zeros(w.shape[0], dtype=w.dtype)
            continue
        ffn = block.ffn
        yield n["gate"], ffn.router.gate.weight
        gate_EDF, up_EDF, down_EFD = ffn.experts.weights_EDF()
        for e in range(ffn.experts.num_experts):
            ep = n["expert"].format(e=e)
            for name, w in ((n["w1"], gate_EDF[e]), (n["w3"], up_EDF[e]), (n["w2"], down_EFD[e])):
                yield ep + name + ".weight", w.t().contiguous()
        if ffn.shared is not None:
            s = n["shared"]
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                w = getattr(ffn.shared, ours).weight
                yield s + f"{theirs}.weight", w
                if zeros:
                    yield s + f"{theirs}.bias", torch.zeros(w.shape[0], dtype=w.dtype)
        if ffn.shared_gate is not None:
            yield n["mlp"] + "shared_expert_gate.weight", ffn.shared_gate.weight
        if ernie:
            yield (
                n["mlp"] + "moe_statics.e_score_correction_bias",
                (ffn.router.expert_bias_E.reshape(1, -1).float()),
            )


SHARD_BYTES = 2 << 30


def write_hf_weights(model: MoETransformer, plan: ExportPlan, out: Path) -> list[str]:
    """Safetensors shards of at most SHARD_BYTES each, with an index when there are several."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in hf_tensors(model, plan):
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return names


# --------------------------------------------------------------------------- model folders


def save_model_dir(
    model: MoETransformer, out_dir: Path, extra: dict[str, Any] | None = None
) -> Path:
    """Our model folder: model.safetensors (our names) and model.json (the architecture)."""
    from moe.checkpoint.store import model_tensors

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model_tensors(model), str(out_dir / "model.safetensors"))
    write_model_spec(model, out_dir, extra)
    return out_dir / "model.safetensors"


def write_model_spec(model: MoETransformer, out_dir: Path, extra: dict[str, Any] | None) -> None:
    """model.json: what the weights beside it are (the architecture, the expert counts)."""
    spec = {
        "format": FORMAT,
        "model": asdict(model.cfg),
        "moe": asdict(model.mcfg),
        "vocab_size": model.vocab_size,
        "experts_per_layer": model.experts_per_layer(),  # after growth / pruning
        **(extra or {}),
    }
    (Path(out_dir) / "model.json").write_text(json.dumps(spec, indent=1))


def read_model_spec(model_dir: Path) -> dict[str, Any]:
    spec_path = Path(model_dir) / "model.json"
    if not spec_path.is_file():
        raise InputError(f"{spec_path} is missing: run the stage that writes {model_dir} first")
    try:
        return json.loads(spec_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{spec_path}: not JSON (line {e.lineno}: {e.msg})") from e


def model_dir_skeleton(model_dir: Path) -> MoETransformer:
    """The model a folder written by `save_model_dir` holds, on the meta device (shapes, no
    weights): for the sharded engine to fill each rank's part from `model.safetensors`."""
    from moe.model.growth import resize_model

    spec = read_model_spec(Path(model_dir))
    moe_spec = dict(spec["moe"])
    growth = GrowthConfig(**moe_spec.pop("growth", {}))
    cfg = ModelConfig(**spec["model"])
    with torch.device("meta"):
        model = MoETransformer(cfg, MoEConfig(**moe_spec, growth=growth), spec["vocab_size"])
    if spec.get("experts_per_layer"):
        resize_model(model, spec["experts_per_layer"])
    return model


def load_model_dir(model_dir: Path, dtype: torch.dtype | None = None) -> MoETransformer:
    """A model folder written by `save_model_dir` (a stage's model or an import)."""
    from moe.checkpoint.store import load_model_tensors

    model_dir = Path(model_dir)
    model = model_dir_skeleton(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        dtype = dtype or _DTYPES[f.get_slice("embed.weight").get_dtype()]
        model = model.to_empty(device="cpu").to(dtype)
        init_buffers(model)
        load_model_tensors(model, {k: f.get_tensor(k) for k in f.keys()})
    return model


def import_model(src: Path, out_dir: Path, moe_defaults: MoEConfig, seq_len: int) -> dict[str, Any]:
    """`moe-pipeline model import`: a Hugging Face folder as our model folder, with its
    tokenizer files and the sha256 of every file it was made from. Written to a temporary
    folder first: an interrupted import leaves `out_dir` as it was."""
    src, out_dir = Path(src), Path(out_dir)
    weights, _ = shard_files(src)
    inputs = ["config.json", *weights]
    if (src / "model.safetensors.index.json").is_file():
        inputs.append("model.safetensors.index.json")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # Tensor by tensor into the folder's model.safetensors: never whole in memory.
    model, arch = stream_hf_weights(src, tmp / "model.safetensors", moe_defaults, seq_len)
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


def native_tokenizer_config(eos: str, pad: str, max_len: int) -> dict[str, Any]:
    """tokenizer_config.json for a tokenizer trained by moe/data/tokenizer.py."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "pad_token": pad,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
    }


def export_hf(
    model: MoETransformer,
    out_dir: Path,
    tokenizer_dir: Path,
    special_ids: dict[str, int | None],
    card: str,
    prefer: str = "",
    max_positions: int = 0,
) -> ExportPlan:
    """Write `model` as a transformers folder: config.json, per-expert safetensors (sharded
    with an index past SHARD_BYTES), the tokenizer files of `tokenizer_dir`,
    generation_config.json and the model card. Refuses (InputError) a model no architecture
    represents exactly. Written to a temporary folder first, renamed when complete."""
    plan = export_plan(model, prefer)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = hf_config(model, plan, special_ids, max_positions)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    write_hf_weights(model, plan, tmp)
    copied = copy_tokenizer(Path(tokenizer_dir), tmp)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
        raise InputError(f"{tokenizer_dir}: no tokenizer.json to export with the model")
    generation = {
        "do_sample": False,
        **{f"{k}_token_id": v for k, v in special_ids.items() if v is not None},
    }
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
    (tmp / "README.md").write_text(card)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.replace(out_dir)
    return plan


# --------------------------------------------------------------------------- model.init

# The MoE fields a checkpoint fixes; the others (balancing, capacity, ...) say how to train.
MOE_SHAPE = (
    "num_experts",
    "top_k",
    "expert_hidden",
    "renormalize",
    "shared_expert",
    "shared_expert_hidden",
    "shared_expert_gate",
)


def init_architecture(model: ModelConfig, moe: MoEConfig) -> tuple[ModelConfig, MoEConfig]:
    """The configuration with `model.init`'s architecture in place of the model section's
    shape fields and the MoE shape fields; the training length (seq_len), the routing and
    balancing knobs stay the user's. A dense model is upcycled to moe.num_experts, top_k."""
    folder = Path(model.init)
    if (folder / "model.json").is_file():  # a folder written by `model import` or a stage
        spec = read_model_spec(folder)
        counts = spec.get("experts_per_layer") or []
        if len(set(counts)) > 1:
            raise InputError(
                f"{folder}: its MoE layers have unequal expert counts {counts} (after growth);"
                " start from it with the checkpoint tools, not model.init"
            )
        arch_model = ModelConfig(**spec["model"])
        shape = {k: spec["moe"][k] for k in MOE_SHAPE if k in spec["moe"]}
    else:
        arch = read_architecture(folder, moe, model.seq_len)
        arch_model = arch.model
        shape = {k: getattr(arch.moe, k) for k in MOE_SHAPE}
    if not (folder / "tokenizer.json").is_file():
        raise InputError(
            f"model.init = {model.init!r}: no tokenizer.json in it; the model must be trained"
            " with its own tokenizer"
        )
    source_type = _source_type(folder)
    balancing = list(moe.balancing)
    # ERNIE-4.5-MoE is the one architecture with a selection bias (export_plan); it has no
    # q/k norm, no gated shared expert and always renormalises.
    ernie_fits = (
        arch_model.qk_norm == "none" and not shape["shared_expert_gate"] and shape["renormalize"]
    )
    from_moe = source_type in MOE_TYPES and source_type != "ernie4_5_moe"
    if "aux_free" in balancing and (from_moe or not ernie_fits):
        # The imported architecture has no selection bias: a model trained with one could
        # not be exported back to it (export_plan refuses). Train it as it was made instead.
        balancing = [m for m in balancing if m != "aux_free"]
        if "aux_loss" not in balancing:
            balancing.insert(0, "aux_loss")
        log.warning(
            "model.init is %s, whose router has no selection bias: moe.balancing aux_free"
            " replaced by aux_loss (%s), so the trained model exports back to %s exactly",
            source_type,
            balancing,
            source_type,
        )
    shape["balancing"] = balancing
    arch_model.init = model.init
    arch_model.init_pretrain = model.init_pretrain
    arch_model.seq_len = model.seq_len
    arch_model.init_std = model.init_std
    new_moe = MoEConfig(**{**asdict(moe), "growth": moe.model.growth, **shape})
    return arch_model, new_moe


def _source_type(folder: Path) -> str:
    """The Hugging Face model_type a model.init folder came from ("" if none)."""
    if (folder / "model.json").is_file():
        return (read_model_spec(folder).get("source") or {}).get("model_type", "")
    return str(read_config(folder).get("model_type", ""))


def init_model_skeleton(
    model: ModelConfig, moe: MoEConfig, scratch: Path
) -> tuple[MoETransformer, Path]:
    """`model.init` for the sharded engine: the model on the meta device and the safetensors
    file each rank reads its part from. A folder of ours has one; a Hugging Face folder is
    streamed once into `scratch` (by the first process of each machine; the caller waits for
    it) in fp32, as `build_init_model` would load it."""
    import torch.distributed as dist

    folder = Path(model.init)
    if (folder / "model.json").is_file():
        vocab = int(read_model_spec(folder)["vocab_size"])
        weights = folder / "model.safetensors"
    else:
        vocab = read_architecture(folder, moe, model.seq_len).vocab_size
        weights = Path(scratch) / "model.safetensors"
        failed: BaseException | None = None
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            try:
                weights.parent.mkdir(parents=True, exist_ok=True)
                stream_hf_weights(folder, weights, moe, model.seq_len, torch.float32)
            except Exception as e:  # every rank learns of it, instead of waiting for it
                failed = e
        if dist.is_initialized():
            on_gpu = dist.get_backend() == "nccl"
            flag = torch.tensor(
                [float(failed is not None)],
                device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu",
            )
            dist.all_reduce(flag)
            if failed is None and float(flag) > 0:
                raise InputError(
                    f"model.init = {model.init!r}: the import failed on another machine's first"
                    " process (its log says why)"
                )
        if failed is not None:
            raise failed
    with torch.device("meta"):
        out = MoETransformer(model, moe, vocab)
    return out, weights


def build_init_model(model: ModelConfig, moe: MoEConfig) -> MoETransformer:
    """The model `model.init` names, in fp32 for training, built with the pipeline's
    (resolved) configuration: the checkpoint's weights under the pipeline's training knobs."""
    from moe.checkpoint.store import load_model_tensors

    folder = Path(model.init)
    if not (folder / "model.json").is_file():
        hf_model, _ = load_hf_model(folder, moe, model.seq_len, torch.float32)
        hf_model.cfg.init, hf_model.cfg.init_pretrain = model.init, model.init_pretrain
        hf_model.cfg.init_std = model.init_std
        return hf_model
    spec = read_model_spec(folder)
    with torch.device("meta"):
        out = MoETransformer(model, moe, int(spec["vocab_size"]))
    out = out.to_empty(device="cpu")
    init_buffers(out)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        load_model_tensors(out, {k: f.get_tensor(k).float() for k in f.keys()})
    return out
