"""Early stopping: a composite of validation loss and expert utilisation,
patience scaled by lr / initial_lr, and a cost-aware stop.

- Composite score = val_loss + util_weight * (1 - utilisation): a model that improves its loss
  by starving experts is not improving (lower is better).
- Patience = base_patience * lr / initial_lr (docs/DESIGN.md, early stopping). NOTE: that formula lets this
  reach 0 as the lr decays; we keep a floor of one evaluation, so one bad evaluation late in a
  schedule stops the run but a single good one never does.
- Cost-aware: fit a line to the last `trend_window` validation losses; the loss the remaining
  steps are expected to remove is -slope * steps_left (a linear projection, optimistic for a
  flattening curve, so it stops later rather than sooner); stop when the projected cost of the
  remaining steps exceeds that gain times `value_per_loss`.
"""

from __future__ import annotations

import math
from typing import Any

from moe.train.config import EarlyStopConfig


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0


class EarlyStopper:
    def __init__(self, cfg: EarlyStopConfig, initial_lr: float) -> None:
        self.cfg, self.initial_lr = cfg, initial_lr
        self.best: float | None = None
        self.bad_evals = 0
        self.history: list[tuple[int, float]] = []  # (step, val_loss)

    def patience(self, lr: float) -> int:
        return max(1, math.ceil(self.cfg.patience * lr / self.initial_lr))

    def update(
        self,
        step: int,
        val_loss: float,
        utilisation: float,
        lr: float,
        cost_per_step: float,
        steps_left: int,
    ) -> str | None:
        """Record one evaluation; return why training should stop, or None."""
        score = val_loss + self.cfg.util_weight * (1.0 - utilisation)
        self.history.append((step, val_loss))
        if self.best is None or score < self.best - self.cfg.min_delta:
            self.best, self.bad_evals = score, 0
        else:
            self.bad_evals += 1
        if self.cfg.patience:
            patience = self.patience(lr)
            if self.bad_evals >= patience:
                return (
                    f"patience: composite score {score:.4f} (val loss {val_loss:.4f}, utilisation {utilisation:.2f}) "
                    f"has not beaten {self.best:.4f} for {self.bad_evals} evaluation(s); patience {patience} at lr {lr:.2e}"
                )
        if (
            self.cfg.value_per_loss > 0
            and len(self.history) >= self.cfg.trend_window
            and steps_left > 0
        ):
            recent = self.history[-self.cfg.trend_window :]
            slope = _slope([float(s) for s, _ in recent], [v for _, v in recent])
            gain = max(0.0, -slope) * steps_left
            value = gain * self.cfg.value_per_loss
            remaining = cost_per_step * steps_left
            if remaining > value:
                return (
                    f"cost: the remaining {steps_left} steps would cost {remaining:.4f} but the recent trend "
                    f"({slope:.2e} loss/step) promises {gain:.4f} less loss, worth {value:.4f}"
                )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evals": self.bad_evals, "history": self.history}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_evals = state["best"], int(state["bad_evals"])
        self.history = [(int(s), float(v)) for s, v in state["history"]]
