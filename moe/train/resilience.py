"""Surviving interruptions: how often to checkpoint, and what each interruption cost.

A spot GPU vanishes without warning. The work since the last checkpoint is redone, and the
time to notice, restart and restore is lost. Two things follow, both pure arithmetic here:

- **The interval** (`checkpoint.every: auto`): Young's rule, tau = sqrt(2 * delta * M), with
  Daly's higher-order correction (J. T. Daly, "A higher order estimate of the optimum
  checkpoint interval for restart dumps", FGCS 22, 2006), where delta is what one save costs
  the training loop and M the mean time between interruptions of the pool. The restore time
  R does not move the optimum; it enters the expected wall time (`expected_wall_s`).
- **The ledger** (`AttemptJournal`): every start of a training stage is an attempt, recorded
  beside its checkpoints. An attempt that never said "finished" was interrupted; when the next
  one starts, the journal works out the steps redone, the time they took, the time nothing
  ran (detection, rescheduling), the restart (process start, data, model) and the restore
  time, and at the end the goodput: productive training time over the wall time of all
  attempts.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def daly_interval_s(save_s: float, mtbi_s: float) -> float:
    """The compute time between checkpoints that minimises expected wall time (Daly 2006).

    save_s: what one checkpoint costs the training loop (delta); mtbi_s: the mean time
    between interruptions (M). For delta >= 2M checkpointing cannot pay for itself and the
    rule returns M. mtbi_s <= 0 means "never interrupted": infinity."""
    if mtbi_s <= 0 or not math.isfinite(mtbi_s):
        return math.inf
    d = max(save_s, 1e-9)
    if d >= 2 * mtbi_s:
        return mtbi_s
    x = d / (2 * mtbi_s)
    return math.sqrt(2 * d * mtbi_s) * (1 + math.sqrt(x) / 3 + x / 9) - d


def expected_wall_s(
    work_s: float, interval_s: float, save_s: float, restore_s: float, mtbi_s: float
) -> float:
    """Expected wall time to finish `work_s` of training with a checkpoint every `interval_s`
    of compute, under interruptions at exponential inter-arrival with mean `mtbi_s` (Daly's
    model: each segment of interval + save restarts after restore_s on failure)."""
    if mtbi_s <= 0 or not math.isfinite(mtbi_s):
        return work_s + save_s * max(0.0, math.ceil(work_s / interval_s) - 1)
    segments = work_s / interval_s
    return (
        mtbi_s
        * math.exp(restore_s / mtbi_s)
        * math.expm1((interval_s + save_s) / mtbi_s)
        * segments
    )


@dataclass
class IntervalChoice:
    """A checkpoint interval in steps and the inputs it came from (logged and recorded)."""

    steps: int
    interval_s: float
    save_s: float
    step_s: float
    mtbi_s: float
    restore_s: float
    rule: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "every_steps": self.steps,
            "interval_s": None if math.isinf(self.interval_s) else round(self.interval_s, 3),
            "save_stall_s": round(self.save_s, 4),
            "step_s": round(self.step_s, 4),
            "mtbi_s": self.mtbi_s,
            "restore_s": round(self.restore_s, 3),
            "rule": self.rule,
        }


def choose_interval(
    save_s: float,
    step_s: float,
    mtbi_s: float,
    fallback_steps: int,
    max_steps: int,
    restore_s: float = 0.0,
) -> IntervalChoice:
    """Young/Daly in steps: round(tau / step time), at least 1 and at most max_steps. A pool
    that declares no interruptions (mtbi_s <= 0) keeps `fallback_steps` (the stage's own
    checkpoint_every): machines still fail, just not on a schedule anyone can price."""
    tau = daly_interval_s(save_s, mtbi_s)
    if math.isinf(tau):
        return IntervalChoice(
            fallback_steps, tau, save_s, step_s, mtbi_s, restore_s, "no interruptions declared"
        )
    steps = max(1, min(max_steps, round(tau / max(step_s, 1e-9))))
    return IntervalChoice(steps, tau, save_s, step_s, mtbi_s, restore_s, "young-daly")


class AttemptJournal:
    """`attempts.json` beside a stage's checkpoints: one entry per start of the stage.

    begin() at the start of training (after any restore), progress() as steps go by (written
    at most once a second of wall time, and at every checkpoint), finish() at the end. The
    wall clock is injectable; it must be one that means the same across processes
    (time.time by default), since attempts are different processes, often machines."""

    def __init__(self, path: Path, fingerprint: str, wall: Callable[[], float] = time.time) -> None:
        self.path, self.fingerprint, self.wall = Path(path), fingerprint, wall
        self.data: dict[str, Any] = {"fingerprint": fingerprint, "attempts": []}
        self._last_write = -math.inf

    def _load(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if data.get("fingerprint") == self.fingerprint:
            self.data = data

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)
        self._last_write = self.wall()

    @property
    def current(self) -> dict[str, Any]:
        return self.data["attempts"][-1]

    def begin(self, started_at: float, resumed_step: int, restore_s: float) -> dict | None:
        """Record a new attempt that started (its process) at `started_at` and begins training
        at `resumed_step` after `restore_s` of restore. Returns the interruption the previous
        attempt ended in, if it did not finish (also kept in the journal)."""
        self._load()
        attempts = self.data["attempts"]
        interruption = None
        now = self.wall()
        if attempts and not attempts[-1].get("finished"):
            prev = attempts[-1]
            # A retry in the same process (a Prefect task retry) started before the failure:
            # its restart counts from the last sign of life, with no time down.
            started_at = max(started_at, prev["last_time"])
            steps_done = prev["last_step"] - prev["resumed_step"]
            train_s = prev["last_time"] - prev["train_start"]
            per_step = train_s / steps_done if steps_done > 0 else 0.0
            lost_steps = max(0, prev["last_step"] - resumed_step)
            redo_s = lost_steps * per_step  # the steps trained again
            down_s = max(0.0, started_at - prev["last_time"])  # no machine: detect, reschedule
            restart_s = max(0.0, now - started_at - restore_s)  # process start, data, model
            interruption = {
                "attempt": len(attempts),  # 1-based number of the attempt that was lost
                "at_step": prev["last_step"],
                "resumed_step": resumed_step,
                "steps_lost": lost_steps,
                "redo_s": round(redo_s, 3),
                "down_s": round(down_s, 3),
                "restart_s": round(restart_s, 3),
                "restore_s": round(restore_s, 3),
                "lost_s": round(redo_s + down_s + restart_s + restore_s, 3),
                # what a machine was paid for without progress (down time has no machine)
                "billed_lost_s": round(redo_s + restart_s + restore_s, 3),
            }
            prev["interruption"] = interruption
        elif attempts:  # a finished stage started again (--force, a changed downstream)
            self.data["attempts"] = attempts = []
        attempts.append(
            {
                "started": started_at,
                "train_start": now,
                "resumed_step": resumed_step,
                "restore_s": round(restore_s, 3),
                "last_step": resumed_step,
                "last_time": now,
                "finished": False,
            }
        )
        self._write()
        return interruption

    def progress(self, step: int, force: bool = False) -> None:
        now = self.wall()
        self.current.update(last_step=step, last_time=now)
        if force or now - self._last_write >= 1.0:
            self._write()

    def finish(self, step: int) -> None:
        self.current.update(last_step=step, last_time=self.wall(), finished=True)
        self._write()

    def summary(self, productive_s: float) -> dict[str, Any]:
        """Interruptions, what they cost, and goodput = productive training time / wall time
        from the first attempt's start to the last attempt's last step."""
        attempts = self.data["attempts"]
        if not attempts:
            return {"attempts": 0, "interruptions": [], "goodput": 1.0}
        lost = [a["interruption"] for a in attempts if a.get("interruption")]
        wall = attempts[-1]["last_time"] - attempts[0]["started"]
        # Machine time of the attempts that were lost (billed though their work was not kept).
        lost_attempts_s = sum(
            a["last_time"] - a["started"] for a in attempts[:-1] if a.get("interruption")
        )
        return {
            "attempts": len(attempts),
            "interruptions": lost,
            "steps_lost": sum(i["steps_lost"] for i in lost),
            "lost_s": round(sum(i["lost_s"] for i in lost), 3),
            "billed_lost_s": round(sum(i["billed_lost_s"] for i in lost), 3),
            "lost_attempts_s": round(lost_attempts_s, 3),
            # [start, last sign of life] of each lost attempt: the bill counts what of it lies
            # before the current attempt's flow run started (a retry in the same process is
            # inside that run's wall time already)
            "lost_spans": [
                [a["started"], a["last_time"]] for a in attempts[:-1] if a.get("interruption")
            ],
            "wall_s": round(wall, 3),
            "productive_s": round(productive_s, 3),
            "goodput": round(min(1.0, productive_s / wall), 4) if wall > 0 else 1.0,
        }


def begin_attempt(
    journal: AttemptJournal,
    started: float,
    step: int,
    restore_s: float,
    emit: Callable[[dict[str, Any]], None],
) -> None:
    """Record this attempt in the journal, and what the interruption before it cost."""
    lost = journal.begin(started, step, restore_s)
    if lost:
        log.warning(
            "attempt %d of this stage was interrupted at step %d: %d steps redone, "
            "%.1f s lost (%.1f s redoing work, %.1f s down, %.1f s restarting, "
            "%.1f s restoring)",
            lost["attempt"],
            lost["at_step"],
            lost["steps_lost"],
            lost["lost_s"],
            lost["redo_s"],
            lost["down_s"],
            lost["restart_s"],
            lost["restore_s"],
        )
        emit({"step": step, "interruption": lost})
