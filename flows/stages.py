"""One Prefect flow per stage. A stage is the unit that runs on one work pool.

Stages hand data to each other through the object store (publish uploads, training stages
download and verify) and through model folders; each writes `lineage.json` beside its outputs.
Every flow takes the params file and `--set` overrides, validates them before any work, and
saves the resolved configuration beside its outputs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow

from moe.config import Config, load_config
from moe.errors import InputError
from tasks import quiet_input_errors
from tasks.cost import cost_ledger, phase_costs, storage_costs
from tasks.data import build_sql_sets, build_tokenizer, commit_folder, tokenize_corpus
from tasks.evaluation import evaluate_perplexity, evaluate_sql
from tasks.handoff import pull_inputs, push_outputs, stage_outputs
from tasks.lineage import StageRecord, up_to_date, write_json
from tasks.presentation import (
    plot_cost,
    plot_expert_load,
    plot_training,
    publish_artifacts,
    publish_cost_table,
    run_report,
)
from tasks.storage import download_dataset, open_store, publish_dataset
from tasks.tracking import wandb_run
from tasks.training import finetune_model, pretrain_model

log = logging.getLogger("flows.stages")  # by name: a deployment loads this file as a script
quiet_input_errors()  # bad input that reaches a flow: one line in its log, no traceback

PUBLISHED = Path("data/published")
MODELS = Path("models")
REPORTS = Path("reports")
TRAIN_STAGES = ("pretrain", "finetune_sql", "finetune_domain")


def _receipt() -> dict[str, Any]:
    path = PUBLISHED / "receipt.json"
    if not path.is_file():
        raise InputError(
            f"{path} is missing: run the publish stage first (moe-pipeline stage publish)"
        )
    return json.loads(path.read_text())


def _load(
    stage: str,
    params_file: str | None,
    overrides: list[str] | None,
    params: dict[str, Any] | None,
    handoff: str | None,
) -> Config:
    """The stage's configuration; with a hand-off run key (dispatch: deployments), first fetch
    and verify what the earlier stages handed off through the object store."""
    cfg = load_config(params_file, overrides or [], params)
    if handoff and stage != "prepare":
        pull_inputs(cfg, stage, handoff)
    return cfg


def _hand_off(cfg: Config, stage: str, handoff: str | None) -> None:
    if handoff:
        push_outputs(cfg, stage, handoff)


def _skipped(
    cfg: Config,
    stage: str,
    out_dir: Path,
    inputs: dict[str, Path],
    handoff: str | None,
    still_there: Callable[[], bool] = lambda: True,
) -> dict[str, Any] | None:
    """The stage's last summary if its params, code and inputs are unchanged since it ran and
    its outputs are intact (tasks/lineage.py:up_to_date): the stage is skipped and says so.
    MOE_FORCE=1 runs it anyway (`moe-pipeline stage|run --force`)."""
    if os.environ.get("MOE_FORCE", "") not in ("", "0"):
        return None
    rec = up_to_date(cfg, stage, out_dir, inputs, stage_outputs(cfg, stage))
    if rec is None or not still_there():
        return None
    log.info(
        "stage %s skipped: its params, code and inputs (%s) are unchanged since its run that "
        "ended %s (flow run %s); its outputs in %s are kept (MOE_FORCE=1 runs it anyway)",
        stage,
        ", ".join(inputs) or "none",
        rec.get("ended"),
        rec.get("flow_run_id"),
        out_dir,
    )
    publish_artifacts(stage, {"skipped": True, "unchanged_since": rec.get("ended")})
    _hand_off(cfg, stage, handoff)
    return {**rec.get("metrics", {}), "skipped": True}


def _corpus(cfg: Config) -> dict[str, Path]:
    """The corpus as a content-hashed input, where it is a local file or folder (the stdlib
    corpus is identified by the Python version, a hub dataset by its id, in the params hash)."""
    src = Path(cfg.data.source).expanduser()
    return {"corpus": src} if cfg.data.source != "stdlib" and src.exists() else {}


# Every stage flow takes the same parameters: a params file and `--set` overrides (the CLI and
# dvc.yaml), or `params`, a resolved configuration, and `handoff`, the run key under which
# stages on different machines pass their outputs through the object store (flows/pipeline.py).


@flow(name="prepare", log_prints=True)
def prepare(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Tokenize the corpus into memmap token files and generate the SQL pair sets (CPU)."""
    cfg = _load("prepare", params_file, overrides, params, handoff)
    out = Path(cfg.data.out_dir)
    if (done := _skipped(cfg, "prepare", out, _corpus(cfg), handoff)) is not None:
        return done
    record = StageRecord(cfg, "prepare", out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = build_tokenizer(cfg, tmp)
        meta = tokenize_corpus(cfg, tmp, tok)
        sql = build_sql_sets(cfg, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous prepared data stays as it was
        raise
    commit_folder(tmp, out)
    summary = {
        "documents": meta["documents"],
        "train_tokens": meta["splits"]["train"]["tokens"],
        "val_tokens": meta["splits"]["val"]["tokens"],
        "vocab_size": meta["vocab_size"],
        "skipped_undecodable": meta["skipped_undecodable"],
        "tokens_per_s": meta["tokens_per_s"],
        **{f"sql_{k}": v for k, v in sql.items()},
    }
    record.write(inputs=_corpus(cfg), outputs={"prepared": out}, metrics=summary)
    publish_artifacts("prepare", summary)
    _hand_off(cfg, "prepare", handoff)
    return summary


@flow(name="publish", log_prints=True)
def publish(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Archive the prepared data with zstd and upload it with a sha256 manifest (CPU)."""
    cfg = _load("publish", params_file, overrides, params, handoff)
    prepared = Path(cfg.data.out_dir)
    if not (prepared / "meta.json").is_file():
        raise InputError(
            f"{prepared}/meta.json is missing: run the prepare stage first (moe-pipeline stage prepare)"
        )

    def in_store() -> bool:  # an emptied bucket (or another one) needs a new upload
        receipt = json.loads((PUBLISHED / "receipt.json").read_text())
        store = open_store(cfg.storage)
        return all(store.exists(receipt[k]) for k in ("manifest_key", "archive_key"))

    if done := _skipped(cfg, "publish", PUBLISHED, {"prepared": prepared}, handoff, in_store):
        return done
    record = StageRecord(cfg, "publish", PUBLISHED)
    work = Path(".cache/publish")
    published = publish_dataset(cfg, prepared, work)
    shutil.rmtree(work, ignore_errors=True)
    write_json(PUBLISHED / "receipt.json", published.to_dict())
    log.info(
        "published %s/%s to %s: %d -> %d bytes; token files alone compress to %.1f%% of their size",
        published.name,
        published.version,
        published.uri,
        published.raw_bytes,
        published.archive_bytes,
        100 * published.token_archive_ratio,
    )
    record.write(
        inputs={"prepared": prepared},
        outputs={"receipt": PUBLISHED / "receipt.json"},
        metrics=published.to_dict(),
    )
    publish_artifacts("publish", published.to_dict())
    _hand_off(cfg, "publish", handoff)
    return published.to_dict()


def _train_summary(stage: str, result: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"stage": stage, **asdict(result), **(extra or {})}


@flow(name="pretrain", log_prints=True)
def pretrain(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Download and verify the published data, then pretrain the MoE model (GPU)."""
    cfg = _load("pretrain", params_file, overrides, params, handoff)
    receipt = _receipt()
    out = MODELS / "pretrain"
    inputs = {"receipt": PUBLISHED / "receipt.json"}
    if (done := _skipped(cfg, "pretrain", out, inputs, handoff)) is not None:
        return done
    record = StageRecord(cfg, "pretrain", out)
    data_dir = download_dataset(cfg, receipt)
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        result = pretrain_model(
            cfg, data_dir, out, log_fn, _budget_left(cfg, "pretrain"), receipt=receipt
        )
    summary = _train_summary("pretrain", result, {"dataset_version": receipt["version"]})
    write_json(REPORTS / "pretrain.json", summary)
    record.write(
        inputs=inputs,
        outputs={"model": out / "model.safetensors"},
        metrics=summary,
        wandb_run_id=run_id,
        compute_s=result.wall_s,
    )
    publish_artifacts("pretrain", summary)
    _hand_off(cfg, "pretrain", handoff)
    return summary


def _finetune(
    stage: str,
    pairs_file: str,
    init: str,
    params_file: str | None,
    overrides: list[str] | None,
    params: dict[str, Any] | None,
    handoff: str | None,
) -> dict[str, Any]:
    cfg = _load(stage, params_file, overrides, params, handoff)
    receipt = _receipt()
    out, init_dir = MODELS / stage, MODELS / init
    if not (init_dir / "model.safetensors").is_file():
        raise InputError(f"{init_dir}/model.safetensors is missing: run the {init} stage first")
    inputs = {
        "receipt": PUBLISHED / "receipt.json",
        "init_model": init_dir / "model.safetensors",
    }
    if (done := _skipped(cfg, stage, out, inputs, handoff)) is not None:
        return done
    record = StageRecord(cfg, stage, out)
    data_dir = download_dataset(cfg, receipt)
    with wandb_run(cfg, stage) as (log_fn, run_id):
        result = finetune_model(
            cfg,
            stage,
            data_dir,
            pairs_file,
            init_dir,
            out,
            log_fn,
            _budget_left(cfg, stage),
            receipt=receipt,
        )
    summary = _train_summary(stage, result)
    write_json(REPORTS / f"{stage}.json", summary)
    record.write(
        inputs=inputs,
        outputs={"model": out / "model.safetensors"},
        metrics=summary,
        wandb_run_id=run_id,
        compute_s=result.wall_s,
    )
    publish_artifacts(stage, summary)
    _hand_off(cfg, stage, handoff)
    return summary


@flow(name="finetune_sql", log_prints=True)
def finetune_sql(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Stage one of finetuning: the generic SQL pairs, from the pretrained model (GPU)."""
    return _finetune(
        "finetune_sql", "generic.jsonl", "pretrain", params_file, overrides, params, handoff
    )


@flow(name="finetune_domain", log_prints=True)
def finetune_domain(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Stage two of finetuning: the target-domain pairs, from the SQL model (GPU)."""
    return _finetune(
        "finetune_domain",
        "domain_train.jsonl",
        "finetune_sql",
        params_file,
        overrides,
        params,
        handoff,
    )


@flow(name="evaluate", log_prints=True)
def evaluate(
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Perplexity and SQL accuracy of every stage's model, the bill and the report."""
    cfg = _load("evaluate", params_file, overrides, params, handoff)
    receipt = _receipt()
    out = REPORTS / "evaluate"
    inputs = {s: MODELS / s / "model.safetensors" for s in TRAIN_STAGES}
    if (done := _skipped(cfg, "evaluate", out, inputs, handoff)) is not None:
        return done
    record = StageRecord(cfg, "evaluate", out)
    data_dir = download_dataset(cfg, receipt)
    metrics: dict[str, Any] = {
        "dataset_version": receipt["version"],
        "token_archive_ratio": receipt["token_archive_ratio"],
    }
    # Every stage's model on the same held-out sets: the table shows what each stage bought.
    for stage in TRAIN_STAGES:
        metrics[stage] = {
            "val": evaluate_perplexity(cfg, data_dir, MODELS / stage),
            **evaluate_sql(cfg, data_dir, MODELS / stage),
        }
    plot = plot_training(
        {s: MODELS / s / "metrics.jsonl" for s in TRAIN_STAGES}, out / "training_loss.png"
    )
    heatmaps = [
        plot_expert_load(MODELS / s / "metrics.jsonl", out / f"expert_load_{s}.png", s)
        for s in TRAIN_STAGES
    ]

    records = [json.loads(p.read_text()) for p in _lineage_files(cfg)]
    own = record.build(inputs={}, outputs={})  # this stage's time so far enters the ledger
    commit = next(r["code"]["commit"] for r in records if r["stage"] == "pretrain")
    shares = {
        s: json.loads((REPORTS / f"{s}.json").read_text()).get("expert_share") for s in TRAIN_STAGES
    }
    ledger = cost_ledger(cfg, [*records, own], shares)
    ledger["by_phase"] = {
        s: phase_costs(
            [json.loads(x) for x in (MODELS / s / "metrics.jsonl").read_text().splitlines() if x]
            if (MODELS / s / "metrics.jsonl").is_file()
            else [],
            getattr(cfg, "train" if s == "pretrain" else s).warmup_steps,
        )
        for s in TRAIN_STAGES
    }
    # Kept: the published archive and the three models; moved: one archive download per
    # training stage and for evaluation (storage and transfer are part of the bill).
    model_bytes = sum((MODELS / s / "model.safetensors").stat().st_size for s in TRAIN_STAGES)
    archive = int(receipt.get("archive_bytes", 0))
    ledger["storage"] = storage_costs(cfg, archive + model_bytes, archive * (len(TRAIN_STAGES) + 1))
    cost_png = plot_cost(ledger, out / "cost.png")
    publish_cost_table(ledger)
    write_json(REPORTS / "cost.json", ledger)
    metrics["cost_total"] = ledger["total"]
    write_json(REPORTS / "metrics.json", metrics)
    write_json(REPORTS / "summary.json", headline(metrics, ledger))
    run_report(out / "report.md", receipt, commit, metrics, ledger, cost_png, plot, heatmaps)
    publish_artifacts(
        "evaluate",
        {
            "cost_total": ledger["total"],
            **{f"{s}_ppl": round(metrics[s]["val"]["perplexity"], 3) for s in TRAIN_STAGES},
        },
    )
    record.write(
        inputs=inputs,
        outputs={
            "metrics": REPORTS / "metrics.json",
            "cost": REPORTS / "cost.json",
            "summary": REPORTS / "summary.json",
        },
        metrics={k: v for k, v in metrics.items() if not isinstance(v, dict)},
    )
    _hand_off(cfg, "evaluate", handoff)
    return metrics


def headline(metrics: dict[str, Any], ledger: dict[str, Any]) -> dict[str, Any]:
    """The few figures one compares across runs: what `dvc metrics show` and `dvc exp show`
    print (one row, a dozen columns). The detail stays in reports/metrics.json and cost.json."""
    out: dict[str, Any] = {}
    for s in TRAIN_STAGES:
        out[s] = {
            "ppl": round(metrics[s]["val"]["perplexity"], 3),
            "exec_acc": round(metrics[s]["sql"]["execution_accuracy"], 4),
        }
        if "generic_heldout" in metrics[s]:
            generic = [metrics[s][k] for k in ("generic_seen", "generic_heldout")]
            n = sum(g["examples"] for g in generic)
            out[s]["generic_exec_acc"] = round(
                sum(g["execution_accuracy"] * g["examples"] for g in generic) / max(n, 1), 4
            )
    out["cost"] = {
        "total": round(ledger["total"], 5),
        "saving": round(ledger["saving"], 5),
        "saving_pct": round(100 * ledger["saving_fraction"], 1),
    }
    return out


def _budget_left(cfg: Config, stage: str) -> float:
    """What is left of cost.budget for `stage`: the budget minus what the upstream stages'
    lineage records say they cost (0 = no budget)."""
    if cfg.cost.budget <= 0:
        return 0.0
    spent = 0.0
    upstream = TRAIN_STAGES[: TRAIN_STAGES.index(stage)]
    for p in [Path(cfg.data.out_dir) / "lineage.json", PUBLISHED / "lineage.json"] + [
        MODELS / s / "lineage.json" for s in upstream
    ]:
        if p.is_file():
            spent += float(json.loads(p.read_text()).get("cost", 0.0))
    left = cfg.cost.budget - spent
    if left <= 0:
        log.warning(
            "cost.budget %.4f is already spent (%.4f) before %s", cfg.cost.budget, spent, stage
        )
    return max(left, 1e-9)


def _lineage_files(cfg: Config) -> list[Path]:
    paths = [
        Path(cfg.data.out_dir) / "lineage.json",
        PUBLISHED / "lineage.json",
        *(MODELS / s / "lineage.json" for s in TRAIN_STAGES),
    ]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InputError(
            f"lineage records missing: {', '.join(missing)}; run the earlier stages first"
        )
    return paths


STAGE_FLOWS = {
    "prepare": prepare,
    "publish": publish,
    "pretrain": pretrain,
    "finetune_sql": finetune_sql,
    "finetune_domain": finetune_domain,
    "evaluate": evaluate,
}
