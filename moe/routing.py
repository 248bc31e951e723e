"""Token-choice top-k router with fp32 logits, capacity, and balancing losses.

Shape suffixes: T tokens, D model width, E experts, K experts per token.

Balancing terms (each with its own coefficient in `moe`):
- Switch/GShard auxiliary loss  E * sum_i f_i * P_i   (Fedus et al. 2021, eq. 4; Lepikhin et
  al. 2020). NOTE: f_i counts all top-k assignments and is normalised by T*K, so a perfectly
  balanced router scores 1.0 for any K, as in Switch's top-1 case.
- Router z-loss  mean(logsumexp(logits)^2)   (Zoph et al. 2022, ST-MoE, eq. 5).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class RouterOutput:
    experts_TK: torch.Tensor  # int64 expert id of each of a token's K choices
    weights_TK: torch.Tensor  # fp32 combine weight of each choice (0 for a dropped choice)
    keep_TK: torch.Tensor | None  # bool, False where capacity dropped the choice; None = dropless
    tokens_per_expert_E: torch.Tensor  # int64 assignments routed to each expert (before drops)
    aux_loss: torch.Tensor  # fp32 scalar, Switch/GShard balance loss (unscaled)
    z_loss: torch.Tensor  # fp32 scalar, ST-MoE router z-loss (unscaled)
    dropped_fraction: torch.Tensor  # fp32 scalar, fraction of assignments dropped


class Router(nn.Module):
    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        renormalize: bool = True,
        capacity_factor: float = 0.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize = renormalize
        self.capacity_factor = capacity_factor  # 0 = dropless
        self.gate = nn.Linear(d_model, num_experts, bias=False)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        E, K = self.num_experts, self.top_k
        # Router logits in fp32 even under bf16 autocast (seed 000; ST-MoE §3: bf16 round-off
        # in the softmax's exponent destabilises routing).
        with torch.autocast(device_type=x_TD.device.type, enabled=False):
            logits_TE = F.linear(x_TD.float(), self.gate.weight.float())
        probs_TE = logits_TE.softmax(dim=-1)
        weights_TK, experts_TK = probs_TE.topk(K, dim=-1)
        if self.renormalize and K > 1:
            weights_TK = weights_TK / weights_TK.sum(dim=-1, keepdim=True)

        T = x_TD.shape[0]
        tokens_per_expert_E = torch.bincount(experts_TK.flatten(), minlength=E)
        f_E = tokens_per_expert_E.float() / max(T * K, 1)
        P_E = probs_TE.mean(dim=0)
        aux_loss = E * (f_E * P_E).sum()
        z_loss = torch.logsumexp(logits_TE, dim=-1).pow(2).mean()

        keep_TK = None
        dropped = torch.zeros((), device=x_TD.device)
        if self.capacity_factor > 0:
            keep_TK = capacity_mask(experts_TK, weights_TK, E, self.capacity(T))
            weights_TK = weights_TK * keep_TK
            dropped = 1.0 - keep_TK.float().mean()
        return RouterOutput(
            experts_TK, weights_TK, keep_TK, tokens_per_expert_E, aux_loss, z_loss, dropped
        )

    def capacity(self, num_tokens: int) -> int:
        """Assignments one expert accepts per batch (GShard §2.2)."""
        return max(1, math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts))


def capacity_mask(
    experts_TK: torch.Tensor, scores_TK: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """True for the assignments each expert keeps: its `capacity` highest-scoring ones.

    NOTE: GShard drops by arrival order; we drop the lowest-score assignments instead (as
    in Switch's "batch prioritized routing", Riquelme et al. 2021), which loses less signal.
    """
    flat_e = experts_TK.flatten()
    flat_s = scores_TK.flatten()
    # Sort by score descending, then stably by expert: each expert's assignments end up
    # contiguous and in descending score order.
    by_score = torch.argsort(flat_s, descending=True, stable=True)
    order = by_score[torch.argsort(flat_e[by_score], stable=True)]
    counts_E = torch.bincount(flat_e, minlength=num_experts)
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    sorted_e = flat_e[order]
    rank = torch.arange(flat_e.numel(), device=flat_e.device) - starts_E[sorted_e]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank < capacity
    return keep.view_as(experts_TK)
