"""gpt-oss (GptOssForCausalLM, OpenAI 2025): every block MoE; attention with sinks (a learned
logit per head in the softmax's denominator, `self_attn.sinks`), biases on q, k, v and o
(attention_bias), and a sliding window on the blocks layer_types calls sliding_attention
(gpt-oss alternates them); YaRN RoPE; a router with a bias (`mlp.router.{weight,bias}`) whose
top-k logits are softmaxed (the top-k of the softmax, renormalised: our renormalize);
experts with biases and the clamped SwiGLU (swiglu_alpha, swiglu_limit).

- Its experts are stored 3-D, not per expert: `mlp.experts.gate_up_proj` (E, D, 2F) with the
  gate and up columns interleaved (gate 0, up 0, gate 1, ...: ours are [gate | up] halves),
  `gate_up_proj_bias` (E, 2F), `down_proj` (E, F, D), `down_proj_bias` (E, D).
- The released checkpoints store the experts in MXFP4 (quantization_config quant_method
  mxfp4): `gate_up_proj_blocks`/`_scales` and `down_proj_blocks`/`_scales`, uint8. They are
  dequantised on import by transformers' own `convert_moe_packed_tensors`
  (transformers.integrations.mxfp4), so that import needs transformers installed; the
  values are FP4 times a power of two, exact in bf16 and fp32.
- experts_per_token and initial_context_length, which the released config.json carries
  beside num_experts_per_tok and YaRN's original_max_position_embeddings, are not read by
  transformers and not by us."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from moe.hf.errors import refuse
from moe.hf.families.protocol import FEATURES, Family, LayerNames, MoEShape, all_moe
from moe.hf.safetensors_io import Shards
from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import GroupedExperts

LAYER_TYPES = ("sliding_attention", "full_attention")


def interleave(t: torch.Tensor) -> torch.Tensor:
    """The last dimension from our [gate | up] halves to gpt-oss's interleaved columns."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def deinterleave(t: torch.Tensor) -> torch.Tensor:
    """The last dimension from gpt-oss's interleaved gate/up columns to [gate | up]."""
    return torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)


def dequantised(src: Shards, name: str) -> torch.Tensor:
    """An MXFP4 expert tensor (`name`_blocks, `name`_scales) as transformers dequantises it:
    (E, in, out), bf16 (exact)."""
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError as e:
        raise refuse(
            src.folder,
            f"{name}_blocks is MXFP4: importing it needs transformers installed (its"
            f" dequantisation is the reference; {e})",
        ) from e
    blocks, scales = src.get_packed(name + "_blocks"), src.get_packed(name + "_scales")
    return convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)


class GptOss(Family):
    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    export_priority = 5
    qkv_bias = True  # transformers' attention_bias default
    config_fields = frozenset(
        {
            "attention_bias",
            "num_local_experts",
            "num_experts_per_tok",
            "experts_per_token",
            "swiglu_alpha",
            "swiglu_limit",
            "quantization_config",
            "initial_context_length",
        }
    )
    features = frozenset(FEATURES)
    router_bias = True
    yarn = True

    def sliding_window(self, hf: dict[str, Any]) -> bool:
        return False  # honoured: layer_types and sliding_window (model_fields)

    def refusal(self, hf: dict[str, Any]) -> str | None:
        quant = hf.get("quantization_config") or {}
        if quant and quant.get("quant_method") != "mxfp4":
            return f"quantization_config quant_method {quant.get('quant_method')!r} (only mxfp4)"
        types = hf.get("layer_types") or []
        odd = sorted({t for t in types if t not in LAYER_TYPES})
        if odd:
            return f"layer_types {', '.join(odd)} are not implemented (only {LAYER_TYPES})"
        if types and len(types) != int(hf["num_hidden_layers"]):
            return f"layer_types has {len(types)} entries for {hf['num_hidden_layers']} layers"
        return None

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        n_layer = int(hf["num_hidden_layers"])
        # transformers' default: sliding, full, sliding, ...
        types = hf.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(n_layer)]
        window = int(hf.get("sliding_window") or 0)
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if window else []
        return {
            "attn_out_bias": bool(hf.get("attention_bias", True)),
            "attn_sinks": True,
            "sliding_window": window if sliding else 0,
            "sliding_layers": sliding,
        }

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return MoEShape(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            expert_hidden=int(hf["intermediate_size"]),
            renormalize=True,
            moe_fields={
                "activation": "clamped_swiglu",
                "act_alpha": float(hf.get("swiglu_alpha", 1.702)),
                "act_limit": float(hf.get("swiglu_limit", 7.0)),
                "expert_proj_bias": True,
                "router_logit_bias": True,
            },
        )

    def names(self, i: int) -> LayerNames:
        n = super().names(i)
        return dataclasses.replace(n, gate=n.mlp + "router.weight")

    def experts_from_hf(
        self, src: Shards, n: LayerNames, experts: GroupedExperts
    ) -> Iterator[tuple[str, torch.Tensor]]:
        e = n.mlp + "experts."
        if e + "gate_up_proj_blocks" in src:
            gate_up, down = dequantised(src, e + "gate_up_proj"), dequantised(src, e + "down_proj")
        else:
            gate_up, down = src.get(e + "gate_up_proj"), src.get(e + "down_proj")
        yield "w13_EDG", deinterleave(gate_up)
        yield "w2_EFD", down
        yield "b13_EG", deinterleave(src.get(e + "gate_up_proj_bias"))
        yield "b2_ED", src.get(e + "down_proj_bias")

    def experts_to_hf(
        self, experts: GroupedExperts, n: LayerNames
    ) -> Iterator[tuple[str, torch.Tensor]]:
        e = n.mlp + "experts."
        w13, w2 = experts.w13_EDG, experts.w2_EFD
        b13 = experts.b13_EG if experts.b13_EG is not None else w13.new_zeros(w13.shape[::2])
        b2 = experts.b2_ED if experts.b2_ED is not None else w2.new_zeros(w2.shape[::2])
        yield e + "gate_up_proj", interleave(w13)
        yield e + "gate_up_proj_bias", interleave(b13)
        yield e + "down_proj", w2
        yield e + "down_proj_bias", b2

    def gate_up_to_hf(self, t: torch.Tensor) -> torch.Tensor:
        return interleave(t)

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm"] * (c.qk_norm != "none")
        reasons += ["it has no shared expert"] * m.shared_expert
        reasons += ["it has no dense blocks"] * (not all_moe(c))
        reasons += ["it always renormalises top-k weights"] * (
            not m.renormalizes() and m.num_experts > 1
        )
        reasons += ["it always has attention sinks"] * (not c.attn_sinks)
        reasons += ["its experts' activation is the clamped SwiGLU"] * (
            m.activation != "clamped_swiglu"
        )
        reasons += ["its attention biases are on all of q, k, v and o or on none"] * (
            c.attn_bias != c.attn_out_bias
        )
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {
            "num_local_experts": m.num_experts,
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.expert_hidden,
            "swiglu_alpha": m.act_alpha,
            "swiglu_limit": m.act_limit,
            "attention_bias": c.attn_bias,
            "sliding_window": c.sliding_window or None,
            "layer_types": [
                "sliding_attention" if i in c.sliding_layers else "full_attention"
                for i in range(c.n_layer)
            ],
        }


GPT_OSS = GptOss()
