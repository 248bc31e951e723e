"""Per-expert load statistics: counts, utilisation, CV, MaxVio, dead experts, drops.

Cheap enough for every step: the trainer adds one (layers x experts) count tensor per
micro-batch, summed where the counts are (a GPU's counts never leave it between reads);
they reach the CPU, and summaries are computed there, only when a window or the totals are
read (a metrics row, a checkpoint, a stop decision).
"""

from __future__ import annotations

import torch

Summary = dict[str, float | list[float] | list[list[float]]]


class ExpertLoad:
    """Accumulates tokens_per_expert per MoE layer over windows of steps. Layers may hold
    different expert counts (expert growth and pruning, moe/model/growth.py)."""

    def __init__(self, num_layers: int, num_experts: int | list[int]) -> None:
        sizes = [num_experts] * num_layers if isinstance(num_experts, int) else list(num_experts)
        self.counts = [torch.zeros(e, dtype=torch.float64) for e in sizes]  # since window()
        self.since_eval = [torch.zeros(e, dtype=torch.float64) for e in sizes]
        self._total = [torch.zeros(e, dtype=torch.float64) for e in sizes]
        self._dropped_sum, self._dropped_n = 0.0, 0  # mean dropped fraction of each batch
        # Added since the last read, on the device the counts came from (float64 there).
        self._pending: list[torch.Tensor] | None = None
        self._pending_dropped: torch.Tensor | None = None
        self._pending_n = 0

    def add(
        self, tokens_per_expert: list[torch.Tensor], dropped_fraction: list[torch.Tensor] = ()
    ) -> None:
        if not tokens_per_expert:
            return
        counts = [t.detach().to(torch.float64) for t in tokens_per_expert]
        if self._pending is None:
            self._pending = counts
        else:
            self._pending = [a + b for a, b in zip(self._pending, counts, strict=True)]
        if dropped_fraction:
            d = torch.stack(list(dropped_fraction)).float().mean().double()
            self._pending_dropped = (
                d if self._pending_dropped is None else self._pending_dropped + d
            )
            self._pending_n += 1

    def flush(self) -> None:
        """Bring what was added since the last read to the CPU (one copy per layer)."""
        if self._pending is not None:
            for i, t in enumerate(self._pending):
                c = t.cpu()
                self.counts[i] += c
                self.since_eval[i] += c
                self._total[i] += c
            self._pending = None
        if self._pending_dropped is not None:
            self._dropped_sum += float(self._pending_dropped)
            self._dropped_n += self._pending_n
            self._pending_dropped, self._pending_n = None, 0

    @property
    def total(self) -> list[torch.Tensor]:
        """Counts since training began, per layer (read: on the CPU)."""
        self.flush()
        return self._total

    @total.setter
    def total(self, value: list[torch.Tensor]) -> None:
        self.flush()
        self._total = value

    def resize(self, layer: int, index: torch.Tensor) -> None:
        """Follow a change in a layer's experts: new expert e takes old expert index[e]'s
        counts; index -1 = a new expert (zero counts)."""
        self.flush()
        for series in (self.counts, self.since_eval, self._total):
            old = series[layer]
            new = torch.zeros(len(index), dtype=torch.float64)
            known = index >= 0
            new[known] = old[index[known]]
            series[layer] = new

    def window(self) -> Summary:
        """Summary of the counts since the last call, then reset the window."""
        self.flush()
        out = summarize(self.counts)
        out["dropped_fraction"] = self._dropped_sum / self._dropped_n if self._dropped_n else 0.0
        for c in self.counts:
            c.zero_()
        self._dropped_sum, self._dropped_n = 0.0, 0
        return out

    def eval_window(self) -> Summary:
        """Summary of the counts since the last evaluation, then reset (for early stopping)."""
        self.flush()
        out = summarize(self.since_eval)
        for c in self.since_eval:
            c.zero_()
        return out


def summarize(counts: torch.Tensor | list[torch.Tensor]) -> Summary:
    """Load statistics of per-layer expert counts (a (layers x experts) tensor, or one 1-D
    tensor per layer when layers differ in size), averaged over layers.

    - cv: std / mean of the counts (the balance measure the reports use);
    - max_vio: max / mean - 1 (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing");
    - utilisation: share of experts that got at least half their fair share;
    - dead: experts (summed over layers) that got no token at all in the window;
    - share: each expert's share of its layer's assignments, per layer (rows sum to 1);
    - load: each expert's load over its fair share (1.0 = balanced), per layer.
    """
    rows = (
        list(counts)
        if isinstance(counts, list)
        else list(counts.reshape(-1, counts.shape[-1]) if counts.numel() else [])
    )
    rows = [r.double() for r in rows if r.numel()]
    if not rows or sum(float(r.sum()) for r in rows) == 0:
        return {"cv": 0.0, "max_vio": 0.0, "utilisation": 0.0, "dead": 0.0, "share": [], "load": []}
    cv, vio, util, share, load = [], [], [], [], []
    dead = 0.0
    for r in rows:
        mean = float(r.mean()) or 1e-12
        cv.append(float(r.std(unbiased=False)) / mean)
        vio.append(float(r.max()) / mean - 1)
        util.append(float((r >= 0.5 * mean).double().mean()))
        dead += float((r == 0).sum())
        total = float(r.sum()) or 1e-12
        share.append([round(float(v) / total, 5) for v in r])
        load.append([round(float(v) / mean, 4) for v in r])
    n_experts = sum(r.numel() for r in rows)
    return {
        "cv": sum(cv) / len(cv),
        "max_vio": sum(vio) / len(vio),
        "utilisation": sum(u * r.numel() for u, r in zip(util, rows, strict=True)) / n_experts,
        "dead": dead,
        "cv_per_layer": [round(v, 5) for v in cv],
        "max_vio_per_layer": [round(v, 5) for v in vio],
        "share": share,
        "load": load,
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
