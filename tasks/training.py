"""What every training stage's Prefect task shares: its retries, and the run context it gives
the recipe it runs (moe/recipes/context.py): the object store that checkpoints offload to and
are fetched back from, the pool's price and interruption rate, the W&B run with the progress
bar and artifact, and Prefect's cancellation as the stop notice.

A retry of either task resumes from its newest valid checkpoint (the trainer looks for one
before it starts), so a machine that dies costs at most `checkpoint_every` steps. One that
gives notice by SIGTERM (a spot reclaim, an eviction) costs about one step: the step is
saved, then the process ends by the signal as it would have (moe/recipes/context.py
`saving_on_sigterm`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.exceptions import TerminationSignal
from prefect.tasks import exponential_backoff
from prefect.utilities.engine import is_prefect_sigterm_handler_installed

from moe.checkpoint.config import CheckpointConfig
from moe.checkpoint.store import CheckpointStore
from moe.recipes.context import RunContext, local_resilience
from moe.train.stop import Budget
from moe.train.trainer import Resilience
from tasks import retry_unless_input_error
from tasks.checkpoints import checkpoint_store, offload_checkpoints
from tasks.config import Config
from tasks.events import row_events
from tasks.pools import PoolSpec
from tasks.progress import training_log

TRAIN_RETRIES = dict(
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_input_error,
)


def stage_context(
    cfg: Config, stage: str, log_fn: Callable[[dict[str, Any]], None], budget_left: float = 0.0
) -> RunContext:
    """The run context of `stage` under the pipeline: budget_left is what is left of
    cost.budget for this stage (0 = no budget)."""

    def store(_: CheckpointConfig, root: Path, run_key: str) -> CheckpointStore:
        return checkpoint_store(cfg, root, run_key)

    def finished(root: Path, run_key: str, world: int) -> None:
        if not cfg.checkpoint.offload:
            return
        if world > 1:  # inside torchrun: no Prefect flow here; the parent task retries
            offload_checkpoints.fn(cfg, root, run_key)
        else:
            offload_checkpoints(cfg, root, run_key)

    # In a flow run's own process Prefect's handler turns a SIGTERM into TerminationSignal.
    prefect_handler = (
        threading.current_thread() is threading.main_thread()
        and is_prefect_sigterm_handler_installed()
    )
    return RunContext(
        log_fn=log_fn,
        budget=Budget(stage_price(cfg, stage), budget_left, cfg.cost.alert_fraction),
        store=store,
        resilience=lambda ckpt_dir, fingerprint: stage_resilience(
            cfg, stage, ckpt_dir, fingerprint
        ),
        follow=lambda name, steps, fn: training_log(name, steps, fn, row_events(cfg, stage)),
        finished=finished,
        notice=(TerminationSignal,) if prefect_handler else (),
    )


def _pool(cfg: Config, stage: str) -> PoolSpec:
    return cfg.pools.definitions[cfg.pools.stages[stage]]


def stage_price(cfg: Config, stage: str) -> float:
    """What an hour of this stage costs: the pool's rate for each machine it spans."""
    return _pool(cfg, stage).rate * cfg.machines(stage)


def stage_resilience(cfg: Config, stage: str, ckpt_dir: Path, fingerprint: str) -> Resilience:
    """The attempt journal beside the checkpoints, this process's start (what a restart costs
    is measured from it) and, with checkpoint.every: auto, the pool's mean time between
    interruptions."""
    mtbi = _pool(cfg, stage).mtbi_s if cfg.checkpoint.every == "auto" else None
    return local_resilience(ckpt_dir, fingerprint, mtbi)
