"""SwiGLU experts stored as 3-D weights, computed with sort-based dispatch + grouped GEMM.

Shape suffixes: T tokens, D model width, F expert hidden width, E experts, K choices per
token, A = T*K assignments (after capacity drops: the kept ones).

`GroupedExperts.forward` sorts assignments by expert and runs the three projections as
grouped matrix multiplications through one seam, `grouped_mm`, which faster kernels replace.
`reference_moe` beside it is the slow, obviously-right loop over experts that the tests hold
the fast path equal to (outputs and gradients).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch's CPU grouped_mm backward rejects expanded (stride-0) gradients, e.g. from .sum().
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


def _grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    # Kernels need 16-byte aligned rows; on CUDA they take bf16 on SM >= 80 only.
    if (x.shape[-1] * x.element_size()) % 16 or (w.shape[-1] * w.element_size()) % 16:
        return False
    if x.is_cuda:
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8
    return True


def grouped_mm(
    x_AD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """Row block e of x_AD (rows offs[e-1]:offs[e]) times w_EDF[e]. The one compute seam."""
    w_EDF = w_EDF.to(x_AD.dtype)
    if _grouped_mm_supported(x_AD, w_EDF):
        return _ContiguousGrad.apply(F.grouped_mm(x_AD, w_EDF, offs=offs_E))
    # Fallback: a loop over the non-empty groups (needs the counts on the host).
    chunks = torch.split(x_AD, counts_E.tolist())
    return torch.cat([c @ w_EDF[e] for e, c in enumerate(chunks)], dim=0)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1_EDF = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # gate proj
        self.w3_EDF = nn.Parameter(torch.empty(num_experts, d_model, hidden))  # up proj
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # down proj

    def forward(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        keep_TK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T, K = experts_TK.shape
        token_A = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        expert_A = experts_TK.flatten()
        weight_A = weights_TK.flatten()
        if keep_TK is not None:
            # Capacity drops: boolean indexing syncs with the host on GPU; dropless mode
            # (capacity_factor 0) never takes this branch.
            kept = keep_TK.flatten()
            token_A, expert_A, weight_A = token_A[kept], expert_A[kept], weight_A[kept]
        order_A = torch.argsort(expert_A, stable=True)
        token_A, weight_A = token_A[order_A], weight_A[order_A]
        counts_E = torch.bincount(expert_A, minlength=self.num_experts)
        offs_E = torch.cumsum(counts_E, 0).to(torch.int32)

        x_AD = x_TD[token_A]
        h_AF = F.silu(grouped_mm(x_AD, self.w1_EDF, offs_E, counts_E)) * grouped_mm(
            x_AD, self.w3_EDF, offs_E, counts_E
        )
        y_AD = grouped_mm(h_AF, self.w2_EFD, offs_E, counts_E)
        # Combine in fp32: summing K bf16 products loses bits that the residual stream keeps.
        out_TD = torch.zeros(T, x_TD.shape[1], device=x_TD.device, dtype=torch.float32)
        out_TD.index_add_(0, token_A, y_AD.float() * weight_A.unsqueeze(1))
        return out_TD.to(x_TD.dtype)


def reference_moe(
    experts: GroupedExperts,
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    keep_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously-right MoE: for each token, for each kept choice, run that expert."""
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(experts.num_experts):
        for k in range(experts_TK.shape[1]):
            mask_T = experts_TK[:, k] == e
            if keep_TK is not None:
                mask_T = mask_T & keep_TK[:, k]
            if not mask_T.any():
                continue
            x = x_TD[mask_T]
            h = F.silu(x @ experts.w1_EDF[e].to(x.dtype)) * (x @ experts.w3_EDF[e].to(x.dtype))
            y = h @ experts.w2_EFD[e].to(x.dtype)
            out_TD[mask_T] += y.float() * weights_TK[mask_T, k].unsqueeze(1)
    return out_TD.to(x_TD.dtype)
