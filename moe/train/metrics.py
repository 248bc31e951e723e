"""What training reports: metrics rows (to a callback, e.g. W&B, and a JSON-lines file, from
rank 0 only), and the row of one logging window."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.model.stats import ExpertLoad

log = logging.getLogger(__name__)


class MetricsLog:
    """Rows go to `log_fn` and are appended to `path` (when set), on rank 0."""

    def __init__(
        self, rank: int, log_fn: Callable[[dict[str, Any]], None] | None, path: Path | None
    ) -> None:
        self.rank = rank
        self.log_fn = log_fn or (lambda row: None)
        self.path = path

    def emit(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.log_fn(row)
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def start_fresh(self) -> None:
        """A fresh run starts a fresh log."""
        if self.rank == 0 and self.path and self.path.is_file():
            self.path.unlink()

    def keep_until(self, step: int) -> None:
        """A resumed run drops the rows written after the checkpoint it resumed from."""
        if self.rank == 0 and self.path and self.path.is_file():
            rows = [
                r for r in self.path.read_text().splitlines() if r and json.loads(r)["step"] <= step
            ]
            self.path.write_text("".join(r + "\n" for r in rows))


class Window:
    """The steps since the last metrics row: their loss, tokens and time."""

    def __init__(self, t0: float) -> None:
        # loss: summed on the device over the window's steps, read once in row()
        self.t0, self.loss, self.tokens = t0, 0.0, 0
        # packed finetuning: the examples and their (non-padding) tokens, from the host batch
        self.examples, self.real_tokens = 0, 0

    def count(self, batch: tuple, tokens: int) -> None:
        """A micro-batch's tokens (all processes'), and a packed batch's examples and real
        tokens (its segments, on the host: no device read)."""
        self.tokens += tokens
        if len(batch) > 3:
            self.examples += int((batch[3].max(dim=1).values + 1).sum())
            self.real_tokens += int((batch[3] >= 0).sum())

    def row(
        self,
        *,
        step: int,
        max_steps: int,
        log_every: int,
        lr: float,
        grad_norm: float,
        now: float,
        load: ExpertLoad,
        aux: Any,
        cost: float,
    ) -> dict[str, Any]:
        """One metrics row for the window (and a log line); the window starts again."""
        dt = now - self.t0
        stats = load.window()
        steps = max(1, (step - 1) % log_every + 1)
        row = {
            "step": step,
            "loss": float(self.loss) / steps,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens / max(dt, 1e-9),
            "expert_cv": stats["cv"],
            "expert_max_vio": stats["max_vio"],
            "expert_utilisation": stats["utilisation"],
            "expert_dead": stats["dead"],
            "aux_loss": float(aux.aux_loss.detach()),
            "z_loss": float(aux.z_loss.detach()),
            "dropped_fraction": stats["dropped_fraction"],
            "cost": cost,
            "expert_share": stats["share"],
        }
        if self.real_tokens:  # packed rows: what a step holds besides its padding
            row["examples_per_step"] = self.examples / steps
            row["real_tokens_per_step"] = self.real_tokens / steps
            row["real_tokens_per_s"] = self.real_tokens / max(dt, 1e-9)
        log.info(
            "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s expert CV %.3f",
            step,
            max_steps,
            row["loss"],
            lr,
            grad_norm,
            row["tokens_per_s"],
            stats["cv"],
        )
        return row
