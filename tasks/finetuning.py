"""The finetune stages' Prefect task: moe/recipes/finetune.py where tasks/launch.py says
(here, torchrun, a Job across the stage's nodes), with the stage's run context
(tasks/training.py). A retry resumes from the newest valid checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.recipes.finetune import finetune
from moe.train.report import TrainResult
from tasks.config import Config
from tasks.launch import run_training
from tasks.training import TRAIN_RETRIES, stage_context


@task(name="finetune-model", cache_policy=NONE, **TRAIN_RETRIES)
def finetune_model(
    cfg: Config,
    stage: str,
    data_dir: Path,
    pairs_file: str,
    init_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float = 0.0,
    receipt: dict[str, Any] | None = None,
) -> TrainResult:
    return run_training(
        cfg,
        stage,
        lambda: finetune(
            cfg,
            stage,
            data_dir,
            pairs_file,
            init_dir,
            out_dir,
            stage_context(cfg, stage, log_fn, budget_left),
        ),
        data_dir,
        out_dir,
        log_fn,
        init_dir,
        pairs_file,
        budget_left,
        receipt,
    )
