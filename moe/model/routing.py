"""Token-choice top-k router: fp32 logits, capacity, and every balancing method of the seeds.

Shape suffixes: T tokens, D model width, E experts, K experts per token.

Each method is switched on by name in `moe.balancing` (params.yaml) and they combine freely:

- `aux_loss`: Switch/GShard auxiliary loss  E * sum_i f_i * P_i  (Fedus et al. 2021, eq. 4;
  Lepikhin et al. 2020). Departure: f_i counts all top-k assignments and is normalised by
  T*K, so a perfectly balanced router scores 1.0 for any K, as in Switch's top-1 case.
- `z_loss`: router z-loss  mean(logsumexp(logits)^2)  (Zoph et al. 2022, ST-MoE, eq. 5).
- `cv_penalty`:  std(load) / mean(load). Departure from the usual form, which takes the std of the
  integer counts, which has no gradient; we take it of the soft load (the router
  probabilities summed over tokens), which is Shazeer et al. 2017's "importance" loss without
  its square.
- `util_aware`:  p_i = softmax(logit_i * (1 + alpha * (1 - util_i)))  with util_i a
  moving average of expert i's load over its fair share (1.0 = balanced). Departure: the
  logits are first shifted so the smallest is 0 (softmax does not change), because scaling
  a negative logit up would *lower* an under-used expert's share; (1 - util_i) is clipped
  to [-1, 1].
- `rebalance`: periodic gate recalibration: every `rebalance_every` optimizer
  steps, gate row i *= 1 - beta * (util_i - 1) (target utilisation 1.0), the factor clipped to
  [0.5, 1.5]. util is the same moving average as above.
- `aux_free`: auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2): a
  per-expert bias added to the scores only to *choose* experts, updated after each optimizer
  step by u * sign(mean_load - load_i) and re-centred to mean 0. The combine weights come
  from the unbiased probabilities. With the default softmax scores this departs from
  DeepSeek-V3, which biases sigmoid affinities (`score_func: sigmoid` below): we bias the
  softmax probabilities.
- `score_func: sigmoid` (DeepSeek-V3, GLM-4.5): independent sigmoid affinities instead of
  the softmax; aux_free's bias is added to them to choose, as DeepSeek-V3 does, and the
  balancing losses read them normalised per token. `n_group`/`topk_group` limit a token's
  choice to its best groups of experts (`limit_groups`), `routed_scale` multiplies the
  combine weights (routed_scaling_factor).
- `warmup`: expert warm-up: for the first `warmup_steps` pretraining steps tokens
  go to K experts drawn uniformly at random with equal weights; over the next
  `warmup_blend_steps` the router's choice and weights are blended in linearly.

`force_balanced` (debug) sends token t's k-th choice to expert (t*K + k) mod E with equal
weights: perfectly even load, for throughput and memory tests.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from moe.model.config import MoEConfig

# A step far past any warm-up: what the router assumes when nobody told it the step.
AFTER_WARMUP = 1 << 40


@dataclass
class RouterOutput:
    experts_TK: torch.Tensor  # int64 expert id of each of a token's K choices
    weights_TK: torch.Tensor  # fp32 combine weight of each choice (0 for a dropped choice)
    keep_TK: torch.Tensor | None  # bool, False where capacity dropped the choice; None = dropless
    tokens_per_expert_E: torch.Tensor  # int64 assignments routed to each expert (before drops)
    balance_loss: torch.Tensor  # fp32 scalar: the enabled losses, each times its coefficient
    aux_loss: torch.Tensor  # fp32 scalar, Switch/GShard balance loss (unscaled, for logging)
    z_loss: torch.Tensor  # fp32 scalar, ST-MoE router z-loss (unscaled)
    cv_loss: torch.Tensor  # fp32 scalar, std/mean of the soft load (unscaled)
    dropped_fraction: torch.Tensor  # fp32 scalar, fraction of assignments dropped


# A pytree node, not a leaf: FSDP2 finds the tensors of a module's output that need its
# pre-backward hook (the re-gather of the weights before their backward) by flattening the
# output, and torch 2.11's FSDP2 flattens with pytree, to which an unregistered dataclass is
# one opaque leaf. A router sharded as its own unit (bf16 training, moe/train/distributed.py)
# then had no hook: on CUDA its backward read a weight whose gathered copy was freed
# ("setStorage: ... out of bounds for storage of size 0"). torch 2.13 walks dataclasses.
torch.utils._pytree.register_dataclass(RouterOutput)


_RECOMPUTING = contextvars.ContextVar("moe_recomputing", default=False)


def recomputing() -> bool:
    """True while activation checkpointing recomputes a block's forward in the backward:
    the routing counts and the auxiliaries were recorded by the first forward already."""
    return _RECOMPUTING.get()


@contextlib.contextmanager
def recompute_context() -> Iterator[None]:
    token = _RECOMPUTING.set(True)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class Router(nn.Module):
    # Sharded training: the process group whose routed counts the aux loss's f_E sums, so
    # the loss balances the global batch (Qiu et al. 2025), as one process computes it.
    balance_group: Any = None
    # What a stage lets the router move (moe/adapters/lora.py set_router_policy): "trained"
    # (the gate learns, the routing state moves), "frozen" (nothing), "bias-only" (the
    # aux-free bias and utilisation average move; the gate and its recalibration do not).
    policy: str = "trained"

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.methods = frozenset(cfg.balancing)
        self.gate = nn.Linear(d_model, cfg.num_experts, bias=cfg.router_logit_bias)
        E = cfg.num_experts
        # Routing state that checkpoints carry (persistent buffers):
        self.register_buffer("expert_bias_E", torch.zeros(E))  # aux_free
        self.register_buffer("util_E", torch.ones(E))  # util_aware / rebalance moving average
        # Added to the scores before the softmax: 0, or very negative for an expert that
        # growth just added (so it takes no traffic until its offset ramps up).
        self.register_buffer("logit_offset_E", torch.zeros(E))
        # Assignments since the last optimizer step (training forwards only).
        self.register_buffer("load_E", torch.zeros(E), persistent=False)
        self.step = AFTER_WARMUP  # set by the trainer (MoETransformer.set_routing_step)
        self.progress = 0.0  # fraction of the run done, for the capacity schedule
        # The expert warm-up's blend as a tensor filled in place each step, and whether it
        # is below 1 (flips once): a compiled block reads both without a recompile a step.
        self.blend_t = torch.ones(())
        self.blending = False
        self.capacity_factor_t = torch.full((), cfg.capacity_factor, dtype=torch.float64)

    # ----------------------------------------------------------------- forward

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        cfg, E, K = self.cfg, self.num_experts, self.top_k
        T = x_TD.shape[0]
        # Router logits in fp32 even under bf16 autocast (ST-MoE §3: bf16 round-off
        # in the softmax's exponent destabilises routing).
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            x32_TD = x_TD.float()
            if self.training and cfg.jitter > 0:
                x32_TD = x32_TD * torch.empty_like(x32_TD).uniform_(1 - cfg.jitter, 1 + cfg.jitter)
            bias = None if self.gate.bias is None else self.gate.bias.float()
            logits_TE = F.linear(x32_TD, self.gate.weight.float(), bias)
        scores_TE = logits_TE
        if "util_aware" in self.methods:
            shifted_TE = logits_TE - logits_TE.detach().min(dim=-1, keepdim=True).values
            scale_E = 1 + cfg.util_alpha * (1 - self.util_E).clamp(-1, 1)
            scores_TE = shifted_TE * scale_E
        sigmoid = cfg.score_func == "sigmoid"
        if sigmoid:  # DeepSeek-V3: an independent affinity per expert
            probs_TE = torch.sigmoid(scores_TE + self.logit_offset_E)
        else:
            probs_TE = (scores_TE + self.logit_offset_E).softmax(dim=-1)

        # The selection bias chooses whenever it is set: aux_free moves it (update_state), and
        # an imported one (ERNIE-4.5, DeepSeek-V3, GLM-4.5) is part of the checkpoint's routing
        # whichever balancing trains it further. Zero otherwise.
        choose_TE = probs_TE.detach() + self.expert_bias_E
        blending, blend = self.blending and self.training, self.blend_t
        if cfg.force_balanced:
            slots_TK = torch.arange(T * K, device=x_TD.device).view(T, K)
            experts_TK = slots_TK % E
        else:
            if blending:
                noise_TE = torch.rand(T, E, device=x_TD.device)
                choose_TE = (1 - blend) * noise_TE + blend * choose_TE
            if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
                choose_TE = limit_groups(choose_TE, cfg.n_group, cfg.topk_group)
            experts_TK = choose_TE.topk(K, dim=-1).indices
        weights_TK = probs_TE.gather(1, experts_TK)
        if cfg.renormalizes():  # at top-1 too when set: the one choice weighs 1 (Mixtral)
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if cfg.force_balanced:
            weights_TK = torch.full_like(weights_TK, 1.0 / K)
        elif blending:
            weights_TK = (1 - blend) / K + blend * weights_TK
        if cfg.routed_scale != 1.0:
            weights_TK = weights_TK * cfg.routed_scale

        tokens_per_expert_E = count_per_expert(experts_TK, E)
        if self.training and not recomputing():  # counted once, not again in a recompute
            self.load_E += tokens_per_expert_E.to(self.load_E.dtype)
        # The balancing losses read a distribution over experts: sigmoid affinities are
        # normalised per token first (DeepSeek-V3's sequence-wise balance loss does the same).
        dist_TE = probs_TE / probs_TE.sum(dim=-1, keepdim=True) if sigmoid else probs_TE
        balance, aux_loss, z_loss, cv_loss = self._balance_losses(
            logits_TE, dist_TE, tokens_per_expert_E, T * K
        )

        keep_TK = None
        dropped = torch.zeros((), device=x_TD.device)
        if not cfg.dropless and self.training:
            # Drop by the score that chose the expert (bias included), as DeepSeek-V3 does.
            # Only in training: at evaluation and generation every token is routed, so that a
            # token's output never depends on which other tokens share its batch.
            keep_TK = capacity_mask(
                experts_TK, choose_TE.gather(1, experts_TK), E, self.capacity_t(T)
            )
            weights_TK = weights_TK * keep_TK
            dropped = 1.0 - keep_TK.float().mean()
        return RouterOutput(
            experts_TK,
            weights_TK,
            keep_TK,
            tokens_per_expert_E,
            balance,
            aux_loss,
            z_loss,
            cv_loss,
            dropped,
        )

    def _balance_losses(
        self,
        logits_TE: torch.Tensor,
        probs_TE: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        assignments: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The balancing loss of the chosen methods, and each term (aux, z, CV) for the logs."""
        cfg, E = self.cfg, self.num_experts
        counts_E = tokens_per_expert_E.float()
        if self.balance_group is not None and self.training and "aux_loss" in self.methods:
            # The routed fraction of the whole batch, not of this rank's share: every rank's
            # loss is then the one-process loss's share (P_E is a mean over equal shares).
            counts_E = counts_E.clone()
            dist.all_reduce(counts_E, group=self.balance_group)
            assignments *= dist.get_world_size(self.balance_group)
        f_E = counts_E / max(assignments, 1)
        P_E = probs_TE.mean(dim=0)
        aux_loss = E * (f_E * P_E).sum()
        z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).mean()
        soft_load_E = probs_TE.sum(dim=0)
        cv_loss = soft_load_E.std(unbiased=False) / soft_load_E.mean().clamp_min(1e-9)
        balance = torch.zeros((), device=logits_TE.device)
        if "aux_loss" in self.methods:
            balance = balance + cfg.aux_loss_coef * aux_loss
        if "z_loss" in self.methods:
            balance = balance + cfg.z_loss_coef * z_loss
        if "cv_penalty" in self.methods:
            balance = balance + cfg.cv_penalty_coef * cv_loss
        return balance, aux_loss, z_loss, cv_loss

    def set_step(self, step: int, progress: float) -> None:
        """The optimizer step (expert warm-up) and the fraction of the run done (capacity
        schedule), set on the host before each training step."""
        self.step, self.progress = step, progress
        blend = self._warmup_blend()
        self.blending = blend < 1.0
        device = self.gate.weight.device
        if self.blend_t.device != device:
            self.blend_t = torch.ones((), device=device)
            self.capacity_factor_t = torch.ones((), dtype=torch.float64, device=device)
        self.blend_t.fill_(blend)
        self.capacity_factor_t.fill_(self.capacity_factor())

    def _warmup_blend(self) -> float:
        """0 during expert warm-up (uniform routing), rising to 1 (the router's own choice)."""
        if "warmup" not in self.methods:
            return 1.0
        cfg = self.cfg
        if self.step < cfg.warmup_steps:
            return 0.0
        if cfg.warmup_blend_steps == 0:
            return 1.0
        return min(1.0, (self.step - cfg.warmup_steps + 1) / cfg.warmup_blend_steps)

    def capacity_factor(self) -> float:
        cfg = self.cfg
        if cfg.capacity_factor_end <= 0:
            return cfg.capacity_factor
        p = min(max(self.progress, 0.0), 1.0)
        return cfg.capacity_factor + (cfg.capacity_factor_end - cfg.capacity_factor) * p

    def capacity(self, num_tokens: int) -> int:
        """Assignments one expert accepts per batch (GShard §2.2)."""
        self.capacity_factor_t.fill_(self.capacity_factor())
        return int(self.capacity_t(num_tokens))

    def capacity_t(self, num_tokens: int) -> torch.Tensor:
        """capacity() as a tensor from the factor set_step filled in: a compiled block reads
        it without a recompile as the schedule moves."""
        share = num_tokens * self.top_k / self.num_experts
        return torch.ceil(self.capacity_factor_t * share).clamp(min=1)

    # ----------------------------------------------------------------- state

    @torch.no_grad()
    def update_state(self, step: int) -> None:
        """After an optimizer step: move the aux-free bias and the utilisation average by the
        load this step routed, recalibrate the gate when it is due, and start a new count.

        The load is what this process routed; distributed training all-reduces `load_E`
        before calling this, so every rank routes identically.
        """
        load_E = self.load_E
        if self.policy == "frozen":  # a stage that keeps the routing as it came
            load_E.zero_()
            return
        # Whether anything was routed stays on the device (no host read): each update is
        # computed, then kept only where it was.
        routed = load_E.sum() > 0
        mean = load_E.mean()
        if "aux_free" in self.methods:
            bias_E = self.expert_bias_E + self.cfg.aux_free_rate * torch.sign(mean - load_E)
            bias_E -= bias_E.mean()
            self.expert_bias_E.copy_(torch.where(routed, bias_E, self.expert_bias_E))
        if self.methods & {"util_aware", "rebalance"}:
            m = self.cfg.util_momentum
            util_E = self.util_E * m + (1 - m) * load_E / mean.clamp_min(1e-30)
            self.util_E.copy_(torch.where(routed, util_E, self.util_E))
        rebalance = "rebalance" in self.methods and self.policy == "trained"
        if rebalance and step > 0 and step % self.cfg.rebalance_every == 0:
            factor_E = (1 - self.cfg.rebalance_beta * (self.util_E - 1)).clamp(0.5, 1.5)
            factor_E = torch.where(routed, factor_E, torch.ones_like(factor_E))
            self.gate.weight.mul_(factor_E.to(self.gate.weight.dtype).unsqueeze(1))
        load_E.zero_()


def count_per_expert(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64) of a tensor of expert ids. Not torch.bincount: on a GPU
    it reads the largest id on the host to size its output (a sync in every MoE layer)."""
    flat = experts.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def limit_groups(choose_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V3 §2.1.2): the experts in n_group equal groups, each
    scored by the sum of its two best scores; the experts outside a token's topk_group best
    groups are set to -inf, so that its top-k falls inside them."""
    T, E = choose_TE.shape
    group_TG = choose_TE.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(dim=-1)
    best_TG = group_TG.topk(topk_group, dim=-1).indices
    keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, best_TG, True)
    keep_TE = keep_TG.repeat_interleave(E // n_group, dim=1)
    return choose_TE.masked_fill(~keep_TE, float("-inf"))


def capacity_mask(
    experts_TK: torch.Tensor, scores_TK: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """True for the assignments each expert keeps: its `capacity` highest-scoring ones.

    NOTE: GShard drops by arrival order; we drop the lowest-score assignments instead (as
    in V-MoE's "batch prioritized routing", Riquelme et al. 2021), which loses less signal.
    """
    flat_e = experts_TK.flatten()
    flat_s = scores_TK.flatten()
    # Sort by score descending, then stably by expert: each expert's assignments end up
    # contiguous and in descending score order.
    by_score = torch.argsort(flat_s, descending=True, stable=True)
    order = by_score[torch.argsort(flat_e[by_score], stable=True)]
    counts_E = count_per_expert(flat_e, num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_e = flat_e[order]
    rank = torch.arange(flat_e.numel(), device=flat_e.device) - starts_E[sorted_e]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(experts_TK)
