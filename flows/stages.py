"""The pipeline's stages: one declaration each, one wrapper for all, one Prefect flow each.

A stage is the unit that runs on one work pool. Its declaration (`Stage`, in `STAGE_LIST`)
says everything the rest of the code needs: its name and params section, its folder, the
content-hashed inputs its skip decision and lineage record read, the files later stages on
other machines read (the hand-off), what the CLI says when it is done, whether it trains
(a W&B run, the cost budget), and its body. `run_stage` does, for every stage: load and
validate the params (and, under `dispatch: deployments`, fetch the earlier stages'
hand-offs), skip the stage if nothing it depends on changed, run the body, write the lineage
record with its cost, publish the summary artifact, hand the outputs off.

Adding a stage: one `Stage(...)` in STAGE_LIST and its body; then its name and default pool
in `tasks.config.DEFAULT_STAGE_POOLS` (the params check reads it), a `dvc.yaml` stage and a
`prefect.yaml` deployment. This module refuses to load while that table disagrees, and
tests/test_deployments.py checks dvc.yaml and prefect.yaml against STAGE_LIST.

Stages hand data to each other through the object store (publish uploads, training stages
download and verify) and through model folders; each writes `lineage.json` beside its
outputs. Every flow takes the params file and `--set` overrides, validates them before any
work, and saves the resolved configuration beside its outputs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow

import tasks
from moe.errors import InputError
from tasks import quiet_input_errors
from tasks.config import STAGES, Config, load_config
from tasks.cost import cost_ledger, phase_costs, storage_costs
from tasks.data import build_sql_sets, build_tokenizer, commit_folder, tokenize_corpus
from tasks.evaluation import evaluate_perplexity, evaluate_sql
from tasks.events import STAGE_COMPLETED, emit
from tasks.form import as_params, config_model
from tasks.handoff import pull_inputs, push_outputs
from tasks.lineage import StageRecord, dvc_stage, up_to_date, write_json
from tasks.presentation import (
    plot_cost,
    plot_expert_load,
    plot_training,
    publish_artifacts,
    publish_cost_table,
    run_report,
)
from tasks.publish import export_final
from tasks.storage import download_dataset, open_store, publish_dataset
from tasks.tracking import wandb_run
from tasks.training import finetune_model, pretrain_model

log = logging.getLogger("flows.stages")  # by name: a deployment loads this file as a script
quiet_input_errors()  # bad input that reaches a flow: one line in its log, no traceback
# A deployment loads this file as a script, without the flows package: its defaults here too.
tasks.offline_defaults()

PUBLISHED = Path("data/published")
MODELS = Path("models")
REPORTS = Path("reports")
EXPORT = MODELS / "export"  # the final model as a Hugging Face folder (evaluate.export_model)


# ------------------------------------------------------------------------- declarations


@dataclass
class Done:
    """What a stage's body made. `result` is what the flow returns; `summary` goes to the
    Prefect artifact and `metrics` to the lineage record (both default to `result`)."""

    result: dict[str, Any]
    outputs: dict[str, Path]
    summary: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    wandb_run_id: str | None = None
    compute_s: float | None = None


@dataclass(frozen=True)
class Stage:
    name: str
    section: str  # the params section with its settings
    doc: str  # one line: what it does (the flow's description)
    out: Callable[[Config], Path]  # its folder: lineage.json lands there
    inputs: Callable[[Config], dict[str, Path]]  # content-hashed; raises if one is missing
    handoff: Callable[[Config], list[Path]]  # the files later stages (or the user) read
    body: Callable[[Config, StageRecord], Done]
    done: str  # what `moe-pipeline stage` prints when it is done
    # what it reads that an earlier stage makes: (file, that stage); `moe-pipeline` checks
    # them before a run starts (flows/cli.py preflight)
    reads: Callable[[Config], list[tuple[Path, str]]] = field(default=lambda cfg: [])
    trains: bool = False  # a training stage: its model is evaluated and has a cost budget
    # an extra condition for skipping (publish: its objects are still in the store)
    still_there: Callable[[Config], bool] = field(default=lambda cfg: True)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else []


def _receipt() -> dict[str, Any]:
    path = PUBLISHED / "receipt.json"
    if not path.is_file():
        raise InputError(
            f"{path} is missing: run the publish stage first (moe-pipeline stage publish)"
        )
    return json.loads(path.read_text())


# ------------------------------------------------------------------------- prepare


def _corpus(cfg: Config) -> dict[str, Path]:
    """The corpus and the user's SQL files (databases, pairs, a Spider/BIRD folder) as
    content-hashed inputs, where they are local files or folders (the stdlib corpus is
    identified by the Python version, a hub dataset by its id, in the params hash): editing
    one in place re-runs prepare."""
    d = cfg.data
    named = {
        "corpus": d.source if d.source != "stdlib" else "",
        "sql_generic_source": d.sql_generic_source if d.sql_generic_source != "generated" else "",
        "sql_domain_database": d.sql_domain_database,
        "sql_domain_pairs": d.sql_domain_pairs,
        "sql_domain_test": d.sql_domain_test,
        "tokenizer": cfg.tokenizer.path,  # model.init's own tokenizer, or one the user named
    }
    out = {}
    for key, value in named.items():
        path = Path(value).expanduser() if value else None
        if path is not None and path.exists():
            out[key] = path
    return out


def _prepare(cfg: Config, record: StageRecord) -> Done:
    """Tokenize the corpus into memmap token files and generate the SQL pair sets (CPU)."""
    out = Path(cfg.data.out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tok = build_tokenizer(cfg, tmp)
        # the SQL pairs first: each is executed and fitted before the corpus is tokenized
        sql = build_sql_sets(cfg, tmp, tok)
        meta = tokenize_corpus(cfg, tmp, tok)
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
        **{f"sql_{k}": v for k, v in sql["counts"].items()},
        "sql_skipped_records": sql["skipped_records"],
    }
    return Done(summary, {"prepared": out})


def _prepared_handoff(cfg: Config) -> list[Path]:
    prepared = Path(cfg.data.out_dir)
    if cfg.pools.stages["publish"] == cfg.pools.stages["prepare"]:
        # publish runs on the same pool's disk: only the records travel
        names = ["lineage.json", "params.yaml", "meta.json"]
        return [prepared / n for n in names if (prepared / n).is_file()]
    return _files(prepared)  # publish runs elsewhere: it needs the whole prepared folder


# ------------------------------------------------------------------------- publish


def _prepared(cfg: Config) -> dict[str, Path]:
    prepared = Path(cfg.data.out_dir)
    if not (prepared / "meta.json").is_file():
        raise InputError(
            f"{prepared}/meta.json is missing: run the prepare stage first (moe-pipeline stage prepare)"
        )
    return {"prepared": prepared}


def _in_store(cfg: Config) -> bool:
    """An emptied bucket (or another one) needs a new upload."""
    receipt = json.loads((PUBLISHED / "receipt.json").read_text())
    store = open_store(cfg.storage)
    return all(store.exists(receipt[k]) for k in ("manifest_key", "archive_key"))


def _publish(cfg: Config, record: StageRecord) -> Done:
    """Archive the prepared data with zstd and upload it with a sha256 manifest (CPU)."""
    work = Path(".cache/publish")
    published = publish_dataset(cfg, Path(cfg.data.out_dir), work)
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
    return Done(published.to_dict(), {"receipt": PUBLISHED / "receipt.json"})


# ------------------------------------------------------------------------- training


def _train_summary(stage: str, result: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"stage": stage, **asdict(result), **(extra or {})}


def _published(cfg: Config) -> dict[str, Path]:
    _receipt()  # a missing receipt says which stage to run
    return {"receipt": PUBLISHED / "receipt.json"}


def _pretrain_inputs(cfg: Config) -> dict[str, Path]:
    """The published data and, with model.init, the imported checkpoint (every file of the
    folder content-hashed: the lineage names the weights it started from)."""
    out = _published(cfg)
    if cfg.model.init:
        out["init"] = Path(cfg.model.init)
    return out


def _pretrain(cfg: Config, record: StageRecord) -> Done:
    """Download and verify the published data, then pretrain the MoE model (GPU)."""
    receipt, out = _receipt(), MODELS / "pretrain"
    data_dir = download_dataset(cfg, receipt)
    with wandb_run(cfg, "pretrain") as (log_fn, run_id):
        result = pretrain_model(
            cfg, data_dir, out, log_fn, _budget_left(cfg, "pretrain"), receipt=receipt
        )
    summary = _train_summary("pretrain", result, {"dataset_version": receipt["version"]})
    write_json(REPORTS / "pretrain.json", summary)
    return Done(summary, {"model": out / "model.safetensors"}, None, None, run_id, result.wall_s)


def _finetune_inputs(stage: str, init: str) -> Callable[[Config], dict[str, Path]]:
    def inputs(cfg: Config) -> dict[str, Path]:
        model = MODELS / init / "model.safetensors"
        _receipt()
        if not model.is_file():
            raise InputError(f"{model} is missing: run the {init} stage first")
        return {"receipt": PUBLISHED / "receipt.json", "init_model": model}

    return inputs


def _finetune(stage: str, pairs_file: str, init: str) -> Callable[[Config, StageRecord], Done]:
    def body(cfg: Config, record: StageRecord) -> Done:
        receipt, out = _receipt(), MODELS / stage
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
                _budget_left(cfg, stage),
                receipt=receipt,
            )
        summary = _train_summary(stage, result)
        write_json(REPORTS / f"{stage}.json", summary)
        return Done(
            summary, {"model": out / "model.safetensors"}, None, None, run_id, result.wall_s
        )

    return body


def _model_handoff(stage: str) -> Callable[[Config], list[Path]]:
    """A training stage's model folder without its checkpoints (they stay on the pool's disk
    and, with checkpoint.offload, in the object store's checkpoint area), and its summary."""

    def files(cfg: Config) -> list[Path]:
        models = [p for p in _files(MODELS / stage) if "checkpoints" not in p.parts[2:]]
        return [*models, REPORTS / f"{stage}.json"]

    return files


# ------------------------------------------------------------------------- evaluate


def _trained() -> list[str]:
    return [s.name for s in STAGE_LIST if s.trains]


def _evaluate(cfg: Config, record: StageRecord) -> Done:
    """Perplexity and SQL accuracy of every stage's model, the bill and the report."""
    receipt, out, trained = _receipt(), REPORTS / "evaluate", _trained()
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

    records = [json.loads(p.read_text()) for p in _lineage_files(cfg, "evaluate")]
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
            getattr(cfg, STAGES_BY_NAME[s].section).warmup_steps,
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
    for s in _trained():
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


# ------------------------------------------------------------------------- the stages


def _finetune_stage(name: str, doc: str, pairs_file: str, init: str) -> Stage:
    """A finetune stage: `pairs_file` from the model of stage `init`, settings in `name`."""
    return Stage(
        name,
        name,
        doc,
        out=lambda cfg: MODELS / name,
        inputs=_finetune_inputs(name, init),
        handoff=_model_handoff(name),
        body=_finetune(name, pairs_file, init),
        done=f"models/{name}/ (metrics: reports/{name}.json)",
        reads=lambda cfg: [
            (PUBLISHED / "receipt.json", "publish"),
            (MODELS / init / "model.safetensors", init),
        ],
        trains=True,
    )


STAGE_LIST: list[Stage] = [
    Stage(
        "prepare",
        "data",
        "Tokenize the corpus into memmap token files and generate the SQL pair sets (CPU).",
        out=lambda cfg: Path(cfg.data.out_dir),
        inputs=_corpus,
        handoff=_prepared_handoff,
        body=_prepare,
        done="data/prepared/",
    ),
    Stage(
        "publish",
        "storage",
        "Archive the prepared data with zstd and upload it with a sha256 manifest (CPU).",
        out=lambda cfg: PUBLISHED,
        inputs=_prepared,
        handoff=lambda cfg: _files(PUBLISHED),
        body=_publish,
        done="data/published/receipt.json",
        reads=lambda cfg: [(Path(cfg.data.out_dir) / "meta.json", "prepare")],
        still_there=_in_store,
    ),
    Stage(
        "pretrain",
        "pretrain",
        "Download and verify the published data, then pretrain the MoE model (GPU).",
        out=lambda cfg: MODELS / "pretrain",
        inputs=_pretrain_inputs,
        handoff=_model_handoff("pretrain"),
        body=_pretrain,
        done="models/pretrain/ (metrics: reports/pretrain.json)",
        reads=lambda cfg: [(PUBLISHED / "receipt.json", "publish")],
        trains=True,
    ),
    _finetune_stage(
        "finetune_sql",
        "Stage one of finetuning: the generic SQL pairs, from the pretrained model (GPU).",
        "generic.jsonl",
        "pretrain",
    ),
    _finetune_stage(
        "finetune_domain",
        "Stage two of finetuning: the target-domain pairs, from the SQL model (GPU).",
        "domain_train.jsonl",
        "finetune_sql",
    ),
    Stage(
        "evaluate",
        "evaluate",
        "Perplexity and SQL accuracy of every stage's model, the bill and the report.",
        out=lambda cfg: REPORTS / "evaluate",
        inputs=lambda cfg: {s: MODELS / s / "model.safetensors" for s in _trained()},
        handoff=lambda cfg: [
            REPORTS / "metrics.json",
            REPORTS / "cost.json",
            REPORTS / "summary.json",
            *_files(REPORTS / "evaluate"),
            *_files(EXPORT),
        ],
        body=_evaluate,
        done="reports/metrics.json, reports/cost.json, reports/evaluate/report.md, models/export/",
        reads=lambda cfg: [
            (PUBLISHED / "receipt.json", "publish"),
            *((MODELS / s / "model.safetensors", s) for s in _trained()),
        ],
    ),
]
STAGES_BY_NAME = {s.name: s for s in STAGE_LIST}


# ------------------------------------------------------------------------- the wrapper


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
    earlier = [s.name for s in STAGE_LIST[: STAGE_LIST.index(STAGES_BY_NAME[stage])]]
    if handoff and earlier:
        pull_inputs(cfg, stage, handoff, earlier)
    return cfg


def _hand_off(cfg: Config, stage: Stage, handoff: str | None) -> None:
    if handoff:
        push_outputs(cfg, stage.name, handoff, stage.handoff(cfg))


def _skipped(
    cfg: Config, stage: Stage, inputs: dict[str, Path], handoff: str | None
) -> dict[str, Any] | None:
    """The stage's last summary if its params, code and inputs are unchanged since it ran and
    its outputs are intact (tasks/lineage.py:up_to_date): the stage is skipped and says so.
    MOE_FORCE=1 runs it anyway (`moe-pipeline stage|run --force`)."""
    if os.environ.get("MOE_FORCE", "") not in ("", "0"):
        return None
    rec = up_to_date(cfg, stage.name, stage.out(cfg), inputs, stage.handoff(cfg))
    if rec is None or not stage.still_there(cfg):
        return None
    log.info(
        "stage %s skipped: its params, code and inputs (%s) are unchanged since its run that "
        "ended %s (flow run %s); its outputs in %s are kept (MOE_FORCE=1 runs it anyway)",
        stage.name,
        ", ".join(inputs) or "none",
        rec.get("ended"),
        rec.get("flow_run_id"),
        stage.out(cfg),
    )
    publish_artifacts(stage.name, {"skipped": True, "unchanged_since": rec.get("ended")})
    _hand_off(cfg, stage, handoff)
    return {**rec.get("metrics", {}), "skipped": True}


def run_stage(
    stage: Stage,
    params_file: str | None = None,
    overrides: list[str] | None = None,
    params: dict[str, Any] | None = None,
    handoff: str | None = None,
) -> dict[str, Any]:
    """Load, skip if unchanged, run the body, record lineage and cost, publish, hand off."""
    cfg = _load(stage.name, params_file, overrides, params, handoff)
    inputs = stage.inputs(cfg)
    if (done := _skipped(cfg, stage, inputs, handoff)) is not None:
        return done
    record = StageRecord(cfg, stage.name, stage.out(cfg))
    made = stage.body(cfg, record)
    written = record.write(
        inputs=inputs,
        outputs=made.outputs,
        metrics=made.result if made.metrics is None else made.metrics,
        wandb_run_id=made.wandb_run_id,
        compute_s=made.compute_s,
    )
    summary = made.result if made.summary is None else made.summary
    publish_artifacts(stage.name, summary)
    _hand_off(cfg, stage, handoff)
    figures = {k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))}
    emit(
        STAGE_COMPLETED,
        cfg,
        stage.name,
        f"stage {stage.name} completed on pool {written['pool']} for "
        f"{written['cost']:.4f} {cfg.cost.currency}",
        written["cost"],
        wall_s=written.get("wall_s"),
        figures=figures,
        interruptions=(written.get("interruptions") or {}).get("count", 0),
    )
    return made.result


def _budget_left(cfg: Config, stage: str) -> float:
    """What is left of cost.budget for `stage`: the budget minus what the stages before it
    cost by their lineage records (0 = no budget)."""
    if cfg.cost.budget <= 0:
        return 0.0
    spent = 0.0
    for p in _lineage_files(cfg, stage, missing_ok=True):
        spent += float(json.loads(p.read_text()).get("cost", 0.0))
    left = cfg.cost.budget - spent
    if left <= 0:
        log.warning(
            "cost.budget %.4f is already spent (%.4f) before %s", cfg.cost.budget, spent, stage
        )
    return max(left, 1e-9)


def _lineage_files(cfg: Config, before: str, missing_ok: bool = False) -> list[Path]:
    """The lineage records of every stage before `before` (what the bill sums)."""
    upstream = STAGE_LIST[: STAGE_LIST.index(STAGES_BY_NAME[before])]
    paths = [s.out(cfg) / "lineage.json" for s in upstream]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing_ok:
        return [p for p in paths if p.is_file()]
    if missing:
        raise InputError(
            f"lineage records missing: {', '.join(missing)}; run the earlier stages first"
        )
    return paths


# ------------------------------------------------------------------------- the flows


def describe(stage: Stage, cfg: Config) -> str:
    """What a run of the stage does, for its flow and deployment (the UI's deployment page):
    what it is, the pool it runs on, what it reads and writes, the params it uses. Derived
    from the stage's declaration and its dvc.yaml entry, never written twice."""
    pool, spec = cfg.pool_of(stage.name)
    machine = "no such pool defined"
    if spec is not None:
        kind = f"{spec.gpus} x {spec.gpu}" if spec.gpus else "CPU only"
        price = f"{spec.rate:.2f} {cfg.cost.currency}/h" + (
            " spot" if spec.pricing == "spot" else ""
        )
        machine = f"{kind}, {price}"
    if stage.name == "prepare":
        reads = [f"the corpus (data.source: {cfg.data.source})"]
    else:
        reads = [f"{path} (from {src})" for path, src in stage.reads(cfg)]
    entry = dvc_stage(stage.name)
    outs = [next(iter(o)) if isinstance(o, dict) else str(o) for o in entry.get("outs") or []]
    params = entry.get("params") or [stage.section]
    return "\n".join(
        [
            stage.doc,
            "",
            f"Pool: {pool} ({machine}); pools.stages.{stage.name} moves it.",
            f"Reads: {'; '.join(dict.fromkeys(reads)) or 'nothing of an earlier stage'}.",
            f"Writes: {', '.join(outs) or stage.out(cfg).as_posix()}.",
            f"Params: {', '.join(str(p) for p in params)}.",
        ]
    )


def _form_config() -> Config:
    """The project's configuration as the form and the descriptions show it (the embedded
    default where params.yaml is missing or invalid: the run reports that, not the import)."""
    try:
        return load_config()
    except InputError:
        return Config()


def _stage_flow(stage: Stage) -> Any:
    """The Prefect flow of a stage. Every stage flow takes the same parameters: `params`, the
    whole configuration (the UI's form; the pipeline sends its resolved one), or a params
    file and `--set` overrides (the CLI and dvc.yaml); and `handoff`, the run key under which
    stages on different machines pass their outputs through the object store
    (flows/pipeline.py)."""

    def run(
        params: Params | None = None,
        handoff: str | None = None,
        params_file: str | None = None,
        overrides: list[str] | None = None,
    ) -> dict[str, Any]:
        return run_stage(stage, params_file, overrides, as_params(params), handoff)

    run.__name__ = run.__qualname__ = stage.name
    run.__doc__ = f"""{stage.doc}

    Args:
        params: The whole configuration, one group per params section; empty: the
            params file's (params_file, else the project's params.yaml).
        handoff: The run key whose hand-offs in the object store this stage reads and
            writes (the pipeline run's id; empty: a stage run on its own).
        params_file: A params file on the worker (when params is empty).
        overrides: key=value changes on top of the params file, as `--set` takes them.
    """
    return flow(
        name=stage.name,
        description=describe(stage, _FORM_CONFIG),
        log_prints=True,
        validate_parameters=False,
    )(run)


if [s.name for s in STAGE_LIST] != list(STAGES):
    raise RuntimeError(
        f"flows/stages.py STAGE_LIST {[s.name for s in STAGE_LIST]} and "
        f"tasks.config.DEFAULT_STAGE_POOLS {list(STAGES)} must name the same stages in the same order"
    )
# The configuration as a typed parameter: the form the Prefect UI renders (tasks/form.py),
# with the project's params.yaml as its defaults, as are the deployments' descriptions.
_FORM_CONFIG = _form_config()
Params = config_model(_FORM_CONFIG)
STAGE_FLOWS = {s.name: _stage_flow(s) for s in STAGE_LIST}
# Module-level names, as prefect.yaml's entrypoints (flows/stages.py:<stage>) look them up.
globals().update(STAGE_FLOWS)
