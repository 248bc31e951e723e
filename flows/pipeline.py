"""The pipeline flow: every stage in order.

`dispatch="local"` runs the stages as subflows in this process (the laptop driver, `moe-pipeline
run`). `dispatch="deployments"` starts each stage's deployment with `run_deployment`, so it runs
on a worker of its own pool (pools.stages), and the stages pass their outputs to each other
through the object store (tasks/handoff.py), never through a shared disk. The resolved
configuration travels as a flow parameter, so every stage runs with exactly the same params.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Literal

from prefect import flow
from prefect.runtime import flow_run

from flows.stage import REPORTS
from flows.stages import STAGE_FLOWS, Params
from moe.errors import InputError
from tasks.config import Config, load_config
from tasks.form import StageName, as_params
from tasks.pools import STAGES
from tasks.presentation import publish_pipeline_report

log = logging.getLogger("flows.pipeline")  # by name: a deployment loads this file as a script


@flow(name="pipeline", log_prints=True, validate_parameters=False)
def pipeline(
    stages: list[StageName] | None = None,
    params: Params | None = None,
    dispatch: Literal["local", "deployments"] = "local",
    handoff: str | None = None,
    params_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Run the stages in order; stops at the first failure.

    Args:
        stages: The stages to run, in pipeline order whatever the order chosen; empty: all.
        params: The whole configuration, one group per params section; empty: the params
            file's (params_file, else the project's params.yaml).
        dispatch: local runs the stages in this process; deployments runs each as a run of
            its deployment on its own pool's worker.
        handoff: With dispatch deployments, the run whose hand-offs the stages share (empty:
            this flow run's id); an earlier run's key re-runs its later stages.
        params_file: A params file on the worker (when params is empty).
        overrides: key=value changes on top of the params file, as `--set` takes them.
    """
    params = as_params(params)
    cfg = load_config(params_file, overrides or [], params)  # validate once before any stage starts
    chosen = list(stages or STAGES)
    unknown = [s for s in chosen if s not in STAGE_FLOWS]
    if unknown:
        raise InputError(f"unknown stage(s) {unknown}; stages are {', '.join(STAGES)}")
    ordered = [name for name in STAGES if name in chosen]
    if dispatch == "deployments":
        results = _dispatch(cfg, ordered, handoff or str(flow_run.get_id() or uuid.uuid4()))
        runs = {s: results[s]["flow_run_id"] for s in ordered}
    elif dispatch != "local":
        raise InputError(f"dispatch must be 'local' or 'deployments', got {dispatch!r}")
    else:
        results, runs = {}, {}
        for name in ordered:
            log.info("stage %s", name)
            state = STAGE_FLOWS[name](
                params=params, params_file=params_file, overrides=overrides or [], return_state=True
            )
            runs[name] = str(state.state_details.flow_run_id)
            results[name] = state.result()  # raises what the stage raised
    if "evaluate" in ordered:  # the run's last word in the UI: results, bill, stage runs
        publish_pipeline_report(REPORTS / "metrics.json", REPORTS / "cost.json", runs)
    return results


def _check_pools(cfg: Config, stages: list[str]) -> None:
    """Every pool the stages run on exists on the server; a pool with no worker online is
    a warning (its stages wait until one starts)."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for pool in sorted({cfg.pools.stages[s] for s in stages}):
            try:
                workers = client.read_workers_for_work_pool(pool)
            except ObjectNotFound:
                raise InputError(
                    f"work pool {pool!r} (pools.stages in params) does not exist on "
                    f"{client.api_url}: create it and start a worker (moe-pipeline stack up, "
                    "or infra/README.md)"
                ) from None
            if not any(w.status.value == "ONLINE" for w in workers):
                log.warning(
                    "no worker is online on pool %r: its stages wait until one starts "
                    "(prefect worker start --pool %s)",
                    pool,
                    pool,
                )


def _dispatch(cfg: Config, stages: list[str], run: str) -> dict[str, Any]:
    """Each stage as a run of its deployment (`<stage>/<stage>`) on its pool's worker."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    from tasks.handoff import pull_inputs

    if cfg.storage.backend == "local" and not Path(cfg.storage.root).is_absolute():
        raise InputError(
            f"storage.backend is local with a relative root ({cfg.storage.root!r}): stages on "
            "other machines cannot reach it. Set storage.backend: s3 and storage.bucket (or hf), "
            "or an absolute storage.root that every worker shares"
        )
    if cfg.pools.stages["prepare"] != cfg.pools.stages["publish"]:
        log.info("prepare and publish run on different pools: the prepared data is handed off")
    _check_pools(cfg, stages)
    params = cfg.to_dict()
    results: dict[str, Any] = {"handoff": run}
    log.info("hand-off run key %s: stages exchange outputs under runs/%s/", run, run)
    for name in stages:
        pool = cfg.pools.stages[name]
        log.info("stage %s -> deployment %s/%s on pool %s", name, name, name, pool)
        try:
            fr = run_deployment(
                f"{name}/{name}",
                parameters={"params": params, "handoff": run},
                timeout=None,
                poll_interval=1,
            )
        except ObjectNotFound:
            raise InputError(
                f"deployment {name}/{name} does not exist: deploy prefect.yaml "
                "(prefect deploy --all, or moe-pipeline stack up)"
            ) from None
        if fr.state is not None and fr.state.is_crashed() and cfg.recovery.enabled:
            # Its machine vanished: the RECOVER automation runs the stage again (flows/
            # recovery.py); wait for that run instead of failing the pipeline.
            from flows.recovery import RECOVERY_WAIT_S, follow

            with get_client(sync_client=True) as client:
                fr = follow(client, fr, wait_s=RECOVERY_WAIT_S)
        state = fr.state
        if state is None or not state.is_completed():
            recovery = ""
            if state is not None and state.is_crashed() and cfg.recovery.enabled:
                from flows.recovery import GAVE_UP, RECOVERY_WAIT_S

                recovery = (
                    " Recovery gave up on it (the recover flow run's log says why: "
                    "recovery.max_attempts, or recovery.max_stalled attempts in a row that got "
                    "no further)."
                    if GAVE_UP in fr.tags
                    else f" No recovery run started within {RECOVERY_WAIT_S} s: are the recovery "
                    "automations "
                    "on this server (moe-pipeline recovery install) and a cpu worker up?"
                )
            raise RuntimeError(
                f"stage {name} (flow run {fr.id} on pool {pool}) ended "
                f"{state.name if state else 'without a state'}: "
                f"{(state.message if state else '') or 'see its logs in the Prefect UI'}."
                f"{recovery} Fix it and re-run the pipeline with handoff={run!r} and the stages from "
                f"{name} on: they fetch the finished stages' hand-offs, and training resumes "
                "from its newest checkpoint on the pool's disk"
            )
        results[name] = {"flow_run_id": str(fr.id), "pool": pool, "state": state.name}
    if "evaluate" in stages:  # the report where the pipeline runs, too
        pull_inputs(cfg, "report", run, upto=["evaluate"])
    return results
