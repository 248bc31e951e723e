"""Per-expert load statistics: counts, utilisation, coefficient of variation, MaxVio."""

from __future__ import annotations

import torch


class ExpertLoad:
    """Accumulates tokens_per_expert per MoE layer over a window of steps."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)  # since window()
        self.since_eval_LE = torch.zeros(
            num_layers, num_experts, dtype=torch.float64
        )  # since eval_window()
        self.total_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)

    def add(self, tokens_per_expert: list[torch.Tensor]) -> None:
        if not tokens_per_expert:
            return
        batch_LE = torch.stack([t.detach().to("cpu", torch.float64) for t in tokens_per_expert])
        self.counts_LE += batch_LE
        self.since_eval_LE += batch_LE
        self.total_LE += batch_LE

    def window(self) -> dict[str, float | list[list[float]]]:
        """Summary of the counts since the last call, then reset the window."""
        out = summarize(self.counts_LE)
        self.counts_LE.zero_()
        return out

    def eval_window(self) -> dict[str, float | list[list[float]]]:
        """Summary of the counts since the last evaluation, then reset (for early stopping)."""
        out = summarize(self.since_eval_LE)
        self.since_eval_LE.zero_()
        return out


def summarize(counts_LE: torch.Tensor) -> dict[str, float | list[list[float]]]:
    """CV = std/mean of counts (seed 000's balance measure); MaxVio = max/mean - 1 (Wang et
    al. 2024, "Auxiliary-Loss-Free Load Balancing"); utilisation = share of experts that got
    at least half their fair share."""
    if counts_LE.numel() == 0 or counts_LE.sum() == 0:
        return {"cv": 0.0, "max_vio": 0.0, "utilisation": 0.0, "share": []}
    mean_L1 = counts_LE.mean(dim=1, keepdim=True).clamp_min(1e-12)
    cv = (counts_LE.std(dim=1, unbiased=False, keepdim=True) / mean_L1).mean()
    max_vio = (counts_LE.max(dim=1, keepdim=True).values / mean_L1 - 1).mean()
    utilisation = (counts_LE >= 0.5 * mean_L1).double().mean()
    share = counts_LE / counts_LE.sum(dim=1, keepdim=True).clamp_min(1e-12)
    return {
        "cv": float(cv),
        "max_vio": float(max_vio),
        "utilisation": float(utilisation),
        "share": [[round(float(v), 5) for v in row] for row in share],
    }
