"""The pretrain stage's Prefect task: moe/recipes/pretrain.py where tasks/launch.py says
(here, torchrun, a Job across pretrain.nodes machines), with the stage's run context
(tasks/training.py). A retry resumes from the newest valid checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.recipes.pretrain import pretrain
from moe.train.report import TrainResult
from tasks.config import Config
from tasks.launch import run_training
from tasks.training import TRAIN_RETRIES, stage_context


@task(name="pretrain-model", cache_policy=NONE, **TRAIN_RETRIES)
def pretrain_model(
    cfg: Config,
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float = 0.0,
    receipt: dict[str, Any] | None = None,
) -> TrainResult:
    """budget_left: what is left of cost.budget for this stage (0 = no budget). Where it
    trains (here, torchrun, a Job across pretrain.nodes machines, which fetch the data the
    receipt names) is tasks/launch.py's to decide."""
    return run_training(
        cfg,
        "pretrain",
        lambda: pretrain(
            cfg, data_dir, out_dir, stage_context(cfg, "pretrain", log_fn, budget_left)
        ),
        data_dir,
        out_dir,
        log_fn,
        budget_left=budget_left,
        receipt=receipt,
    )
