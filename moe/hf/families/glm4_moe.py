"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): DeepSeek-V3's MoE layer (sigmoid routing
with the aux-free correction bias, group-limited top-k, routed_scaling_factor, an ungated
shared expert, the first first_k_dense_replace blocks dense) under grouped-query attention
with q/k/v biases (attention_bias), q/k RMSNorm per head when use_qk_norm, and RoPE on the
first partial_rotary_factor of each head (rotate-half, as ours). Its multi-token-prediction
layer in a released checkpoint is skipped, as transformers skips it.

This is where a model of ours with the default attention and sigmoid routing exports (an
aux-free model trained with `score_func: sigmoid`)."""

from __future__ import annotations

from typing import Any

import torch

from moe.hf.families.deepseek_v3 import (
    DEEPSEEK_FIELDS,
    sigmoid_fields,
    sigmoid_moe_shape,
    sigmoid_refusal,
    sigmoid_refusals,
)
from moe.hf.families.protocol import Family, MoEShape
from moe.model.config import ModelConfig, MoEConfig

# What transformers' Glm4MoeConfig takes when config.json leaves a field out
# (tests/test_hf.py holds these to its class).
GLM_DEFAULTS: dict[str, Any] = {
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "partial_rotary_factor": 0.5,
}


class Glm4Moe(Family):
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    export_priority = 5
    shared_module = "shared_experts."
    selection_bias = "gate.e_score_correction_bias"
    score_func = "sigmoid"
    group_routing = True
    partial_rotary = True
    extra_layers = True
    config_fields = DEEPSEEK_FIELDS | {"use_qk_norm", "partial_rotary_factor"}

    def refusal(self, hf: dict[str, Any]) -> str | None:
        return sigmoid_refusal(hf)

    def dimensions(self, hf: dict[str, Any]) -> dict[str, Any]:
        H, D = int(hf["num_attention_heads"]), int(hf["hidden_size"])
        head = int(hf.get("head_dim") or D // H)
        params = hf.get("rope_parameters") or {}
        factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
        if factor is None:  # transformers' Glm4MoeConfig rotates half of each head
            factor = GLM_DEFAULTS["partial_rotary_factor"]
        rotary = int(head * float(factor))
        return {
            "qk_norm": "head" if hf.get("use_qk_norm") else "none",
            "rotary_dim": 0 if rotary == head else rotary,
        }

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return sigmoid_moe_shape(hf, n_layer, GLM_DEFAULTS)

    def bias_to_hf(self, bias_E: torch.Tensor) -> torch.Tensor:
        return bias_E.float()

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = sigmoid_refusals(c, m)
        reasons += ["q/k norm is per head or none"] * (c.qk_norm == "full")
        rotary = c.rotary_dim or c.head_width
        if int(c.head_width * (rotary / c.head_width)) != rotary:  # transformers' int(h * f)
            reasons.append(f"its partial_rotary_factor cannot say rotary_dim {rotary}")
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        factor = (c.rotary_dim or c.head_width) / c.head_width
        return {
            **sigmoid_fields(c, m),
            "attention_bias": c.attn_bias,
            "use_qk_norm": c.qk_norm == "head",
            "partial_rotary_factor": factor,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": c.rope_theta,
                "partial_rotary_factor": factor,
            },
        }


GLM4_MOE = Glm4Moe()
