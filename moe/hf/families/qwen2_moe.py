"""Qwen2-MoE (Qwen2MoeForCausalLM): q/k/v biases (qkv_bias, on by default), no q/k norm, and
a shared expert beside the routed ones whose output is scaled by a sigmoid gate
(`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`)."""

from __future__ import annotations

from typing import Any

from moe.hf.families.protocol import Family, MoEShape, sparse_moe_shape
from moe.hf.families.qwen3_moe import qwen_sparse_fields
from moe.model.config import ModelConfig, MoEConfig


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    export_priority = 2
    qkv_bias = True
    config_fields = frozenset(
        {
            "qkv_bias",
            "decoder_sparse_step",
            "mlp_only_layers",
            "moe_intermediate_size",
            "norm_topk_prob",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "shared_expert_intermediate_size",
        }
    )

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        shape = sparse_moe_shape(hf, renormalize=bool(hf.get("norm_topk_prob", False)))
        shape.shared_expert, shape.shared_expert_gate = True, True
        shape.shared_expert_hidden = int(hf["shared_expert_intermediate_size"])
        return shape

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm"] * (c.qk_norm != "none")
        reasons += ["its shared expert is gated"] * (not (m.shared_expert and m.shared_expert_gate))
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {
            **qwen_sparse_fields(c, m),
            "qkv_bias": True,
            "shared_expert_intermediate_size": m.shared_expert_hidden or m.expert_hidden,
        }


QWEN2_MOE = Qwen2Moe()
