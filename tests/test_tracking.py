"""W&B runs offline (no network): the run file a later `wandb sync` uploads holds every logged
value, per-expert load included (read back from it), and the run id is returned for lineage."""

from __future__ import annotations

import os
from pathlib import Path

from tasks.config import Config, WandbConfig
from tasks.tracking import wandb_run
from tests.wandb_log import history, run_file


def test_offline_run_logs_and_returns_its_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = Config(wandb=WandbConfig(mode="offline", dir=str(tmp_path)))
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        log_fn({"step": 10, "loss": 3.2, "expert_share": [[0.5, 0.25, 0.25], [0.3, 0.3, 0.4]]})
        log_fn({"step": 20, "val_loss": 3.0})
    assert run_id
    # W&B's service is stopped with the run: no WANDB_SERVICE for the processes started later
    # (a DVC stage or torchrun rank that inherited it wrote its run to a dead service)
    assert "WANDB_SERVICE" not in os.environ
    rows = history(run_file(tmp_path, run_id))
    assert sorted(rows) == [10, 20]
    assert rows[10]["loss"] == 3.2 and rows[20]["val_loss"] == 3.0
    # one value per expert and layer, and a histogram of all six shares
    assert rows[10]["expert_load/layer0/expert0/share"] == 0.5
    assert rows[10]["expert_load/layer1/expert2/share"] == 0.4
    assert sum(rows[10]["expert_load/histogram/values"]) == 6


def test_disabled_mode_is_a_no_op(tmp_path: Path) -> None:
    cfg = Config(wandb=WandbConfig(mode="disabled", dir=str(tmp_path)))
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        log_fn({"step": 1, "loss": 1.0})
    assert run_id is None and not (tmp_path / "wandb").exists()
