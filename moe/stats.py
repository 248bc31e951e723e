"""Per-expert load statistics: counts, utilisation, CV, MaxVio, dead experts, drops.

Cheap enough for every step: the trainer adds one (layers x experts) count tensor per
micro-batch; summaries are computed on the CPU only when a window is read.
"""

from __future__ import annotations

import torch

Summary = dict[str, float | list[float] | list[list[float]]]


class ExpertLoad:
    """Accumulates tokens_per_expert per MoE layer over a window of steps."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)  # since window()
        self.since_eval_LE = torch.zeros(
            num_layers, num_experts, dtype=torch.float64
        )  # since eval_window()
        self.total_LE = torch.zeros(num_layers, num_experts, dtype=torch.float64)
        self._dropped: list[float] = []  # mean dropped fraction of each batch in the window

    def add(
        self, tokens_per_expert: list[torch.Tensor], dropped_fraction: list[torch.Tensor] = ()
    ) -> None:
        if not tokens_per_expert:
            return
        batch_LE = torch.stack([t.detach().to("cpu", torch.float64) for t in tokens_per_expert])
        self.counts_LE += batch_LE
        self.since_eval_LE += batch_LE
        self.total_LE += batch_LE
        if dropped_fraction:
            self._dropped.append(float(torch.stack(list(dropped_fraction)).float().mean()))

    def window(self) -> Summary:
        """Summary of the counts since the last call, then reset the window."""
        out = summarize(self.counts_LE)
        out["dropped_fraction"] = sum(self._dropped) / len(self._dropped) if self._dropped else 0.0
        self.counts_LE.zero_()
        self._dropped.clear()
        return out

    def eval_window(self) -> Summary:
        """Summary of the counts since the last evaluation, then reset (for early stopping)."""
        out = summarize(self.since_eval_LE)
        self.since_eval_LE.zero_()
        return out


def summarize(counts_LE: torch.Tensor) -> Summary:
    """Load statistics of a (layers x experts) count matrix, averaged over layers.

    - cv: std / mean of the counts (seed 000's balance measure);
    - max_vio: max / mean - 1 (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing");
    - utilisation: share of experts that got at least half their fair share;
    - dead: experts (summed over layers) that got no token at all in the window;
    - share: each expert's share of its layer's assignments, per layer (rows sum to 1);
    - load: each expert's load over its fair share (1.0 = balanced), per layer.
    """
    if counts_LE.numel() == 0 or counts_LE.sum() == 0:
        return {"cv": 0.0, "max_vio": 0.0, "utilisation": 0.0, "dead": 0.0, "share": [], "load": []}
    mean_L1 = counts_LE.mean(dim=1, keepdim=True).clamp_min(1e-12)
    cv_L = counts_LE.std(dim=1, unbiased=False, keepdim=True) / mean_L1
    max_vio_L = counts_LE.max(dim=1, keepdim=True).values / mean_L1 - 1
    utilisation = (counts_LE >= 0.5 * mean_L1).double().mean()
    share = counts_LE / counts_LE.sum(dim=1, keepdim=True).clamp_min(1e-12)
    load = counts_LE / mean_L1
    return {
        "cv": float(cv_L.mean()),
        "max_vio": float(max_vio_L.mean()),
        "utilisation": float(utilisation),
        "dead": float((counts_LE == 0).sum()),
        "cv_per_layer": [round(float(v), 5) for v in cv_L.flatten()],
        "max_vio_per_layer": [round(float(v), 5) for v in max_vio_L.flatten()],
        "share": [[round(float(v), 5) for v in row] for row in share],
        "load": [[round(float(v), 4) for v in row] for row in load],
    }


def flat_metrics(summary: Summary, prefix: str = "moe") -> dict[str, float]:
    """A flat {name: number} view for metrics files and W&B: overall figures, per-layer CV
    and MaxVio, and every expert's share (`moe/layer0/expert3/share`)."""
    out: dict[str, float] = {}
    for key in ("cv", "max_vio", "utilisation", "dead", "dropped_fraction"):
        if key in summary:
            out[f"{prefix}/{key}"] = float(summary[key])  # type: ignore[arg-type]
    for key in ("cv_per_layer", "max_vio_per_layer"):
        for layer, v in enumerate(summary.get(key, [])):  # type: ignore[arg-type]
            out[f"{prefix}/layer{layer}/{key.removesuffix('_per_layer')}"] = float(v)
    for layer, row in enumerate(summary.get("share", [])):  # type: ignore[arg-type]
        for e, v in enumerate(row):
            out[f"{prefix}/layer{layer}/expert{e}/share"] = float(v)
    return out
