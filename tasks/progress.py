"""Progress of long work where a user looks: a bar on a terminal, a progress artifact in the
Prefect UI. Without a terminal (CI, a worker, `dvc repro` piped to a file) no bar is drawn:
the trainer's and evaluator's own log lines say how far they are.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

log = logging.getLogger(__name__)

ARTIFACT_EVERY_S = 2.0  # at most one progress update to the Prefect API per this many seconds


def _artifact(create: bool, key_or_id: Any, percent: float, description: str) -> Any:
    """Create or update the Prefect progress artifact; never fails the work it reports on."""
    try:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact
        from prefect.context import FlowRunContext, TaskRunContext

        if FlowRunContext.get() is None and TaskRunContext.get() is None:
            return None  # not in a run (a notebook, a torchrun rank): nothing to attach it to
        if create:
            return create_progress_artifact(percent, key=key_or_id, description=description)
        update_progress_artifact(key_or_id, percent, description=description)
    except Exception as e:  # noqa: BLE001 - outside a flow run, or the API is away: no artifact
        log.debug("progress artifact not written: %s", e)
    return key_or_id if not create else None


@contextlib.contextmanager
def progress(
    name: str, total: int, unit: str, *, tty: bool | None = None, log_lines: bool = True
) -> Iterator[Callable[[int, str], None]]:
    """Yields `update(done, note)`. `name` keys the Prefect artifact (`<name>-progress`).
    Without a terminal, `log_lines` logs a line at every tenth of the way instead of a bar."""
    total = max(int(total), 1)
    key = f"{name.replace('_', '-').lower()}-progress"
    what = f"{name}: 0 of {total} {unit}"
    artifact_id = _artifact(True, key, 0.0, what)
    show = sys.stderr.isatty() if tty is None else tty
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[note]}"),
        disable=not show,
        transient=False,
    )
    job = bar.add_task(name, total=total, note="")
    last = {"t": 0.0, "done": 0, "tenth": 0}

    def update(done: int, note: str = "") -> None:
        done = min(int(done), total)
        last["done"] = done
        bar.update(job, completed=done, note=note)
        tenth = 10 * done // total
        if not show and log_lines and tenth > last["tenth"]:
            last["tenth"] = tenth
            log.info("%s: %d of %d %s%s", name, done, total, unit, f" ({note})" if note else "")
        now = time.monotonic()
        if artifact_id is not None and (now - last["t"] >= ARTIFACT_EVERY_S or done == total):
            last["t"] = now
            desc = f"{name}: {done} of {total} {unit}" + (f" ({note})" if note else "")
            _artifact(False, artifact_id, 100.0 * done / total, desc)

    with bar:
        try:
            yield update
        finally:
            if artifact_id is not None:  # the last figure reaches the UI, throttled or not
                done = last["done"]
                _artifact(
                    False, artifact_id, 100.0 * done / total, f"{name}: {done} of {total} {unit}"
                )


def training_log(
    stage: str,
    max_steps: int,
    log_fn: Callable[[dict[str, Any]], None],
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> contextlib.AbstractContextManager[Callable[[dict[str, Any]], None]]:
    """`log_fn` (W&B) plus progress: every metrics row the trainer emits moves the bar and the
    stage's Prefect progress artifact to its step, and goes to `on_row` (the events)."""

    @contextlib.contextmanager
    def wrapped() -> Iterator[Callable[[dict[str, Any]], None]]:
        # the trainer logs its own line every log_every steps: no second one here
        with progress(stage, max_steps, "steps", log_lines=False) as update:

            def log_and_show(row: dict[str, Any]) -> None:
                log_fn(row)
                if on_row is not None:
                    on_row(row)
                if "loss" in row:
                    update(int(row["step"]), f"loss {row['loss']:.3f}")
                elif "early_stop" in row:
                    update(int(row["step"]), f"stopped: {row['early_stop']}")

            yield log_and_show

    return wrapped()
