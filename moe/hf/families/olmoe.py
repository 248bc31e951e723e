"""OLMoE (OlmoeForCausalLM): q/k RMSNorm over the full projection width (so the q width is
d_model), every block MoE, no attention biases, no shared expert, top-k weights renormalised
when norm_topk_prob. clip_qkv is refused (not implemented)."""

from __future__ import annotations

from typing import Any

from moe.hf.families.protocol import Family, MoEShape, all_moe, sparse_moe_shape
from moe.model.config import ModelConfig, MoEConfig


class Olmoe(Family):
    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    export_priority = 3
    qk_norm = "full"
    config_fields = frozenset(
        {
            "attention_bias",
            "clip_qkv",
            "norm_topk_prob",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
        }
    )

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return sparse_moe_shape(hf, renormalize=bool(hf.get("norm_topk_prob", False)))

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm is over the full width"] * (c.qk_norm != "full")
        reasons += ["attention biases"] * c.attn_bias
        reasons += ["it has no shared expert"] * m.shared_expert
        reasons += ["it has no dense blocks"] * (not all_moe(c))
        reasons += ["q width must equal d_model"] * (c.n_head * c.head_width != c.d_model)
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {
            "num_experts_per_tok": m.top_k,
            "num_experts": m.num_experts,
            "norm_topk_prob": m.renormalizes(),
            "intermediate_size": m.expert_hidden,
            "attention_bias": False,
            "clip_qkv": None,
        }


OLMOE = Olmoe()
