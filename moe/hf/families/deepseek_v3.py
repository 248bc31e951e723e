"""The DeepSeek-V3 line: DeepSeek-V3 (DeepseekV3ForCausalLM) and Kimi K2, its architecture
under another model_type (import only; it exports as deepseek_v3).

- Multi-head latent attention (our `attention: mla`): `q_a_proj`, `q_a_layernorm`,
  `q_b_proj` (or one `q_proj` when q_lora_rank is null), `kv_a_proj_with_mqa` (the latent
  and the shared rotated key part), `kv_a_layernorm`, `kv_b_proj`, `o_proj`. With
  rope_interleave (DeepSeek's layout) RoPE turns interleaved pairs where we rotate halves:
  the rotated rows of q_b_proj (per head) and of kv_a_proj_with_mqa are our rows permuted,
  which leaves every attention score unchanged.
- Sigmoid routing with the aux-free correction bias (`mlp.gate.e_score_correction_bias`,
  our expert_bias_E, trained by our `aux_free` balancing), group-limited top-k (n_group,
  topk_group), routed_scaling_factor, top-k weights renormalised when norm_topk_prob.
- An ungated shared expert of n_shared_experts expert widths (`mlp.shared_experts.*`); the
  first first_k_dense_replace blocks dense (intermediate_size).
- The multi-token-prediction layers of a released checkpoint (model.layers.N, N =
  num_hidden_layers) are not part of transformers' model and are skipped, as it skips them.

YaRN as its released configs carry it (factor, mscale, mscale_all_dim: the rotary tables of
moe/model/rope.py and the softmax scale's mscale squared). Refused by name: another RoPE
scaling, attention biases, the V2 routers (topk_method other than noaux_tc, softmax
scoring), a quantised (FP8) release."""

from __future__ import annotations

from typing import Any

import torch

from moe.hf.families.protocol import Family, MoEShape, first_dense, interleave_rows
from moe.model.config import ModelConfig, MoEConfig

# Fields of DeepSeek's own config.json (its remote code) that transformers' config also takes.
DEEPSEEK_FIELDS = frozenset(
    {
        "moe_intermediate_size",
        "n_routed_experts",
        "n_shared_experts",
        "num_experts_per_tok",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "norm_topk_prob",
        "first_k_dense_replace",
        "num_nextn_predict_layers",
        "scoring_func",
        "topk_method",
        "moe_layer_freq",
        "aux_loss_alpha",
        "seq_aux",
        "ep_size",
        "attention_bias",
    }
)


# What transformers' DeepseekV3Config takes when config.json leaves a field out (a field
# absent means its default there, not ours; tests/test_hf.py holds these to its class).
DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}


def sigmoid_moe_shape(hf: dict[str, Any], n_layer: int, defaults: dict[str, Any]) -> MoEShape:
    """The MoE shape of DeepSeek-V3's and GLM-4.5's fields (`defaults`: their transformers
    config class's, for a field config.json leaves out)."""

    def get(key: str) -> Any:
        value = hf.get(key, defaults.get(key))
        return defaults.get(key) if value is None else value

    E = int(hf["n_routed_experts"])
    expert_hidden = int(hf["moe_intermediate_size"])
    n_shared = int(get("n_shared_experts") or 0)
    k = int(get("first_k_dense_replace") or 0)
    return MoEShape(
        num_experts=E,
        top_k=int(hf["num_experts_per_tok"]),
        expert_hidden=expert_hidden,
        renormalize=bool(get("norm_topk_prob")),
        dense_layers=list(range(min(k, n_layer))),
        shared_expert=n_shared > 0,
        shared_expert_hidden=n_shared * expert_hidden,
        score_func="sigmoid",
        n_group=int(get("n_group")),
        topk_group=int(get("topk_group")),
        routed_scale=float(get("routed_scaling_factor")),
    )


def sigmoid_refusal(hf: dict[str, Any]) -> str | None:
    """The routing fields of this line that we do not implement."""
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        return f"scoring_func = {hf['scoring_func']!r} is not implemented (only sigmoid)"
    if hf.get("topk_method", "noaux_tc") != "noaux_tc":
        return (
            f"topk_method = {hf['topk_method']!r} (a DeepSeek-V2 router) is not implemented"
            " (only noaux_tc)"
        )
    if int(hf.get("moe_layer_freq", 1)) != 1:
        return f"moe_layer_freq = {hf['moe_layer_freq']} is not implemented (only 1)"
    if hf.get("n_shared_experts", 1) == 0:
        return "n_shared_experts = 0 is not implemented (transformers builds an empty expert)"
    return None


def sigmoid_refusals(c: ModelConfig, m: MoEConfig) -> list[str]:
    """Why a model of ours does not fit this line's MoE layout (DeepSeek-V3 and GLM-4.5)."""
    reasons = []
    if m.score_func != "sigmoid":
        reasons.append("its router scores experts with a sigmoid")
    if first_dense(c) is None:
        reasons.append("its dense blocks are the first first_k_dense_replace ones only")
    if not m.shared_expert or m.shared_expert_gate:
        reasons.append("it has one ungated shared expert")
    elif (m.shared_expert_hidden or m.expert_hidden) % m.expert_hidden:
        reasons.append("its shared width is a multiple of the expert width")
    if m.n_group > 1 and m.num_experts // m.n_group < 2:
        reasons.append("its expert groups hold 2 experts or more")
    return reasons


def sigmoid_fields(c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
    """The MoE fields DeepSeek-V3 and GLM-4.5 write alike."""
    return {
        "intermediate_size": c.dense_hidden,
        "moe_intermediate_size": m.expert_hidden,
        "n_routed_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "n_shared_experts": (m.shared_expert_hidden or m.expert_hidden) // m.expert_hidden,
        "n_group": m.n_group,
        "topk_group": m.topk_group if m.n_group > 1 else 1,
        "routed_scaling_factor": m.routed_scale,
        "norm_topk_prob": m.renormalizes(),
        "first_k_dense_replace": first_dense(c),
        "num_nextn_predict_layers": 0,
    }


def _rope_rows(w: torch.Tensor, groups: int, width: int, rope: int, inverse: bool) -> torch.Tensor:
    """The rotated rows (the last `rope` of each group of `width`) permuted between DeepSeek's
    interleaved pairs and our halves; the other rows kept."""
    w = w.clone()
    for g in range(groups):
        at = g * width + width - rope
        w[at : at + rope] = interleave_rows(w[at : at + rope], 1, rope, inverse)
    return w


class DeepseekV3(Family):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    export_priority = 6
    shared_module = "shared_experts."
    selection_bias = "gate.e_score_correction_bias"
    score_func = "sigmoid"
    group_routing = True
    attention = "mla"
    extra_layers = True
    yarn = True  # the rotary tables' YaRN, and its mscale on the softmax (LatentAttention)
    config_fields = DEEPSEEK_FIELDS | {
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "rope_interleave",
    }

    def refusal(self, hf: dict[str, Any]) -> str | None:
        if hf.get("attention_bias"):
            return "attention_bias = true is not implemented for multi-head latent attention"
        if hf.get("rope_interleave", True) is not True:
            return "rope_interleave = false is not implemented (DeepSeek's layout is interleaved)"
        heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads")
        if kv is not None and kv != heads:
            return (
                f"num_key_value_heads = {kv} differs from num_attention_heads = {heads}: "
                "every head of multi-head latent attention reads the shared latent"
            )
        return sigmoid_refusal(hf)

    def dimensions(self, hf: dict[str, Any]) -> dict[str, Any]:
        d = {**DEEPSEEK_DEFAULTS, **hf}
        nope, v = int(d["qk_nope_head_dim"]), int(d["v_head_dim"])
        return {
            "attention": "mla",
            "head_dim": nope,
            "n_kv_head": 0,
            "mla_q_rank": int(d["q_lora_rank"] or 0),  # null: one uncompressed q_proj
            "mla_kv_rank": int(d["kv_lora_rank"]),
            "mla_rope_dim": int(d["qk_rope_head_dim"]),
            "mla_v_dim": v if v != nope else 0,
        }

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        return sigmoid_moe_shape(hf, n_layer, DEEPSEEK_DEFAULTS)

    def qk_from_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: q_b_proj (or q_proj) rows; k: kv_a_proj_with_mqa rows [latent | rope]."""
        qk = c.head_width + c.mla_rope_dim
        q = _rope_rows(q, c.n_head, qk, c.mla_rope_dim, inverse=True)
        k = _rope_rows(k, 1, k.shape[0], c.mla_rope_dim, inverse=True)
        return q, k

    def qk_to_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qk = c.head_width + c.mla_rope_dim
        q = _rope_rows(q, c.n_head, qk, c.mla_rope_dim, inverse=False)
        k = _rope_rows(k, 1, k.shape[0], c.mla_rope_dim, inverse=False)
        return q, k

    def bias_to_hf(self, bias_E: torch.Tensor) -> torch.Tensor:
        return bias_E.float()

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        reasons = sigmoid_refusals(c, m)
        reasons += ["q/k norm"] * (c.qk_norm != "none")
        reasons += ["attention biases"] * c.attn_bias
        return reasons

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        return {
            **sigmoid_fields(c, m),
            "num_key_value_heads": c.n_head,
            "head_dim": c.mla_rope_dim,
            "q_lora_rank": c.mla_q_rank or None,
            "kv_lora_rank": c.mla_kv_rank,
            "qk_nope_head_dim": c.head_width,
            "qk_rope_head_dim": c.mla_rope_dim,
            "v_head_dim": c.v_width,
            "rope_interleave": True,
            "attention_bias": False,
        }


class KimiK2(DeepseekV3):
    """Kimi K2: DeepSeek-V3's architecture and tensors under model_type kimi_k2."""

    model_type = "kimi_k2"
    architecture = ""  # exported as deepseek_v3, the class transformers has


DEEPSEEK_V3 = DeepseekV3()
KIMI_K2 = KimiK2()
