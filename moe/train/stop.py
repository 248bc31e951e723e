"""When training stops before max_steps: early stopping on the validation loss, the stage's
share of the cost budget (an alert first), the time budget."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from moe.model.stats import ExpertLoad
from moe.train.config import OptimConfig
from moe.train.early_stop import EarlyStopper

log = logging.getLogger(__name__)


class Divergence:
    """A step whose gradient norm is not finite is skipped on the device: its `found_inf`
    goes to the fused AdamW kernel (as a GradScaler's does), which then leaves the weights,
    both moments and the step count as they were. The first such step and the number skipped
    are kept where the norm is (a GPU's norm is never read per step) and raised as an error
    where the host reads anyway: a metrics row, a save (no checkpoint holds a diverged step),
    the end."""

    def __init__(self) -> None:
        self.first: torch.Tensor | None = None  # -1: none yet
        self.skipped: torch.Tensor | None = None

    def observe(self, grad_norm: torch.Tensor, step: int) -> torch.Tensor:
        """Record this step's norm; returns its found_inf (1.0: skip the update, 0.0: apply)."""
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        bad = ~torch.isfinite(grad_norm)
        first = self.first if self.first is not None else torch.full_like(bad, -1, dtype=torch.long)
        self.first = torch.where(bad & (first < 0), step, first)
        self.skipped = bad.long() + (self.skipped if self.skipped is not None else 0)
        return bad.float()

    def first_step(self) -> int | None:
        """The first diverged step, read from the device (None: none)."""
        step = int(self.first) if self.first is not None else -1
        return step if step >= 0 else None

    def check(self) -> None:
        if (step := self.first_step()) is not None:
            raise FloatingPointError(
                f"non-finite gradient norm at step {step} ({int(self.skipped or 0)} step(s) "
                "skipped; the weights are those before it): lower the learning rate or raise "
                "grad_clip"
            )


@dataclass
class Budget:
    """What a run costs and may cost: the hourly price of the machines it runs on, and what
    is left of the pipeline's budget for this stage (0 = no budget): an alert at `alert` of
    it, a stop with a checkpoint when it is spent."""

    price_per_hour: float = 0.0
    left: float = 0.0
    alert: float = 0.8

    def cost(self, seconds: float) -> float:
        return seconds / 3600 * self.price_per_hour


class StopPolicy:
    """Why training stops after a step, or None. A stop is logged and recorded once; a
    budget nearly spent is an alert, once."""

    def __init__(
        self,
        cfg: OptimConfig,
        budget: Budget | None,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cfg, self.budget, self.emit = cfg, budget or Budget(), emit
        self.budget_warned = False

    def early_stop(
        self,
        stopper: EarlyStopper | None,
        step: int,
        val_loss: float,
        lr: float,
        elapsed_s: float,
        load: ExpertLoad,
    ) -> str | None:
        """The early stopper's verdict on a validation (None without one)."""
        if stopper is None:
            return None
        util = float(load.eval_window()["utilisation"])
        cost_per_step = self.budget.cost(elapsed_s) / max(step, 1)
        steps_left = self.cfg.max_steps - step
        return stopper.update(step, val_loss, util, lr, cost_per_step, steps_left)

    def spending(self, step: int, elapsed_s: float) -> str | None:
        """The budget's verdict (alerting once when nearly spent) and the time budget's."""
        reason = None
        spent, left = self.budget.cost(elapsed_s), self.budget.left
        if left > 0:
            if spent >= left:
                reason = (
                    f"budget: this stage spent {spent:.4f} of the {left:.4f} left of cost.budget"
                )
            elif spent >= self.budget.alert * left and not self.budget_warned:
                self.budget_warned = True
                msg = f"{spent / left:.0%} of the budget left for this stage spent"
                log.warning("step %d: %s", step, msg)
                self.emit({"step": step, "budget_alert": msg, "cost": spent, "budget_left": left})
        time_budget = self.cfg.time_budget_s
        if reason is None and time_budget > 0 and elapsed_s >= time_budget:
            reason = f"time budget of {time_budget:.0f} s used"
        return reason

    def record(self, step: int, reason: str, elapsed_s: float) -> None:
        log.warning("stopping at step %d: %s", step, reason)
        self.emit({"step": step, "early_stop": reason, "cost": self.budget.cost(elapsed_s)})
