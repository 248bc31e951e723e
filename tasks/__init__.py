"""Prefect tasks around the `moe` library: retries, storage, tracking, lineage, cost."""

import logging
import os

# Offline-friendly defaults, for Prefect, W&B, DVC and Hugging Face. Applied by the entry
# points (the `flows` package, a torchrun rank, a multi-node pod, the benchmarks) before those
# libraries read their settings; importing `tasks` alone changes nothing.
OFFLINE_DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "DVC_NO_ANALYTICS": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "WANDB_SILENT": "true",
    # the first ephemeral start migrates a fresh database: ~15 s on 2 cores, more under load
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
    "PREFECT_LOGGING_EXTRA_LOGGERS": "moe,tasks,flows",
    "PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW": "ignore",
}


def offline_defaults() -> None:
    """Set OFFLINE_DEFAULTS where the user has not (whatever they configured wins), and let
    the INFO lines of our loggers through (Prefect forwards them: PREFECT_LOGGING_EXTRA_LOGGERS)."""
    for k, v in OFFLINE_DEFAULTS.items():
        os.environ.setdefault(k, v)
    for name in ("moe", "tasks", "flows"):
        logging.getLogger(name).setLevel(logging.INFO)


def retry_unless_input_error(task: object, task_run: object, state: object) -> bool:
    """Prefect retry condition: retry failures, but not bad input (a retry cannot fix it)."""
    from moe.errors import InputError

    try:
        state.result()  # type: ignore[attr-defined]
    except InputError:
        return False
    except Exception:  # noqa: BLE001 - any other failure is worth a retry
        return True
    return True


class _InputErrorWithoutTraceback(logging.Filter):
    """Bad input is the user's to fix, and its message says how: Prefect's run loggers log it
    as one line instead of with a traceback of the engine's frames. Other errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        from moe.errors import InputError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, InputError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_input_errors() -> None:
    """Install the filter on Prefect's flow- and task-run loggers (idempotent)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _InputErrorWithoutTraceback) for f in logger.filters):
            logger.addFilter(_InputErrorWithoutTraceback())
