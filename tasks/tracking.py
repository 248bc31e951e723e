"""Weights & Biases: offline by default; the run id is kept for lineage.

Offline runs land in `WANDB_DIR/wandb/offline-run-*` for a later `wandb sync`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from moe.model.stats import flat_metrics
from tasks.config import Config

log = logging.getLogger(__name__)


@contextlib.contextmanager
def wandb_run(
    cfg: Config, stage: str, group: str | None = None
) -> Iterator[tuple[Callable[[dict[str, Any]], None], str | None]]:
    """Yields (log_fn, run_id). With wandb.mode disabled, log_fn does nothing and run_id is None."""
    if cfg.wandb.mode == "disabled":
        yield (lambda row: None), None
        return
    import wandb

    Path(cfg.wandb.dir).mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity or None,
        mode=cfg.wandb.mode,
        dir=cfg.wandb.dir,
        job_type=stage,
        group=group,
        config=cfg.to_dict(),
        reinit="finish_previous",
        settings=wandb.Settings(silent=True, console="off"),
    )

    def log_fn(row: dict[str, Any]) -> None:
        data = {k: v for k, v in row.items() if k not in ("step", "expert_share")}
        share = row.get("expert_share")
        if share:
            # Per-expert load: a value per expert and layer, and a histogram of all shares.
            data.update(flat_metrics({"share": share}, prefix="expert_load"))
            data["expert_load/histogram"] = wandb.Histogram([v for layer in share for v in layer])
        run.log(data, step=int(row["step"]))

    try:
        yield log_fn, run.id
    finally:
        run.finish()
        # Stop W&B's service process: the run file is complete on disk before the lineage
        # record names the run, and WANDB_SERVICE (which W&B puts in os.environ) is gone, so
        # processes this one starts later (torchrun ranks, a DVC stage) never talk to a
        # service that no longer runs.
        wandb.teardown()
