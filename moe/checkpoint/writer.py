"""The background checkpoint writer: one worker thread ("checkpoint-writer") that runs each
queued save's encode and write while training goes on. The queue holds one save, so a save
waits while the previous one is still being written; a failed write is kept and raised on
the training thread by the next save, flush or close."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class BackgroundWriter:
    """Runs `write(*job)` on a worker thread for every job `put` (started on first use)."""

    def __init__(self, write: Callable[..., None]) -> None:
        self.write = write
        self._queue: queue.Queue[tuple | None] = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None

    def put(self, job: tuple[Any, ...]) -> None:
        """Queue one job; blocks while the previous one is still being written."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._worker.start()
        self._queue.put(job)

    def join(self) -> None:
        """Wait until every queued job has run."""
        if self._worker is not None:
            self._queue.join()

    def stop(self) -> None:
        """Run the queued jobs, then end the worker thread."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    def raise_failure(self) -> None:
        """Raise (once) the failure of a job that ran since the last call, if any."""
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint write failed: {err}") from err

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self.write(*job)
            except BaseException as e:  # reported on the next save() or flush()
                log.error("checkpoint write failed: %s", e)
                self._error = e
            finally:
                # the save's host copy (gigabytes) must not wait here for the next save
                del job
                self._queue.task_done()
