"""The protocol of a Hugging Face architecture family (`Family`), the shapes it answers in
(`MoEShape`, `LayerNames`), and the building blocks families share.

What a family says, in one module of moe/hf/families/ (the generic readers and writers in
moe/hf/architecture.py, importer.py and exporter.py ask it; they branch on no model_type):

- config.json in: the fields it may carry beyond the common ones (`config_fields`); what it
  refuses beyond the common refusals (`sliding_window`, `refusal`); its attention
  (`qkv_bias`, `qk_norm`) and its MoE shape (`moe_shape`); whether it is a dense model
  upcycled to MoE (`upcycled`);
- tensors, both ways: each layer's names (`names`, from `mlp_module`, `expert_proj`,
  `shared_module`); its q/k rows against ours (`qk_from_hf`, `qk_to_hf`); the tensor holding
  a selection bias, if it has one (`selection_bias`, `bias_from_hf`, `bias_to_hf`); the zero
  biases its config asks for on export (`zero_biases`);
- export: its transformers class (`architecture`; "" for an import-only family), its place
  in the order exporters are tried (`export_priority`), why a model does not fit it
  (`export_refusals`) and its own config.json fields (`hf_config_fields`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from moe.hf.safetensors_io import Shards
from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import GroupedExperts


@dataclass
class MoEShape:
    """The MoE fields a checkpoint fixes (moe/hf/architecture.py puts them in MoEConfig and
    ModelConfig)."""

    num_experts: int
    top_k: int
    expert_hidden: int
    renormalize: bool
    moe_every: int = 1
    dense_layers: list[int] = field(default_factory=list)
    shared_expert: bool = False
    shared_expert_hidden: int = 0
    shared_expert_gate: bool = False
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3, GLM-4.5)
    n_group: int = 1
    topk_group: int = 1
    routed_scale: float = 1.0
    moe_fields: dict[str, Any] = field(default_factory=dict)  # further MoEConfig fields


@dataclass(frozen=True)
class LayerNames:
    """Where decoder layer i's tensors are in a transformers checkpoint."""

    p: str  # the layer: "model.layers.{i}."
    mlp: str  # its feed-forward (MoE) block
    gate: str  # the router's weight
    expert: str  # one expert, with an {e} to format
    w1: str  # an expert's gate projection (ours: w1), up projection (w3), down projection (w2)
    w3: str
    w2: str
    shared: str  # the shared expert


class Family(ABC):
    """One transformers architecture (or a few that differ only in their declared fields).
    The defaults are the common case (Qwen's names, no q/k permutation, no selection bias);
    a family overrides what differs."""

    model_type: str = ""  # config.json's model_type
    config_fields: frozenset[str] = frozenset()  # fields it adds, which moe_shape interprets
    upcycled: bool = False  # dense: each feed-forward copied into every expert on import
    qkv_bias: bool = False  # q/k/v projection biases when config.json does not say
    qk_norm: str = "none"  # ModelConfig.qk_norm: "none", "head" or "full"
    mlp_module: str = "mlp."
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_module: str = "shared_expert."
    selection_bias: str = ""  # under the MoE block: the tensor of an aux-free selection bias
    architecture: str = ""  # the transformers class exported to ("" = never exported to)
    router_bias: bool = False  # its router has a bias (exported as zeros when ours has none)
    # YaRN RoPE as transformers' ROPE_INIT_FUNCTIONS["yarn"] alone computes it (cos and sin
    # scaled; no other change to attention): accepted on import, and exported to.
    yarn: bool = False
    export_priority: int = 0  # lower is tried first (after the architecture imported from)
    # What its routing and attention can represent (the exporter refuses the rest by name):
    score_func: str = "softmax"  # how its router scores experts
    group_routing: bool = False  # group-limited top-k and a routed scaling factor
    attention: str = "gqa"  # ModelConfig.attention
    partial_rotary: bool = False  # RoPE on part of each head (partial_rotary_factor)
    # Its checkpoints hold layers past num_hidden_layers that transformers ignores (DeepSeek's
    # multi-token-prediction modules): skipped on import.
    extra_layers: bool = False

    # ------------------------------------------------------------------ config.json in

    def sliding_window(self, hf: dict[str, Any]) -> bool:
        """Whether the config asks for sliding-window attention (refused)."""
        return bool(hf.get("use_sliding_window"))

    def refusal(self, hf: dict[str, Any]) -> str | None:
        """Why the config cannot be imported exactly, beyond the common refusals."""
        return None

    def dimensions(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields the family's config sets beyond the common ones (its attention's
        shape, a partial rotation)."""
        return {}

    @abstractmethod
    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        """The MoE shape config.json says (a dense family: `moe_defaults`' experts)."""

    # ------------------------------------------------------------------ tensor names

    def names(self, i: int) -> LayerNames:
        p = f"model.layers.{i}."
        mlp = p + self.mlp_module
        w1, w3, w2 = self.expert_proj
        return LayerNames(
            p=p,
            mlp=mlp,
            gate=mlp + "gate.weight",
            expert=mlp + "experts.{e}.",
            w1=w1,
            w3=w3,
            w2=w2,
            shared=mlp + self.shared_module,
        )

    def model_fields(self, hf: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig fields config.json sets beyond the common ones (sinks, windows...)."""
        return {}

    def qk_from_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The q and k projection rows (or biases) of a checkpoint in our order."""
        return q, k

    def qk_to_hf(
        self, q: torch.Tensor, k: torch.Tensor, c: ModelConfig
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Our q and k projection rows (or biases) in the checkpoint's order."""
        return q, k

    def bias_from_hf(self, t: torch.Tensor) -> torch.Tensor:
        """The `selection_bias` tensor as our router's expert_bias_E."""
        return t

    def bias_to_hf(self, bias_E: torch.Tensor) -> torch.Tensor:
        """Our router's expert_bias_E as the `selection_bias` tensor."""
        return bias_E

    def experts_from_hf(
        self, src: Shards, n: LayerNames, experts: GroupedExperts
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(our parameter under the experts module, tensor) for one layer's routed experts,
        read from the checkpoint: one tensor per expert and projection (the common layout)."""
        w13 = torch.empty_like(experts.w13_EDG, device="cpu")
        w2 = torch.empty_like(experts.w2_EFD, device="cpu")
        F_ = experts.hidden
        for e in range(experts.num_experts):
            ep = n.expert.format(e=e)
            w13[e, :, :F_] = src.get(ep + n.w1 + ".weight").t()
            w13[e, :, F_:] = src.get(ep + n.w3 + ".weight").t()
            w2[e] = src.get(ep + n.w2 + ".weight").t()
        yield "w13_EDG", w13
        yield "w2_EFD", w2

    def experts_to_hf(
        self, experts: GroupedExperts, n: LayerNames
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) for one layer's routed experts: per expert (common)."""
        gate_EDF, up_EDF, down_EFD = experts.weights_EDF()
        for e in range(experts.num_experts):
            ep = n.expert.format(e=e)
            for name, w in ((n.w1, gate_EDF[e]), (n.w3, up_EDF[e]), (n.w2, down_EFD[e])):
                yield ep + name + ".weight", w.t().contiguous()

    def gate_up_to_hf(self, t: torch.Tensor) -> torch.Tensor:
        """A fused gate/up tensor's last dimension (2F: our [gate | up]) in the checkpoint's
        order (a LoRA B of the experts, moe/adapters/peft.py)."""
        return t

    def zero_biases(self, c: ModelConfig) -> bool:
        """Whether the exported config declares biases on every projection but the experts'
        (written as zeros: we have none)."""
        return False

    # ------------------------------------------------------------------ export

    def export_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        """Why a model of this configuration is not this architecture ([] = it is)."""
        raise NotImplementedError(f"{self.model_type} is never exported to")

    # What of our model's features beyond the common ones (FEATURES) it represents.
    features: frozenset[str] = frozenset()

    def feature_refusals(self, c: ModelConfig, m: MoEConfig) -> list[str]:
        """The features of the model this architecture does not have."""
        has = self.features | ({"YaRN RoPE"} if self.yarn else set())
        return [f"it has no {f}" for f in model_features(c, m) if f not in has]

    def hf_config_fields(self, c: ModelConfig, m: MoEConfig) -> dict[str, Any]:
        """config.json's fields of this architecture, after the common ones."""
        raise NotImplementedError(f"{self.model_type} is never exported to")


def sparse_moe_shape(hf: dict[str, Any], renormalize: bool) -> MoEShape:
    """The MoE shape in transformers' common fields (Qwen-MoE, Mixtral, OLMoE)."""
    return MoEShape(
        num_experts=int(hf.get("num_experts") or hf.get("num_local_experts")),
        top_k=int(hf["num_experts_per_tok"]),
        expert_hidden=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        renormalize=renormalize,
        moe_every=int(hf.get("decoder_sparse_step", 1)),
        dense_layers=[int(i) for i in hf.get("mlp_only_layers") or []],
    )


def interleave_rows(w: torch.Tensor, heads: int, head_dim: int, inverse: bool) -> torch.Tensor:
    """Rows of a q/k projection (per head of head_dim rows) from rotate-half order to
    interleaved pairs (inverse: back), which leaves every attention score unchanged. ERNIE
    and DeepSeek rotate interleaved pairs where we rotate halves."""
    half = head_dim // 2
    perm = torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
    if inverse:
        perm = torch.argsort(perm)
    idx = (torch.arange(heads)[:, None] * head_dim + perm[None, :]).flatten()
    return w[idx]


def first_dense(c: ModelConfig) -> int | None:
    """k when the dense blocks are exactly the first k and every other block is MoE
    (first_k_dense_replace), else None."""
    k = sum(1 for i in range(c.n_layer) if not c.is_moe_block(i))
    return k if all(c.is_moe_block(i) == (i >= k) for i in range(c.n_layer)) else None


FEATURES = (
    "attention sinks",
    "sliding-window attention",
    "attention output bias",
    "expert projection biases",
    "router logit bias",
    "clamped SwiGLU",
    "YaRN RoPE",
)


def model_features(c: ModelConfig, m: MoEConfig) -> list[str]:
    """Our model's FEATURES that only some architectures have (gpt-oss's)."""
    used = (
        c.attn_sinks,
        bool(c.sliding_layers),
        c.attn_out_bias,
        m.expert_proj_bias,
        m.router_logit_bias,
        m.activation == "clamped_swiglu",
        c.rope_type == "yarn",
    )
    return [name for name, on in zip(FEATURES, used, strict=True) if on]


def all_moe(c: ModelConfig) -> bool:
    """Whether every block of the model is an MoE block."""
    return all(c.is_moe_block(i) for i in range(c.n_layer))
