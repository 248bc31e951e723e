"""The finetune stages: the previous stage's model on SQL pairs, generic first, then the
target domain's (GPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flows.stage import (
    MODELS,
    PUBLISHED,
    REPORTS,
    Done,
    Stage,
    budget_left,
    model_handoff,
    read_published,
    read_receipt,
    train_summary,
)
from moe.errors import InputError
from moe.recipes.finetune import FINETUNES
from tasks.archive import download_dataset
from tasks.config import Config
from tasks.finetuning import finetune_model
from tasks.lineage import StageRecord, write_json
from tasks.tracking import wandb_run


def _finetune_inputs(stage: str, init: str) -> Callable[[Config], dict[str, Path]]:
    def inputs(cfg: Config) -> dict[str, Path]:
        model = MODELS / init / "model.safetensors"
        read_published(cfg)
        if not model.is_file():
            raise InputError(f"{model} is missing: run the {init} stage first")
        return {"receipt": PUBLISHED / "receipt.json", "init_model": model}

    return inputs


def _finetune(stage: str, pairs_file: str, init: str) -> Callable[[Config, StageRecord], Done]:
    def body(cfg: Config, record: StageRecord) -> Done:
        receipt, out = read_receipt(), MODELS / stage
        data_dir = download_dataset(cfg, receipt)
        with wandb_run(cfg, stage) as (log_fn, run_id):
            result = finetune_model(
                cfg,
                stage,
                data_dir,
                pairs_file,
                MODELS / init,
                out,
                log_fn,
                budget_left(cfg, record),
                receipt=receipt,
            )
        summary = train_summary(stage, result)
        write_json(REPORTS / f"{stage}.json", summary)
        return Done(
            summary, {"model": out / "model.safetensors"}, None, None, run_id, result.wall_s
        )

    return body


def _finetune_stage(name: str, doc: str, pairs_file: str, init: str) -> Stage:
    """A finetune stage: `pairs_file` from the model of stage `init`, settings in `name`."""
    return Stage(
        name,
        name,
        doc,
        out=lambda cfg: MODELS / name,
        inputs=_finetune_inputs(name, init),
        handoff=model_handoff(name),
        body=_finetune(name, pairs_file, init),
        done=f"models/{name}/ (metrics: reports/{name}.json)",
        reads=lambda cfg: [
            (PUBLISHED / "receipt.json", "publish"),
            (MODELS / init / "model.safetensors", init),
        ],
        trains=True,
    )


FINETUNE_SQL = _finetune_stage(
    "finetune_sql",
    "Stage one of finetuning: the generic SQL pairs, from the pretrained model (GPU).",
    *FINETUNES["finetune_sql"],
)

FINETUNE_DOMAIN = _finetune_stage(
    "finetune_domain",
    "Stage two of finetuning: the target-domain pairs, from the SQL model (GPU).",
    *FINETUNES["finetune_domain"],
)
