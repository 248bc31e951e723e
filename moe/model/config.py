"""The model's sections: the architecture (moe/model/transformer.py, attention.py, rope.py) and
the experts with their routing, balancing and growth (moe/model/experts.py, routing.py,
growth.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from moe.config import Problems, knob

YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "truncate",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
)


def rope_scaling_problem(rope_type: str, scaling: dict[str, float]) -> str | None:
    """Why ModelConfig.rope_scaling does not fit its rope_type, or None."""
    if rope_type == "default":
        return "must be empty with model.rope_type default" if scaling else None
    unknown = sorted(set(scaling) - set(YARN_KEYS))
    if unknown:
        return f"unknown key(s) {', '.join(unknown)}; YaRN's are {', '.join(YARN_KEYS)}"
    needed = ("factor", "original_max_position_embeddings")
    missing = [k for k in needed if k not in scaling]
    if missing:
        return f"YaRN needs {' and '.join(missing)}"
    if not all(scaling[k] > 0 for k in needed):
        return "YaRN's factor and original_max_position_embeddings must be > 0"
    return None


@dataclass
class ModelConfig:
    # The model to start from: "" = our architecture from random weights (the embedded
    # default); a local Hugging Face folder (config.json, safetensors, tokenizer.json) or a
    # folder written by `moe-pipeline model import`. The architecture fields below are then
    # read from it (moe/hf/architecture.py) and what params.yaml says about them is not used.
    init: str = ""
    # With model.init: "continue" = the pretrain stage continues pretraining the imported
    # model on the corpus (set a small pretrain.lr); "skip" = it passes the model on as it is.
    init_pretrain: Literal["continue", "skip"] = "continue"
    n_layer: int = knob(2, ge=1)  # transformer blocks
    n_head: int = knob(4, ge=1)  # attention (query) heads per block
    # Key/value heads (grouped-query attention): n_head must be a multiple (0 = n_head).
    n_kv_head: int = knob(0, ge=0, note=" (0 = n_head)")
    # Width of one attention head (0 = d_model / n_head); Qwen3 sets it explicitly.
    head_dim: int = knob(0, ge=0, note=" (0 = d_model / n_head)")
    d_model: int = knob(128, ge=1)  # width of the residual stream
    # 192: the longest generated example (a join: schema, question and SQL) is ~180 tokens
    seq_len: int = knob(192, ge=1)
    moe_every: int = knob(1, ge=1)  # an MoE feed-forward in every Nth block (1 = every block)
    # Blocks (0-based) that stay dense whatever moe_every says (Hugging Face's mlp_only_layers)
    dense_layers: list[int] = field(default_factory=list)
    dense_hidden: int = knob(512, ge=1)  # feed-forward width of the non-MoE blocks
    tie_embeddings: bool = True  # the output head shares the token embedding's weights
    # RMSNorm on queries and keys before the rotation: per head (Qwen3), over the whole
    # projection (OLMoE), or none.
    qk_norm: Literal["none", "head", "full"] = "none"
    attn_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    # Rotary positions on the first rotary_dim features of each head only (GLM-4.5 rotates
    # half of each head); 0 = the whole head.
    rotary_dim: int = knob(0, ge=0, note=" (0 = the whole head)")
    # "gqa": grouped-query heads. "mla": DeepSeek-V3's multi-head latent attention, keys and
    # values read from one compressed latent per token; head_dim is then the width of a
    # query/key head's un-rotated part (qk_nope_head_dim).
    attention: Literal["gqa", "mla"] = "gqa"
    # mla: width of the compressed query (q_lora_rank); 0 = an uncompressed query projection.
    mla_q_rank: int = knob(0, ge=0, note=" (0 = an uncompressed query projection)")
    mla_kv_rank: int = knob(64, ge=1)  # mla: width of the key/value latent (kv_lora_rank)
    # mla: the rotated part of each query and key head, one key part shared by all heads
    # (qk_rope_head_dim).
    mla_rope_dim: int = knob(16, ge=2)
    mla_v_dim: int = knob(0, ge=0, note=" (0 = head_dim)")  # mla: width of a value head
    attn_out_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    # A learned logit per head in the denominator of its attention softmax, attended to with
    # no value, so that a head can attend to nothing (gpt-oss's attention sinks).
    attn_sinks: bool = False
    # Sliding-window attention: a query of a block in sliding_layers sees itself and the
    # sliding_window - 1 tokens before it (0 = no window).
    sliding_window: int = knob(0, ge=0, note=" (0 = no window)")
    # Blocks (0-based) with the sliding window; the others see every earlier token (gpt-oss
    # alternates them).
    sliding_layers: list[int] = field(default_factory=list)
    rope_theta: float = knob(10_000.0, gt=0)  # base of the rotary position frequencies
    # RoPE scaling: default = plain RoPE; yarn = YaRN (Peng et al. 2023: frequencies
    # interpolated by band, cos and sin scaled by an attention factor) with rope_scaling.
    rope_type: Literal["default", "yarn"] = "default"
    # YaRN's numbers as a checkpoint gives them (moe/model/rope.py): factor and
    # original_max_position_embeddings, optionally beta_fast, beta_slow, truncate (1 or 0),
    # attention_factor, mscale, mscale_all_dim.
    rope_scaling: dict[str, float] = field(default_factory=dict)
    norm_eps: float = knob(1e-5, gt=0)  # epsilon of every RMSNorm
    init_std: float = knob(0.02, gt=0)  # std of the normal init of linear and embedding weights

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_width(self) -> int:
        return self.head_dim or self.d_model // max(self.n_head, 1)

    @property
    def rope_width(self) -> int:
        """The rotated features of a query or key head."""
        if self.attention == "mla":
            return self.mla_rope_dim
        return self.rotary_dim or self.head_width

    @property
    def v_width(self) -> int:
        """The width of a value head."""
        return (self.mla_v_dim or self.head_width) if self.attention == "mla" else self.head_width

    def window(self, i: int) -> int:
        """Block i's attention window in tokens (0 = every earlier token)."""
        return self.sliding_window if i in self.sliding_layers else 0

    def is_moe_block(self, i: int) -> bool:
        """Blocks moe_every-1, 2*moe_every-1, ... are MoE, except the listed dense ones."""
        return i % self.moe_every == self.moe_every - 1 and i not in self.dense_layers

    def check(self, p: Problems) -> None:
        if self.n_head >= 1 and self.d_model >= 1 and not self.head_dim:
            p.require(
                self.d_model % self.n_head == 0,
                "d_model",
                self.d_model,
                f"must be divisible by n_head ({self.n_head}) unless model.head_dim is set",
            )
        if self.n_head >= 1 and self.d_model >= 1 and self.attention == "gqa":
            p.require(
                self.head_width % 2 == 0,
                "head_dim" if self.head_dim else "d_model",
                self.head_dim or self.d_model,
                "the head width must be even (rotary positions)",
            )
            p.require(
                self.rotary_dim <= self.head_width and self.rotary_dim % 2 == 0,
                "rotary_dim",
                self.rotary_dim,
                f"must be even and at most the head width ({self.head_width})",
            )
        if self.attention == "mla":
            p.require(
                not (self.attn_sinks or self.sliding_layers or self.attn_out_bias),
                "attention",
                self.attention,
                "latent attention has no sinks, sliding window or output bias (gpt-oss's)",
            )
            p.require(
                self.qk_norm == "none" and not self.attn_bias and not self.rotary_dim,
                "attention",
                self.attention,
                "latent attention has no q/k norm, q/k/v biases or model.rotary_dim (its"
                " rotated part is mla_rope_dim)",
            )
            p.require(
                self.mla_rope_dim % 2 == 0,
                "mla_rope_dim",
                self.mla_rope_dim,
                "must be even (rotary positions)",
            )
            p.require(
                self.n_kv_head in (0, self.n_head),
                "n_kv_head",
                self.n_kv_head,
                "must be 0 with attention: mla (every head reads the shared latent)",
            )
        if self.n_kv_head:
            p.require(
                self.n_head % self.n_kv_head == 0,
                "n_kv_head",
                self.n_kv_head,
                f"must divide n_head ({self.n_head})",
            )
        for key in ("dense_layers", "sliding_layers"):
            for i, layer in enumerate(getattr(self, key)):
                p.require(
                    0 <= layer < self.n_layer,
                    f"{key}[{i}]",
                    layer,
                    f"must be a block index in [0, {self.n_layer - 1}]",
                )
        if self.sliding_layers:
            p.require(
                self.sliding_window > 0,
                "sliding_window",
                self.sliding_window,
                "must be > 0 when model.sliding_layers names blocks",
            )
        why = rope_scaling_problem(self.rope_type, self.rope_scaling)
        p.require(why is None, "rope_scaling", self.rope_scaling, why or "")


@dataclass
class GrowthConfig:
    """Expert growth and pruning (moe/model/growth.py). Off by default."""

    enabled: bool = False  # grow experts in skewed layers and prune dead ones while pretraining
    check_every: int = knob(10, ge=1)  # steps between trigger checks
    top_fraction: float = knob(0.2, gt=0, lt=1)  # grow when the top 20% of experts...
    top_load: float = knob(0.8, gt=0, le=1)  # ...carry more than 80% of the load,
    importance_var: float = knob(
        0.25, gt=0
    )  # or the importance variance exceeds this (seed: 0.2-0.3)
    # ...and, either way, only while the layer's load CV is above this: importance also
    # reads gradient norms, uneven in a balanced layer too (bench/RESULTS.md, growth).
    min_load_cv: float = knob(0.5, ge=0)
    cooldown: int = knob(5000, ge=1)  # steps between growth events in one layer (seed: 5000)
    max_experts: int = 32  # per layer
    ema: float = knob(0.98, ge=0, lt=1)  # moving average of activation frequency and gradient norm
    ramp_steps: int = knob(100, ge=1)  # a new expert's router offset ramps from -20 to 0 over these
    # orthogonal: new weights orthogonal to the layer's experts, at their mean norm;
    # split: the hottest expert's weights plus an orthogonal component of 10% of their norm.
    # split is the default: with aux_free balancing it ends more balanced and no worse in
    # loss than orthogonal (bench/RESULTS.md, expert growth, three seeds).
    init: Literal["orthogonal", "split"] = "split"
    prune: bool = True  # merge an expert that stays under u_min into its nearest
    u_min: float = knob(
        0.05, ge=0, lt=1
    )  # prune an expert under 5% of its fair share of the load...
    prune_window: int = knob(
        1000, ge=1
    )  # ...for this many consecutive steps (merged into its nearest)
    min_experts: int = knob(2, ge=1)  # per layer, never below moe.top_k


BalancingMethod = Literal[
    "aux_loss", "z_loss", "cv_penalty", "util_aware", "rebalance", "aux_free", "warmup"
]
BALANCING_METHODS: tuple[str, ...] = get_args(BalancingMethod)


@dataclass
class MoEConfig:
    num_experts: int = knob(8, ge=1)  # routed experts per MoE layer
    top_k: int = knob(2, ge=1)  # experts each token is sent to
    expert_hidden: int = knob(256, ge=1)  # feed-forward width of one expert
    # Dropless: every routed token is computed. Otherwise an expert takes at most
    # capacity_factor * tokens * top_k / num_experts assignments per batch and the
    # lowest-scoring overflow is dropped (its residual passes through).
    dropless: bool = True
    capacity_factor: float = 1.25  # with dropless off: an expert's capacity in fair shares
    # Typical: 1.2-1.5 early (routing still moves), 0.8-1.0 late. Above 0: capacity_factor moves linearly to this
    # value over the training run; 0 = constant.
    capacity_factor_end: float = knob(0.0, ge=0, note=" (0 = constant capacity_factor)")
    # Renormalise the kept top-k weights to sum to 1; at top-1 the one choice then weighs 1
    # (Mixtral, Qwen3-MoE's norm_topk_prob), so the language-model loss no longer trains the
    # gate. false: the router's probabilities as they are (Switch's top-1, where the gate
    # learns through the weight). auto: renormalise at top-k > 1, not at top-1 (a model built
    # here); an import sets it to what the family does.
    renormalize: Literal["auto", True, False] = "auto"
    jitter: float = knob(
        0.0, ge=0, lt=1
    )  # Switch: multiply router inputs by U(1-jitter, 1+jitter) in training
    # Load balancing; any combination of the methods in BALANCING_METHODS (see moe/model/routing.py):
    balancing: list[BalancingMethod] = field(default_factory=lambda: ["aux_free", "z_loss"])
    aux_loss_coef: float = knob(0.01, ge=0)  # aux_loss: Switch/GShard E * sum f_i * P_i
    z_loss_coef: float = knob(0.001, ge=0)  # z_loss: ST-MoE router z-loss
    cv_penalty_coef: float = knob(0.01, ge=0)  # cv_penalty: std/mean of expert load
    util_alpha: float = knob(0.2, ge=0)  # util_aware: alpha (0.1-0.3 is the usual range)
    util_momentum: float = knob(
        0.99, ge=0, lt=1
    )  # util_aware/rebalance: moving average of utilisation
    rebalance_every: int = knob(1000, ge=1)  # rebalance: recalibrate the gate every this many steps
    rebalance_beta: float = knob(
        0.1, gt=0, lt=1
    )  # rebalance: gate row e *= 1 - beta * (util_e - 1)
    # aux_free: the bias update speed u. DeepSeek-V3 uses 0.001 over ~15T tokens; in a run of a
    # few hundred steps that moves the bias too little (measured: MaxVio 1.47 after 100 steps at
    # 0.001, 0.17 at 0.01; bench/RESULTS.md).
    aux_free_rate: float = knob(0.01, gt=0)
    warmup_steps: int = knob(50, ge=0)  # warmup: uniform routing for this many pretraining steps...
    warmup_blend_steps: int = knob(
        50, ge=0
    )  # ...then the router's choice blended in over this many
    router_lr_mult: float = knob(3.0, gt=0)  # routers learn 3-5x faster than the base rate
    shared_expert: bool = False  # an always-on expert beside the routed ones (DeepSeek/Qwen2-MoE)
    shared_expert_hidden: int = knob(0, ge=0, note=" (0 = expert_hidden)")  # its feed-forward width
    # The shared expert's output scaled by sigmoid(a learned gate) per token (Qwen2-MoE).
    shared_expert_gate: bool = False
    # How the router scores experts: a softmax over them (Mixtral, Qwen), or an independent
    # sigmoid per expert (DeepSeek-V3, GLM-4.5; the chosen weights then renormalised when
    # moe.renormalize). aux_free's bias is added to these scores to choose.
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    # Group-limited routing (DeepSeek-V3): the experts in n_group equal groups, each scored by
    # its two best scores; a token chooses among its topk_group best groups only. 1 = none.
    n_group: int = knob(1, ge=1)
    topk_group: int = knob(1, ge=1)  # with n_group > 1: the groups a token may route into
    # The routed experts' combined output times this (DeepSeek-V3's routed_scaling_factor).
    routed_scale: float = knob(1.0, gt=0)
    # The experts' activation: swiglu = silu(gate) * up; clamped_swiglu (gpt-oss) = gate *
    # sigmoid(act_alpha * gate) * (up + 1), gate clamped above at act_limit, up to
    # [-act_limit, act_limit].
    activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"
    act_alpha: float = knob(1.702, gt=0)  # clamped_swiglu: the gain inside the sigmoid
    act_limit: float = knob(7.0, gt=0)  # clamped_swiglu: where the gate and up are clamped
    # Biases on each expert's gate/up and down projections (gpt-oss).
    expert_proj_bias: bool = False
    # A learned bias on the router's logits, which both chooses and weights experts (gpt-oss).
    router_logit_bias: bool = False
    force_balanced: bool = False  # debug: round-robin routing, for throughput/memory tests
    # Expert growth and pruning while training (moe/model/growth.py); off by default.
    growth: GrowthConfig = field(default_factory=GrowthConfig)

    def renormalizes(self) -> bool:
        """Whether the kept top-k weights are renormalised (moe.renormalize, auto resolved)."""
        return self.top_k > 1 if self.renormalize == "auto" else bool(self.renormalize)

    def check(self, p: Problems) -> None:
        if self.growth.enabled:
            for key in ("expert_proj_bias", "router_logit_bias"):
                p.require(
                    not getattr(self, key),
                    key,
                    getattr(self, key),
                    "expert growth does not grow these biases: turn moe.growth.enabled off",
                )
            p.require(
                self.growth.max_experts >= self.num_experts,
                "growth.max_experts",
                self.growth.max_experts,
                f"must be >= moe.num_experts ({self.num_experts})",
            )
            p.require(
                self.growth.min_experts >= self.top_k,
                "growth.min_experts",
                self.growth.min_experts,
                f"must be >= moe.top_k ({self.top_k})",
            )
        p.require(
            self.top_k <= self.num_experts,
            "top_k",
            self.top_k,
            f"must be <= moe.num_experts ({self.num_experts})",
        )
        if not self.dropless:
            p.require(
                self.capacity_factor > 0,
                "capacity_factor",
                self.capacity_factor,
                "must be > 0 when moe.dropless is false",
            )
        if self.n_group > 1:
            p.require(
                not self.growth.enabled,
                "growth.enabled",
                self.growth.enabled,
                "expert growth changes the expert count that moe.n_group divides into groups",
            )
            size = self.num_experts // self.n_group
            p.require(
                self.num_experts % self.n_group == 0 and size >= 2,
                "n_group",
                self.n_group,
                f"must divide moe.num_experts ({self.num_experts}) into groups of 2 or more",
            )
            p.require(
                self.topk_group <= self.n_group and self.top_k <= self.topk_group * size,
                "topk_group",
                self.topk_group,
                f"must be <= moe.n_group ({self.n_group}) and its groups must hold moe.top_k"
                f" ({self.top_k}) experts",
            )
        p.require(
            not (self.score_func == "sigmoid" and "util_aware" in self.balancing),
            "balancing",
            self.balancing,
            "util_aware scales softmax logits; it does not apply with score_func: sigmoid",
        )
        p.require(
            len(set(self.balancing)) == len(self.balancing),
            "balancing",
            self.balancing,
            "names a method twice",
        )
