"""The pipeline's stages: one declaration each, one wrapper for all, one Prefect flow each.

A stage is the unit that runs on one work pool. Its declaration (`Stage`, in `STAGE_LIST`)
says everything the rest of the code needs: its name and params section, its folder, the
content-hashed inputs its skip decision and lineage record read, the files later stages on
other machines read (the hand-off), what the CLI says when it is done, whether it trains
(a W&B run, the cost budget), and its body. `run_stage` does, for every stage: load and
validate the params (and, under `dispatch: deployments`, fetch the earlier stages'
hand-offs), skip the stage if nothing it depends on changed, run the body, write the lineage
record with its cost, publish the summary artifact, hand the outputs off.

Each stage's body and declaration live in its own module of flows/bodies/ (the vocabulary
they share: flows/stage.py), so a stage's code is a file DVC can list as that stage's dep.

Adding a stage: its name and default pool in `tasks/pools.py` DEFAULT_STAGE_POOLS (the one
stage list, in pipeline order), its declaration and body in flows/bodies/ (named here), a
`dvc.yaml` stage and a `prefect.yaml` deployment. This module refuses to load while a listed
stage has no declaration, and tests/test_deployments.py checks dvc.yaml and prefect.yaml
against the list.

Stages hand data to each other through the object store (publish uploads, training stages
download and verify) and through model folders; each writes `lineage.json` beside its
outputs. Every flow takes the params file and `--set` overrides, validates them before any
work, and saves the resolved configuration beside its outputs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path
from typing import Any

from prefect import flow

import tasks
from flows.bodies.evaluate import EVALUATE
from flows.bodies.finetune import FINETUNE_DOMAIN, FINETUNE_SQL
from flows.bodies.prepare import PREPARE
from flows.bodies.pretrain import PRETRAIN
from flows.bodies.publish import PUBLISH
from flows.stage import REPORTS, Done, Stage, log
from moe.errors import InputError
from tasks import quiet_input_errors
from tasks.config import Config, load_config
from tasks.events import STAGE_COMPLETED, emit
from tasks.form import as_params, config_model
from tasks.handoff import pull_inputs, push_outputs
from tasks.lineage import StageRecord, dvc_stage, up_to_date
from tasks.pools import STAGES
from tasks.presentation import publish_artifacts

quiet_input_errors()  # bad input that reaches a flow: one line in its log, no traceback
# A deployment loads this file as a script, without the flows package: its defaults here too.
tasks.offline_defaults()
__all__ = ["REPORTS", "Done", "Stage", "StageRecord"]  # what a stage declared here uses

# Each stage's declaration (its body module's), in the one stage list's order (tasks/pools.py).
_DECLARED = {
    s.name: s for s in (PREPARE, PUBLISH, PRETRAIN, FINETUNE_SQL, FINETUNE_DOMAIN, EVALUATE)
}
if set(_DECLARED) != set(STAGES):
    raise RuntimeError(
        f"flows/stages.py declares the stages {sorted(_DECLARED)}; tasks/pools.py "
        f"DEFAULT_STAGE_POOLS lists {sorted(STAGES)}: declare each listed stage once"
    )
STAGE_LIST: list[Stage] = [_DECLARED[name] for name in STAGES]
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


def return_freed_memory() -> bool:
    """Hand the memory a finished stage freed back to the system. `moe-pipeline run` runs
    every stage in one process, and glibc keeps freed heap pages for reuse: a training stage
    frees gigabytes of tensors in pieces below its mmap threshold, and the process went on
    holding them (7.2 GB of SmolLM2's 8.2 GB peak between its two finetune stages; 0.5 GB
    after this, bench/RESULTS.md). That memory is then free for the other processes of the
    machine (another run, a scorer) while this one waits or loads. The next stage's own peak
    is not lowered: glibc would have reused those pages. `malloc_trim(0)` releases every free
    page of every arena. False where the C library has no malloc_trim (musl, macOS)."""
    gc.collect()
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return False
    trim(0)
    return True


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
    earlier = STAGE_LIST[: STAGE_LIST.index(STAGES_BY_NAME[stage.name])]
    upstream = [s.out(cfg) / "lineage.json" for s in earlier]
    record = StageRecord(cfg, stage.name, stage.out(cfg), upstream)
    made = stage.body(cfg, record)
    return_freed_memory()
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


if [s.name for s in STAGE_LIST if s.trains] != list(Config.training_stages()):
    raise RuntimeError(
        f"flows/stages.py: the stages that train {[s.name for s in STAGE_LIST if s.trains]} must be"
        f" tasks.config's training stages {list(Config.training_stages())} (evaluate reads them)"
    )
# The configuration as a typed parameter: the form the Prefect UI renders (tasks/form.py),
# with the project's params.yaml as its defaults, as are the deployments' descriptions.
_FORM_CONFIG = _form_config()
Params = config_model(_FORM_CONFIG)
STAGE_FLOWS = {s.name: _stage_flow(s) for s in STAGE_LIST}
# Module-level names, as prefect.yaml's entrypoints (flows/stages.py:<stage>) look them up.
globals().update(STAGE_FLOWS)
