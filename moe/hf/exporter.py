"""Export: our model as the transformers architecture that represents it exactly
(`export_plan`), its config.json (`hf_config`) and its tensors per expert as transformers
itself saves them, what vLLM reads (`hf_tensors`), written as a transformers folder with
tokenizer, generation config and model card (`export_hf`).

Which architecture fits is each family's answer (moe/hf/families/); the families are tried
in their export order, the one the model was imported from first. The aux-free selection
bias (a bias that chooses experts but does not weight them) exports only to a family with
one (ERNIE-4.5-MoE over softmax scores; GLM-4.5 and DeepSeek-V3 over sigmoid scores); with
the bias at zero any matching architecture will do. What no
architecture represents is refused with the reason: utilisation-aware routing (the scores
depend on a running average), a growth ramp in progress, unequal expert counts."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moe.errors import InputError
from moe.hf.families.protocol import Family, LayerNames
from moe.hf.families.registry import FAMILIES, exporters
from moe.hf.safetensors_io import write_shards
from moe.hf.tokenizer_files import copy_tokenizer
from moe.model.attention import LatentAttention
from moe.model.config import ModelConfig
from moe.model.transformer import Block, MoELayer, MoETransformer


@dataclass
class ExportPlan:
    model_type: str
    architecture: str
    notes: list[str]


def _selection_bias(model: MoETransformer) -> bool:
    """Whether a router chooses with a selection bias (aux-free trained one, or imported)."""
    return any(bool(layer.router.expert_bias_E.abs().max() > 0) for layer in model.moe_layers)


def _refuse_unexportable(model: MoETransformer) -> None:
    """Refuse what no architecture represents, whichever family."""
    m = model.mcfg
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


def _routing_and_attention(model: MoETransformer, family: Family) -> list[str]:
    """Why the family's router or attention cannot compute the model's, whichever family."""
    c, m = model.cfg, model.mcfg
    reasons = []
    if m.score_func != family.score_func:
        reasons.append(f"its router scores experts with {family.score_func}, not {m.score_func}")
    if not family.group_routing and m.n_group > 1 and m.topk_group < m.n_group:
        reasons.append("it has no group-limited routing (moe.n_group)")
    if not family.group_routing and m.routed_scale != 1.0:
        reasons.append("it has no routed scaling factor (moe.routed_scale)")
    if c.attention != family.attention:
        reasons.append(f"its attention is {family.attention}, not {c.attention}")
    if c.attention == "gqa" and c.rope_width != c.head_width and not family.partial_rotary:
        reasons.append("it rotates whole heads (model.rotary_dim)")
    return reasons


def export_plan(model: MoETransformer, prefer: str = "") -> ExportPlan:
    """The transformers architecture that represents `model` exactly, or InputError saying
    why none does. `prefer` (the architecture it was imported from) wins when it fits."""
    _refuse_unexportable(model)
    bias = _selection_bias(model)
    why: dict[str, str] = {}
    for family in exporters(prefer):
        reasons = _routing_and_attention(model, family)
        if bias and not family.selection_bias:
            reasons.append("it has no selection bias (the routers choose with one)")
        reasons += family.feature_refusals(model.cfg, model.mcfg)
        reasons += family.export_refusals(model.cfg, model.mcfg)
        if reasons:
            why[family.model_type] = "; ".join(reasons)
            continue
        notes = [
            "Exported dropless: capacity dropping, router jitter and expert warm-up are"
            " training-only and not part of the exported model."
        ]
        if bias:
            notes.append(
                f"The aux-free selection bias is {family.architecture}'s"
                " e_score_correction_bias: it chooses experts and does not weight them, as in"
                " training."
            )
        return ExportPlan(family.model_type, family.architecture, notes)
    raise InputError(
        "cannot export exactly to any supported architecture: "
        + "; ".join(f"{t}: {r}" for t, r in why.items())
    )


def rope_parameters(c: ModelConfig) -> dict[str, Any]:
    """config.json's rope_parameters for our RoPE (plain, or YaRN with its numbers)."""
    out: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    for key, value in c.rope_scaling.items():
        if key == "truncate":
            out[key] = bool(value)
        elif key == "original_max_position_embeddings":
            out[key] = int(value)
        else:
            out[key] = value
    return out


def hf_config(
    model: MoETransformer,
    plan: ExportPlan,
    special_ids: dict[str, int | None],
    max_positions: int = 0,
) -> dict[str, Any]:
    """config.json of the exported model: the fields every family shares, then its own."""
    c, m = model.cfg, model.mcfg
    cfg: dict[str, Any] = {
        "architectures": [plan.architecture],
        "model_type": plan.model_type,
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
        "rope_parameters": rope_parameters(c),
        "tie_word_embeddings": c.tie_embeddings,
        "use_cache": True,
        "attention_dropout": 0.0,
        "initializer_range": c.init_std,
        "torch_dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        **{f"{k}_token_id": v for k, v in special_ids.items()},
    }
    cfg.update(FAMILIES[plan.model_type].hf_config_fields(c, m))
    return cfg


def _attention_out(
    c: ModelConfig, family: Family, block: Block, p: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """A block's norms and attention, with the zero biases the family's config declares."""
    a = block.attn
    yield p + "input_layernorm.weight", block.norm1.weight
    yield p + "post_attention_layernorm.weight", block.norm2.weight
    if isinstance(a, LatentAttention):
        yield from _latent_attention_out(c, family, a, p + "self_attn.")
        return
    q, k, v = a.qkv.weight.split(a.widths)
    q, k = family.qk_to_hf(q, k, c)
    for name, w in zip("qkv", (q, k, v), strict=True):
        yield p + f"self_attn.{name}_proj.weight", w
    if c.attn_bias or family.qkv_bias:
        if a.qkv.bias is not None:
            qb, kb, vb = a.qkv.bias.split(a.widths)
            qb, kb = family.qk_to_hf(qb, kb, c)
        else:
            qb, kb, vb = (torch.zeros(w, dtype=a.qkv.weight.dtype) for w in a.widths)
        for name, b in zip("qkv", (qb, kb, vb), strict=True):
            yield p + f"self_attn.{name}_proj.bias", b
    yield p + "self_attn.o_proj.weight", a.proj.weight
    if a.proj.bias is not None:
        yield p + "self_attn.o_proj.bias", a.proj.bias
    elif family.zero_biases(c):
        yield p + "self_attn.o_proj.bias", torch.zeros(c.d_model, dtype=a.proj.weight.dtype)
    if a.sinks is not None:
        yield p + "self_attn.sinks", a.sinks
    if a.q_norm is not None:
        yield p + "self_attn.q_norm.weight", a.q_norm.weight
        yield p + "self_attn.k_norm.weight", a.k_norm.weight  # type: ignore[union-attr]


def _latent_attention_out(
    c: ModelConfig, family: Family, a: LatentAttention, p: str
) -> Iterator[tuple[str, torch.Tensor]]:
    """Multi-head latent attention as DeepSeek-V3's projections."""
    q = a.q_b.weight if a.q_rank else a.q.weight
    q, kv_a = family.qk_to_hf(q, a.kv_a.weight, c)
    if a.q_rank:
        yield p + "q_a_proj.weight", a.q_a.weight
        yield p + "q_a_layernorm.weight", a.q_norm.weight
        yield p + "q_b_proj.weight", q
    else:
        yield p + "q_proj.weight", q
    yield p + "kv_a_proj_with_mqa.weight", kv_a
    yield p + "kv_a_layernorm.weight", a.kv_norm.weight
    yield p + "kv_b_proj.weight", a.kv_b.weight
    yield p + "o_proj.weight", a.proj.weight


def _swiglu_out(
    module: torch.nn.Module, prefix: str, zeros: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """A dense feed-forward or shared expert (w1, w3, w2) as gate/up/down projections."""
    for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        w = getattr(module, ours).weight
        yield prefix + f"{theirs}.weight", w
        if zeros:
            yield prefix + f"{theirs}.bias", torch.zeros(w.shape[0], dtype=w.dtype)


def _moe_ffn_out(
    ffn: MoELayer, family: Family, n: LayerNames, zeros: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """An MoE block: router, one tensor per expert projection, shared expert, selection bias."""
    yield n.gate, ffn.router.gate.weight
    gate = ffn.router.gate
    if gate.bias is not None or family.router_bias:
        bias = gate.bias if gate.bias is not None else gate.weight.new_zeros(gate.out_features)
        yield n.gate.removesuffix("weight") + "bias", bias
    yield from family.experts_to_hf(ffn.experts, n)
    if ffn.shared is not None:
        yield from _swiglu_out(ffn.shared, n.shared, zeros)
    if ffn.shared_gate is not None:
        yield n.mlp + "shared_expert_gate.weight", ffn.shared_gate.weight
    if family.selection_bias:
        yield n.mlp + family.selection_bias, family.bias_to_hf(ffn.router.expert_bias_E)


def hf_tensors(model: MoETransformer, plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(transformers name, tensor) for every weight of the exported model, per expert."""
    c, family = model.cfg, FAMILIES[plan.model_type]
    zeros = family.zero_biases(c)
    yield "model.embed_tokens.weight", model.embed.weight
    if not c.tie_embeddings:
        yield "lm_head.weight", model.lm_head.weight
    if zeros:  # biases on every projection but the experts'
        yield "lm_head.bias", torch.zeros(model.vocab_size, dtype=model.embed.weight.dtype)
    yield "model.norm.weight", model.norm.weight
    for i, block in enumerate(model.blocks):
        n = family.names(i)
        yield from _attention_out(c, family, block, n.p)
        if isinstance(block.ffn, MoELayer):
            yield from _moe_ffn_out(block.ffn, family, n, zeros)
        else:
            yield from _swiglu_out(block.ffn, n.p + "mlp.", zeros)


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
    with an index past moe/hf/safetensors_io.py's SHARD_BYTES), the tokenizer files of
    `tokenizer_dir`, generation_config.json and the model card. Refuses (InputError) a model
    no architecture represents exactly. Written to a temporary folder first, renamed when
    complete."""
    plan = export_plan(model, prefer)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = hf_config(model, plan, special_ids, max_positions)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    write_shards(hf_tensors(model, plan), tmp)
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
