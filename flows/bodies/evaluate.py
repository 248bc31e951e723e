"""The evaluate stage: perplexity and SQL accuracy of every training stage's model, the bill,
the report, and the final model exported as transformers loads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flows.stage import (
    EXPORT,
    MODELS,
    PUBLISHED,
    REPORTS,
    Done,
    Stage,
    files,
    lineage_files,
    read_published,
    read_receipt,
)
from tasks.archive import download_dataset
from tasks.config import Config
from tasks.cost import cost_ledger, phase_costs, storage_costs
from tasks.evaluation import evaluate_perplexity, evaluate_sql
from tasks.lineage import StageRecord, write_json
from tasks.presentation import (
    plot_cost,
    plot_expert_load,
    plot_training,
    publish_cost_table,
    run_report,
)
from tasks.publish import export_final


def _evaluate(cfg: Config, record: StageRecord) -> Done:
    """Perplexity and SQL accuracy of every stage's model, the bill and the report."""
    receipt, out, trained = read_receipt(), REPORTS / "evaluate", list(Config.training_stages())
    data_dir = download_dataset(cfg, receipt)
    metrics: dict[str, Any] = {
        "dataset_version": receipt["version"],
        "token_archive_ratio": receipt["token_archive_ratio"],
    }
    # Every stage's model on the same held-out sets: the table shows what each stage bought.
    for stage in trained:
        metrics[stage] = {
            "val": evaluate_perplexity(cfg, data_dir, MODELS / stage),
            **evaluate_sql(cfg, data_dir, MODELS / stage),
        }
    plot = plot_training(
        {s: MODELS / s / "metrics.jsonl" for s in trained}, out / "training_loss.png"
    )
    heatmaps = [
        plot_expert_load(MODELS / s / "metrics.jsonl", out / f"expert_load_{s}.png", s)
        for s in trained
    ]

    records = [json.loads(p.read_text()) for p in lineage_files(record)]
    own = record.build(inputs={}, outputs={})  # this stage's time so far enters the ledger
    commit = next(r["code"]["commit"] for r in records if r["stage"] == "pretrain")
    shares = {
        s: json.loads((REPORTS / f"{s}.json").read_text()).get("expert_share") for s in trained
    }
    ledger = cost_ledger(cfg, [*records, own], shares)
    ledger["by_phase"] = {
        s: phase_costs(
            [json.loads(x) for x in (MODELS / s / "metrics.jsonl").read_text().splitlines() if x]
            if (MODELS / s / "metrics.jsonl").is_file()
            else [],
            getattr(cfg, s).warmup_steps,
        )
        for s in trained
    }
    # Kept: the published archive and the models; moved: one archive download per training
    # stage and for evaluation (storage and transfer are part of the bill).
    model_bytes = sum((MODELS / s / "model.safetensors").stat().st_size for s in trained)
    archive = int(receipt.get("archive_bytes", 0))
    ledger["storage"] = storage_costs(cfg, archive + model_bytes, archive * (len(trained) + 1))
    cost_png = plot_cost(ledger, out / "cost.png")
    publish_cost_table(ledger)
    write_json(REPORTS / "cost.json", ledger)
    metrics["cost_total"] = ledger["total"]
    write_json(REPORTS / "metrics.json", metrics)
    write_json(REPORTS / "summary.json", headline(metrics, ledger))
    run_report(out / "report.md", receipt, commit, metrics, ledger, cost_png, plot, heatmaps)
    outputs = {
        "metrics": REPORTS / "metrics.json",
        "cost": REPORTS / "cost.json",
        "summary": REPORTS / "summary.json",
    }
    if cfg.evaluate.export_model and trained:  # the final model, as transformers loads it
        export = export_final(cfg, MODELS / trained[-1], EXPORT, data_dir, REPORTS)
        metrics["export"] = export
        outputs["export"] = EXPORT
        # flat, for the lineage record: what the final model became and where it lives
        metrics["model_export"] = export.get("architecture") or f"refused: {export['reason']}"
        if "published" in export:
            metrics["model_uri"] = export["published"]["uri"]
        write_json(REPORTS / "metrics.json", metrics)  # the card read it; now with the export
    return Done(
        metrics,
        outputs,
        summary={
            "cost_total": ledger["total"],
            **{f"{s}_ppl": round(metrics[s]["val"]["perplexity"], 3) for s in trained},
        },
        metrics={k: v for k, v in metrics.items() if not isinstance(v, dict)},
    )


def headline(metrics: dict[str, Any], ledger: dict[str, Any]) -> dict[str, Any]:
    """The few figures one compares across runs: what `dvc metrics show` and `dvc exp show`
    print (one row, a dozen columns). The detail stays in reports/metrics.json and cost.json."""
    out: dict[str, Any] = {}
    for s in list(Config.training_stages()):
        out[s] = {
            "ppl": round(metrics[s]["val"]["perplexity"], 3),
            "exec_acc": round(metrics[s]["sql"]["execution_accuracy"], 4),
        }
        generic = [metrics[s][k] for k in ("generic_seen", "generic_heldout") if k in metrics[s]]
        if generic:
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


def _inputs(cfg: Config) -> dict[str, Path]:
    """The trained models (the receipt they were trained on is in their own inputs); the
    published data it scores on must be what is prepared here (flows/stage.py)."""
    read_published(cfg)
    return {s: MODELS / s / "model.safetensors" for s in list(Config.training_stages())}


EVALUATE = Stage(
    "evaluate",
    "evaluate",
    "Perplexity and SQL accuracy of every stage's model, the bill and the report.",
    out=lambda cfg: REPORTS / "evaluate",
    inputs=lambda cfg: _inputs(cfg),
    handoff=lambda cfg: [
        REPORTS / "metrics.json",
        REPORTS / "cost.json",
        REPORTS / "summary.json",
        *files(REPORTS / "evaluate"),
        *files(EXPORT),
    ],
    body=_evaluate,
    done="reports/metrics.json, reports/cost.json, reports/evaluate/report.md, models/export/",
    reads=lambda cfg: [
        (PUBLISHED / "receipt.json", "publish"),
        *((MODELS / s / "model.safetensors", s) for s in list(Config.training_stages())),
    ],
)
