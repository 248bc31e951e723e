"""W&B runs offline (no network): a run directory appears for a later `wandb sync`, the run id
is returned for lineage, and metric rows with per-expert load are accepted at the logging seam."""

from __future__ import annotations

from pathlib import Path

from moe.config import Config, WandbConfig
from tasks.tracking import wandb_run


def test_offline_run_logs_and_returns_its_id(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = Config(wandb=WandbConfig(mode="offline", dir=str(tmp_path)))
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        log_fn({"step": 10, "loss": 3.2, "expert_share": [[0.5, 0.25, 0.25], [0.3, 0.3, 0.4]]})
        log_fn({"step": 20, "val_loss": 3.0})
    assert run_id
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_disabled_mode_is_a_no_op(tmp_path: Path) -> None:
    cfg = Config(wandb=WandbConfig(mode="disabled", dir=str(tmp_path)))
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        log_fn({"step": 1, "loss": 1.0})
    assert run_id is None and not (tmp_path / "wandb").exists()
