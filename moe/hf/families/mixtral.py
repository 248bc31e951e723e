"""Mixtral (MixtralForCausalLM): every block MoE, top-k weights always renormalised, no
attention biases, no q/k norm, no shared expert. Its MoE block is `block_sparse_moe` and an
expert's projections are w1 (gate), w3 (up) and w2 (down), as ours; a sliding_window in its
config means sliding-window attention (it has no use_sliding_window switch)."""

from __future__ import annotations

from typing import Any

from moe.hf.families.protocol import Family, MoEShape, all_moe, sparse_moe_shape
from moe.model.config import ModelConfig, MoEConfig


class Mixtral(Family):
    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    export_priority = 1
    mlp_module = "block_sparse_moe."
    expert_proj = ("w1", "w3", "w2")
    config_fields = frozenset({"num_local_experts", "num_experts_per_tok"})

    def sliding_window(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("use_sliding_window")) or hf.get("sliding_window") not in (None, 0)

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return sparse_moe_shape(hf, renormalize=True)

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm"] * (c.qk_norm != "none")
        reasons += ["attention biases"] * c.attn_bias
        reasons += ["it has no shared expert"] * m.shared_expert
        reasons += ["it renormalises top-k weights"] * (not m.renormalizes() and m.num_experts > 1)
        reasons += ["it has no dense blocks"] * (not all_moe(c))
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {
            "num_experts_per_tok": m.top_k,
            "intermediate_size": m.expert_hidden,
            "num_local_experts": m.num_experts,
            "sliding_window": None,
        }


MIXTRAL = Mixtral()
