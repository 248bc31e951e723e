"""ERNIE-4.5-MoE (Ernie4_5_MoeForCausalLM): top-k weights always renormalised, MoE blocks
from moe_layer_start_index to moe_layer_end_index every moe_layer_interval, an ungated shared
expert of n times the expert width (`mlp.shared_experts.*`), no q/k norm.

- It is the one architecture in transformers whose router has an aux-free selection bias (a
  bias that chooses experts but does not weight them, over softmax scores):
  `mlp.moe_statics.e_score_correction_bias`, shape (1, E), fp32, is our expert_bias_E.
- It applies RoPE to interleaved pairs where we rotate halves: its q and k projection rows
  are our rows permuted per head, which leaves every attention score unchanged.
- use_bias (biases on every projection) is refused on import; on export a model with
  attention biases declares it and writes zeros where we have no bias."""

from __future__ import annotations

from typing import Any

import torch

from moe.hf.families.protocol import Family, MoEShape, interleave_rows
from moe.model.config import ModelConfig, MoEConfig


def moe_layer_range(c: ModelConfig) -> tuple[int, int] | None:
    """The first and last MoE block, when the MoE blocks are every moe_every-th between them
    (ERNIE's start/end/interval pattern), else None."""
    moe = [i for i in range(c.n_layer) if c.is_moe_block(i)]
    if not moe:
        return None
    start, end = moe[0], moe[-1]
    same = [i for i in range(c.n_layer) if (i + 1) % c.moe_every == 0 and start <= i <= end]
    return (start, end) if same == moe else None


class Ernie45Moe(Family):
    model_type = "ernie4_5_moe"
    architecture = "Ernie4_5_MoeForCausalLM"
    export_priority = 4
    shared_module = "shared_experts."
    selection_bias = "moe_statics.e_score_correction_bias"
    config_fields = frozenset(
        {
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
        }
    )

    def refusal(self, hf: dict[str, Any]) -> str | None:
        if hf.get("use_bias"):
            return "use_bias = true (biases on every projection) is not implemented"
        return None

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        E, K = int(hf["moe_num_experts"]), int(hf["moe_k"])
        expert_hidden = int(hf["moe_intermediate_size"])
        moe_every = int(hf.get("moe_layer_interval", 1))
        start = int(hf.get("moe_layer_start_index", 0))
        end = int(hf.get("moe_layer_end_index", n_layer - 1))
        if end < 0:
            end = n_layer - 1
        dense_layers = [
            i for i in range(n_layer) if (i + 1) % moe_every == 0 and not start <= i <= end
        ]
        n_shared = int(hf.get("moe_num_shared_experts", 0))
        return MoEShape(
            num_experts=E,
            top_k=K,
            expert_hidden=expert_hidden,
            renormalize=True,
            moe_every=moe_every,
            dense_layers=dense_layers,
            shared_expert=n_shared > 0,
            shared_expert_hidden=n_shared * expert_hidden,
        )

    def qk_from_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = interleave_rows(q, c.n_head, c.head_width, inverse=True)
        k = interleave_rows(k, c.kv_heads, c.head_width, inverse=True)
        return q, k

    def qk_to_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q = interleave_rows(q, c.n_head, c.head_width, inverse=False)
        k = interleave_rows(k, c.kv_heads, c.head_width, inverse=False)
        return q, k

    def bias_from_hf(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(-1)

    def bias_to_hf(self, bias_E: torch.Tensor) -> torch.Tensor:
        return bias_E.reshape(1, -1).float()

    def zero_biases(self, c: ModelConfig) -> bool:
        return c.attn_bias

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = ["q/k norm"] * (c.qk_norm != "none")
        reasons += ["it always renormalises top-k weights"] * (
            not m.renormalizes() and m.num_experts > 1
        )
        reasons += ["its dense blocks form no start/end/interval pattern"] * (
            moe_layer_range(c) is None
        )
        reasons += ["its shared expert is ungated"] * m.shared_expert_gate
        if m.shared_expert and (m.shared_expert_hidden or m.expert_hidden) % m.expert_hidden:
            reasons.append("its shared width is a multiple of the expert width")
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        start, end = moe_layer_range(c)  # type: ignore[misc]
        shared = (m.shared_expert_hidden or m.expert_hidden) // m.expert_hidden
        return {
            "intermediate_size": c.dense_hidden,
            "moe_intermediate_size": m.expert_hidden,
            "moe_num_experts": m.num_experts,
            "moe_k": m.top_k,
            "moe_layer_start_index": start,
            "moe_layer_end_index": end,
            "moe_layer_interval": c.moe_every,
            "moe_num_shared_experts": shared if m.shared_expert else 0,
            "moe_norm_min": 1e-12,
            "use_bias": c.attn_bias,
        }


ERNIE4_5_MOE = Ernie45Moe()
