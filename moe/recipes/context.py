"""What a recipe needs from where it runs, and what it does with a stop notice.

A `RunContext` with its defaults is a plain process's: checkpoints on this machine's disk,
no price and no budget, the attempt journal beside the checkpoints, metrics rows to the log
only, and a SIGTERM that saves the step in progress before the process ends. A Prefect stage
gives its own (tasks/training.py `stage_context`): its object store and offload, its pool's
price and interruption rate, the W&B run and progress artifact, Prefect's cancellation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe.checkpoint.config import CheckpointConfig
from moe.checkpoint.store import CheckpointStore
from moe.train.resilience import AttemptJournal
from moe.train.stop import Budget
from moe.train.trainer import Resilience, Trainer

log = logging.getLogger(__name__)

try:  # the process's own start; a bare GPU image may lack psutil: then when this loaded
    import psutil

    _STARTED = psutil.Process().create_time()
except ImportError:
    _STARTED = time.time()

LogFn = Callable[[dict[str, Any]], None]


def _drop(row: dict[str, Any]) -> None:
    """No metrics sink: the trainer's own log lines and metrics.jsonl still have every row."""


def _as_is(stage: str, max_steps: int, log_fn: LogFn) -> contextlib.AbstractContextManager[LogFn]:
    return contextlib.nullcontext(log_fn)


def local_resilience(ckpt_dir: Path, fingerprint: str, mtbi_s: float | None = None) -> Resilience:
    """The attempt journal beside the checkpoints and when this attempt started: under
    torchrun the stage's own process (MOE_ATTEMPT_STARTED, set by its launcher), else this
    one. `mtbi_s`: the pool's mean time between interruptions, for checkpoint.every: auto."""
    started = os.environ.get("MOE_ATTEMPT_STARTED") or _STARTED
    return Resilience(
        AttemptJournal(ckpt_dir / "attempts.json", fingerprint), float(started), mtbi_s
    )


@dataclass
class RunContext:
    """What a recipe takes from where it runs (defaults: a plain process)."""

    # each metrics row (W&B in a stage); every row is also in the stage's metrics.jsonl
    log_fn: LogFn = _drop
    # the machines' hourly price and what is left of the budget (0 = no budget)
    budget: Budget = field(default_factory=Budget)
    # (checkpoint section, folder, run key) -> the store the trainer saves to and resumes from
    store: Callable[[CheckpointConfig, Path, str], CheckpointStore] = lambda cfg, root, run_key: (
        CheckpointStore.from_config(root, cfg)
    )
    # (checkpoint folder, fingerprint) -> the attempt journal and the checkpoint cadence's inputs
    resilience: Callable[[Path, str], Resilience] = local_resilience
    # (stage, max_steps, log_fn) -> the log_fn to train with, while it trains (a progress bar)
    follow: Callable[[str, int, LogFn], contextlib.AbstractContextManager[LogFn]] = _as_is
    # (checkpoint folder, run key, processes) once training ended: the offload of cold tiers
    finished: Callable[[Path, str, int], None] | None = None
    # exceptions that already mean "stop" here (Prefect's TerminationSignal): raised in a
    # step, the step before is saved; empty: a SIGTERM asks the trainer to save and stop
    notice: tuple[type[BaseException], ...] = ()


@contextlib.contextmanager
def saving_on_sigterm(
    trainer: Trainer, stage: str, notice: tuple[type[BaseException], ...] = ()
) -> Iterator[None]:
    """While `trainer` trains, a SIGTERM (a spot reclaim, an eviction) costs one step, not a
    checkpoint interval.

    - With `notice` (a handler that raises, as Prefect's in a flow run's own process) the
      handler stays: a worker that cancels a run checks that it is installed first, and a run
      it does not hear cancelled would be recorded Crashed. Its exception, raised in a step's
      forward or backward, saves the step before (`Trainer.notice`); raised elsewhere,
      nothing is saved.
    - Otherwise (a rank under torchrun, which passes a SIGTERM on to them: tasks/launch.py;
      a recipe run outside Prefect) a SIGTERM asks the trainer to save the step it is in and
      stop (`Trainer.interrupted`), and a second one acts at once. Then the handler that was
      there gets the signal, so the process ends as it would have, one checkpoint later.
    - Outside the main thread, or with SIGTERM ignored, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if notice:
        trainer.notice = notice
        yield
        return
    if previous == signal.SIG_IGN:
        yield
        return
    got: list[int] = []

    def asked(signum: int, frame: object) -> None:
        if got:  # asked twice: no more waiting for the step
            signal.signal(signal.SIGTERM, previous)
            _deliver(previous, signum, frame)
        got.append(signum)

    signal.signal(signal.SIGTERM, asked)
    trainer.interrupted = lambda: bool(got)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if got:
        log.warning("%s: SIGTERM: the step in progress was saved; ending now", stage)
        _deliver(previous, signal.SIGTERM, None)
        # a handler that returned: end the stage anyway, unfinished (it must not be saved)
        raise SystemExit(128 + signal.SIGTERM)


def _deliver(handler: object, signum: int, frame: object) -> None:
    """What `handler` (a signal.getsignal value) would have done with the signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # the default (or unknown: set outside Python): end
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
