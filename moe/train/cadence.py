"""When training saves: every checkpoint_every steps, or (checkpoint.every: auto) at the
Young/Daly interval chosen from what a save stalls, the step time and the pool's mean time
between interruptions (moe/train/resilience.py). Rank 0 decides and the others follow."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from moe.train.config import OptimConfig
from moe.train.ranks import Ranks
from moe.train.resilience import IntervalChoice, choose_interval

log = logging.getLogger(__name__)


class SaveCadence:
    """`auto_mtbi_s`: None = a save every cfg.checkpoint_every steps; else the pool's mean
    time between interruptions in seconds (0 = none declared)."""

    def __init__(
        self,
        cfg: OptimConfig,
        auto_mtbi_s: float | None,
        ranks: Ranks,
        emit: Callable[[dict[str, Any]], None],
    ) -> None:
        self.cfg, self.auto_mtbi_s, self.ranks, self.emit = cfg, auto_mtbi_s, ranks, emit
        self.interval: IntervalChoice | None = None
        self.next_save = 0

    def start(self, step: int) -> None:
        """The first save: a multiple of checkpoint_every, or (auto) an early save that
        measures the stall, then every interval chosen from it."""
        every = self.cfg.checkpoint_every
        auto = self.auto_mtbi_s is not None
        self.next_save = step + min(every, 10) if auto else (step // every + 1) * every

    def due(self, step: int) -> bool:
        return step >= self.next_save or step == self.cfg.max_steps

    def saved(self, step: int, stall_s: float, step_s: float, restore_s: float) -> None:
        """Plan the next save after one at `step`."""
        if self.auto_mtbi_s is not None:
            self._choose(step, stall_s, step_s, restore_s)
            assert self.interval is not None
            self.next_save = step + self.interval.steps
        else:
            every = self.cfg.checkpoint_every
            self.next_save = (step // every + 1) * every

    def _choose(self, step: int, save_s: float, step_s: float, restore_s: float) -> None:
        assert self.auto_mtbi_s is not None
        choice = choose_interval(
            save_s,
            step_s,
            self.auto_mtbi_s,
            self.cfg.checkpoint_every,
            self.cfg.max_steps,
            restore_s,
        )
        choice.steps = self.ranks.broadcast_int(choice.steps)
        if self.interval is None or choice.steps != self.interval.steps:
            log.info(
                "checkpoint interval (auto): every %d steps (%s; save stall %.3f s, step %.3f s, "
                "mean time between interruptions %s, restore %.2f s)",
                choice.steps,
                choice.rule,
                save_s,
                step_s,
                f"{choice.mtbi_s / 3600:.2f} h" if choice.mtbi_s > 0 else "none declared",
                restore_s,
            )
            self.emit({"step": step, "checkpoint_interval": choice.as_dict()})
        self.interval = choice
