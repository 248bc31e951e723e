"""Qwen3-MoE (Qwen3MoeForCausalLM): q/k RMSNorm per head, optional attention biases,
top-k weights renormalised when norm_topk_prob, dense blocks by decoder_sparse_step and
mlp_only_layers, no shared expert. Tensor names: the protocol's defaults."""

from __future__ import annotations

from typing import Any

from moe.hf.families.protocol import Family, MoEShape, sparse_moe_shape
from moe.model.config import ModelConfig, MoEConfig


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    export_priority = 0
    qk_norm = "head"
    yarn = True  # its rotary embedding is transformers' common one (tests/test_hf.py)
    config_fields = frozenset(
        {
            "attention_bias",
            "decoder_sparse_step",
            "mlp_only_layers",
            "moe_intermediate_size",
            "norm_topk_prob",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
        }
    )

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return sparse_moe_shape(hf, renormalize=bool(hf.get("norm_topk_prob", False)))

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm is not per head"] * (c.qk_norm != "head")
        reasons += ["it has no shared expert"] * m.shared_expert
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {**qwen_sparse_fields(c, m), "attention_bias": c.attn_bias}


def qwen_sparse_fields(c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
    """The sparse-MoE config fields Qwen2-MoE and Qwen3-MoE write alike."""
    return {
        "num_experts_per_tok": m.top_k,
        "num_experts": m.num_experts,
        "norm_topk_prob": m.renormalizes(),
        "intermediate_size": c.dense_hidden,
        "moe_intermediate_size": m.expert_hidden,
        "decoder_sparse_step": c.moe_every,
        "mlp_only_layers": list(c.dense_layers),
        "use_sliding_window": False,
        "sliding_window": None,
    }


QWEN3_MOE = Qwen3Moe()
