"""The pretrain stage: download and verify the published data, then pretrain the MoE model
(GPU)."""

from __future__ import annotations

from pathlib import Path

from flows.stage import (
    MODELS,
    PUBLISHED,
    REPORTS,
    Done,
    Stage,
    budget_left,
    model_handoff,
    published,
    read_receipt,
    train_summary,
)
from tasks.archive import download_dataset
from tasks.config import Config
from tasks.lineage import StageRecord, write_json
from tasks.pretraining import pretrain_model
from tasks.tracking import wandb_run


def _pretrain_inputs(cfg: Config) -> dict[str, Path]:
    """The published data and, with model.init, the imported checkpoint (every file of the
    folder content-hashed: the lineage names the weights it started from)."""
    out = published(cfg)
    if cfg.model.init:
        out["init"] = Path(cfg.model.init)
    return out


def _pretrain(cfg: Config, record: StageRecord) -> Done:
    """Download and verify the published data, then pretrain the MoE model (GPU)."""
    receipt, out = read_receipt(), MODELS / "pretrain"
    data_dir = download_dataset(cfg, receipt)
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        result = pretrain_model(
            cfg, data_dir, out, log_fn, budget_left(cfg, record), receipt=receipt
        )
    summary = train_summary("pretrain", result, {"dataset_version": receipt["version"]})
    write_json(REPORTS / "pretrain.json", summary)
    return Done(summary, {"model": out / "model.safetensors"}, None, None, run_id, result.wall_s)


PRETRAIN = Stage(
    "pretrain",
    "pretrain",
    "Download and verify the published data, then pretrain the MoE model (GPU).",
    out=lambda cfg: MODELS / "pretrain",
    inputs=_pretrain_inputs,
    handoff=model_handoff("pretrain"),
    body=_pretrain,
    done="models/pretrain/ (metrics: reports/pretrain.json)",
    reads=lambda cfg: [(PUBLISHED / "receipt.json", "publish")],
    trains=True,
)
