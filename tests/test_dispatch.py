"""The pipeline under `dispatch: deployments` on a real Prefect server: what the run form sends
(the typed `params`, and `overrides`) reaches the run of every stage's deployment.

No worker runs the stage runs here: their deployments sit on a paused work queue of their pool,
and the test plays the worker, reading each stage run's parameters as the server holds them
(what a worker would start the stage with) and marking the run completed, so the pipeline goes
on to the next stage without training anything. The stages themselves under a real worker run
in tests/test_stack.py."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tasks.config import load_config
from tasks.pools import STAGES

QUEUE = "dispatch-test"  # paused: a worker on the pool never starts these runs


@pytest.fixture
def api(prefect_server: dict[str, str]) -> Iterator[str]:
    """The fixture's server as this process's Prefect API (flows run here report to it)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        yield prefect_server["PREFECT_API_URL"]


def _stage_deployments(client: Any, cfg: Any, created: list[str]) -> dict[Any, str]:
    """`<stage>/<stage>` on the stage's pool (created where missing, and named in `created`
    so that the test removes it: the server is shared with other files' tests, which create
    these pools with their own types), on a paused queue; returns the deployment ids'
    stages."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    deployments = {}
    for stage in STAGES:
        pool = cfg.pools.stages[stage]
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            created.append(pool)
        except ObjectAlreadyExists:
            pass
        try:
            client.create_work_queue(name=QUEUE, work_pool_name=pool, is_paused=True)
        except ObjectAlreadyExists:
            pass
        queue = client.read_work_queue_by_name(QUEUE, work_pool_name=pool)
        client.update_work_queue(queue.id, is_paused=True)
        dep = client.create_deployment(
            flow_id=client.create_flow_from_name(stage),
            name=stage,
            work_pool_name=pool,
            work_queue_name=QUEUE,
            entrypoint=f"flows/stages.py:{stage}",
            parameters={},  # no defaults of another test's: what a run gets is what was sent
            tags=[],
        )
        deployments[dep] = stage
    return deployments


def test_the_run_forms_values_reach_every_stage_run(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Completed, Failed

    from flows.pipeline import pipeline
    from flows.stages import Params
    from tasks.handoff import push_outputs

    monkeypatch.chdir(tmp_path)  # where the pipeline fetches the evaluate stage's hand-off
    form = Params()  # the form as the UI opens it (params.yaml's values), then changed
    form.pretrain.lr = 1.234e-3
    form.finetune_sql.max_steps = 7
    form.storage.root = str(tmp_path / "store")  # shared by every "machine" here
    sent = form.model_dump(mode="json")  # what the UI sends for the pipeline's run
    overrides = ["evaluate.max_examples=3"]
    cfg = load_config(None, overrides, sent)
    default = load_config()
    assert (cfg.pretrain.lr, cfg.finetune_sql.max_steps, cfg.evaluate.max_examples) != (
        default.pretrain.lr,
        default.finetune_sql.max_steps,
        default.evaluate.max_examples,
    )
    key = f"dispatch-{uuid.uuid4().hex[:12]}"  # the hand-off run key: this test's runs
    created: list[str] = []

    def remove_pools() -> None:
        with SyncPrefectClient(api) as client:
            for pool in created:
                client.delete_work_pool(pool)

    request.addfinalizer(remove_pools)
    with SyncPrefectClient(api) as client:
        deployments = _stage_deployments(client, cfg, created)

    received: dict[str, dict[str, Any]] = {}
    stop, failed = threading.Event(), []

    def play_the_worker() -> None:
        """Each of this pipeline's stage runs, once scheduled: its parameters kept, then
        completed (evaluate: with its hand-off in the store, as a finished evaluate leaves
        it). Whatever goes wrong here fails that run, so the pipeline stops, never waits."""
        scheduled = FlowRunFilter(
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED]))
        )
        ours = DeploymentFilter(id=DeploymentFilterId(any_=list(deployments)))
        with SyncPrefectClient(api) as c:
            while not stop.is_set():
                try:
                    runs = c.read_flow_runs(flow_run_filter=scheduled, deployment_filter=ours)
                except Exception as e:  # noqa: BLE001 - reported by the test, tried again
                    failed.append(e)
                    runs = []
                for fr in runs:
                    if fr.parameters.get("handoff") != key:
                        continue
                    try:
                        stage = deployments[fr.deployment_id]
                        received[stage] = fr.parameters
                        if stage == "evaluate":
                            push_outputs.fn(cfg, stage, key, [])
                        c.set_flow_run_state(fr.id, Completed(), force=True)
                    except Exception as e:  # noqa: BLE001 - the run fails: the pipeline stops
                        failed.append(e)
                        c.set_flow_run_state(fr.id, Failed(message=repr(e)), force=True)
                stop.wait(0.2)

    worker = threading.Thread(target=play_the_worker, daemon=True)
    worker.start()
    try:
        result = pipeline(params=sent, overrides=overrides, dispatch="deployments", handoff=key)
    finally:
        stop.set()
        worker.join(timeout=30)
    assert not failed, failed
    assert list(received) == list(STAGES)  # each stage once, in pipeline order
    want = {"params": cfg.to_dict(), "handoff": key}
    for stage in STAGES:
        got = received[stage]
        assert sorted(got) == ["handoff", "params"], f"stage {stage} was sent {sorted(got)}"
        p = got["params"]
        changed = (
            p["pretrain"]["lr"],
            p["finetune_sql"]["max_steps"],
            p["evaluate"]["max_examples"],
        )
        assert changed == (1.234e-3, 7, 3), stage  # the form's two values, the override's one
        assert got == want, stage  # the whole resolved configuration, nothing else
        assert result[stage]["state"] == "Completed"
        assert result[stage]["pool"] == cfg.pools.stages[stage]
