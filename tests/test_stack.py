"""The local stack (flows/stack.py): a real Prefect server, a moto S3 server, one process
worker per pool, the deployments of prefect.yaml. The pipeline deployment runs every stage on
its own pool's worker, each in its own working folder, handing data over through S3; a machine
lost twice in the middle of pretraining is noticed and recovered by Prefect automations with
no human action, the pipeline completing with the weights of an uninterrupted run; `stack
down` leaves no process behind."""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from flows import stack, stack_processes, stack_server
from tasks.config import load_config
from tasks.pools import STAGES
from tests.conftest import browse, stack_copy, ui_settings

pytestmark = [pytest.mark.stack, pytest.mark.slow]

PLANTED = {
    "HF_TOKEN": "hf_StackPlanted0Secret4f",
    "WANDB_API_KEY": "stack-planted-wandb-93ab17",
    "AWS_SESSION_TOKEN": "stack-planted-session-6c2d",
}


@contextlib.contextmanager
def _stack_project(root: Path) -> Iterator[Path]:
    """A copy of the project's code in `root`, committed to git, with a stack up (the planted
    secrets in its environment); the stack is stopped afterwards."""
    # a lost machine is noticed after two missed heartbeats (30 s each), recovered at once
    stack_copy(root, recovery={"crashed_after_s": 60, "backoff_s": 1.0})
    saved = {k: os.environ.get(k) for k in PLANTED}
    os.environ.update(PLANTED)
    try:
        stack.up(root, ui=True, say=lambda m: None)  # workers poll as a user's do
        yield root
    finally:
        stack.down(root, say=lambda m: None)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The stack the module's tests share (its S3 lives in moto's memory: nothing here may
    stop it before the module ends). Its end is a test too: `stack down` stops exactly what
    `up` started (a failure there is an error at the module's teardown)."""
    with _stack_project(tmp_path_factory.mktemp("stack-project")) as r:
        yield r
        _down_stops_exactly_what_up_started(r)


def test_the_ui_reaches_its_own_api_and_lists_the_deployments(
    root: Path, chromium: str, tmp_path: Path
) -> None:
    """The link `stack up` prints opens a UI that talks to this stack's server (not the
    default port 4200) and lists every deployment of prefect.yaml."""
    state = stack_processes.load_state(root)
    ui = stack.status(root)["ui_url"]
    assert ui == state["api_url"].removesuffix("/api")
    assert ui_settings(ui)["api_url"] == state["api_url"]
    wanted = [*STAGES, "pipeline"]
    for attempt in range(5):  # the page renders after its API calls return
        dom = browse(chromium, f"{ui}/deployments", tmp_path / f"profile{attempt}")
        assert "Can't connect" not in dom and "Create a deployment to get started" not in dom
        if all(f">{name}<" in dom for name in wanted):
            break
    missing = [name for name in wanted if f">{name}<" not in dom]
    assert not missing, f"the deployments page does not list {missing}"


def test_the_run_form_shows_every_section_and_refuses_what_the_config_refuses(
    root: Path, chromium: str
) -> None:
    """The pipeline deployment's custom-run page: a group per params section with its
    fields' descriptions; lr 0 is refused by the form (the schema's range) and no run is
    created; each stage deployment says what it does, on which pool, reading and writing
    what, from which params (its description, derived from the stage declarations)."""
    from flows.stages import STAGE_LIST, describe

    before = {r.id for r in _runs_of_pipeline(root)}
    with _run_form(root, chromium, "pipeline") as page:
        body = page.inner_text("body")
        for section in ("Data", "Model", "Moe", "Pretrain", "Finetune Sql", "Checkpoint", "Pools"):
            assert section in body, section
        assert "peak learning rate (AdamW)" in body and "the pool pretrain runs on" in body
        lr = _field(page, "peak learning rate (AdamW)")  # pretrain.lr
        assert float(lr.input_value()) == load_config(root / "params.yaml").pretrain.lr
        lr.fill("0")
        page.get_by_role("button", name="Submit").click()
        page.wait_for_selector("text=params.pretrain.lr", timeout=30_000)
        assert "Validation failed for field 'params.pretrain.lr'" in page.inner_text("body")
    assert {r.id for r in _runs_of_pipeline(root)} == before
    cfg = load_config(root / "params.yaml")
    with _client(root) as c:
        for stage in STAGE_LIST:
            dep = c.read_deployment_by_name(f"{stage.name}/{stage.name}")
            assert dep.description == describe(stage, cfg), stage.name
            assert f"Pool: {cfg.pools.stages[stage.name]} " in dep.description


def _client(root: Path) -> Any:
    return stack_server.api_client(stack_processes.load_state(root))


def _s3(root: Path) -> tuple[Any, str]:
    state = stack_processes.load_state(root)
    return stack_server.s3_client(state), state["bucket"]


def _objects(root: Path) -> dict[str, bytes]:
    s3, bucket = _s3(root)
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _flow_runs(root: Path, deployment: str) -> list[Any]:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with _client(root) as c:
        return c.read_flow_runs(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
        )


def _heartbeat_gaps(root: Path, flow_run_id: Any) -> list[float]:
    """Seconds between a flow run's consecutive signs of life as the server recorded them:
    entering Running, each heartbeat, Completed (a killed run's last stretch, from its last
    heartbeat to the kill, has no event and is not a gap)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    alive = ["prefect.flow-run.Running", "prefect.flow-run.heartbeat", "prefect.flow-run.Completed"]
    want = EventFilter(
        event=EventNameFilter(name=alive),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
    )
    with _client(root) as c:
        page = c.read_events(want, limit=50)
        events = list(page.events)
        while page.next_page is not None:
            page = c.read_events_page(page.next_page)
            events += page.events
    times = sorted(e.occurred.timestamp() for e in events)
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def _start(root: Path, deployment: str, parameters: dict[str, Any]) -> Any:
    return stack_server.start_deployment(stack_processes.load_state(root), deployment, parameters)


def _wait(root: Path, flow_run_id: Any, timeout: float = 400) -> Any:
    return stack_server.wait_flow_run(stack_processes.load_state(root), flow_run_id, timeout)


def _field(page: Any, description: str) -> Any:
    """The input of the run form's field whose description is `description` (the innermost
    form property holding it: sections hold their fields' descriptions too)."""
    import re

    text = page.locator(
        "div.markdown-renderer__text", has_text=re.compile(f"^{re.escape(description)}$")
    )
    return page.locator("div.schema-form-property", has=text).last.locator("input").first


@contextlib.contextmanager
def _run_form(root: Path, chromium: str, deployment: str) -> Iterator[Any]:
    """The custom-run page of a deployment of the stack, in a real (headless) Chromium."""
    from playwright.sync_api import sync_playwright

    ui = stack.status(root)["ui_url"]
    with _client(root) as c:
        dep = c.read_deployment_by_name(f"{deployment}/{deployment}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/deployments/deployment/{dep.id}/run")
            page.wait_for_selector("text=Finetune Domain", timeout=60_000)
            yield page
        finally:
            browser.close()


def _runs_of_pipeline(root: Path) -> list[Any]:
    return sorted(_flow_runs(root, "pipeline"), key=lambda r: r.created)


def _submit(page: Any, root: Path, tries: int = 6) -> Any:
    """Submit the open run form and return the flow run it created. The server refuses a
    write with 503 while another holds SQLite's lock (it says so in its log); the form then
    shows an error and the user submits again, as this does. What decides is the response to
    the form's own request, not text on the page (an unrelated read that fails shows an
    error too)."""

    def creates(response: Any) -> bool:
        return response.request.method == "POST" and response.url.endswith("/create_flow_run")

    from playwright.sync_api import TimeoutError as NoAnswer

    refused = []
    for _ in range(tries):
        try:
            # a bound above the server's SQLite busy timeout (60 s): a slow answer is awaited
            with page.expect_response(creates, timeout=150_000) as answer:
                page.get_by_role("button", name="Submit").click()
        except NoAnswer:
            refused.append("no answer in 150 s")
            continue
        if answer.value.status == 201:
            with _client(root) as c:
                return c.read_flow_run(answer.value.json()["id"])
        refused.append(f"{answer.value.status} {answer.value.text()[:200]}")
        time.sleep(5)
    log = stack_processes.load_state(root)["procs"]["prefect-server"]["log"]
    tail = Path(log).read_text(errors="replace")[-3000:]
    raise AssertionError(f"the server refused every submit: {refused}; its log ends:\n{tail}")


@pytest.fixture(scope="module")
def pipeline(root: Path, chromium: str) -> dict[str, Any]:
    """The `pipeline` deployment run once from the UI, as a user does: its custom-run form
    (open with the deployment's defaults: every stage, the stack's params and bucket,
    dispatch: deployments), one value changed, Submit. What the tests below read of it."""
    before = {r.id for r in _runs_of_pipeline(root)}
    with _run_form(root, chromium, "pipeline") as page:
        batch = _field(page, "questions decoded together")  # evaluate.batch_size
        assert batch.input_value() == "64"
        batch.fill("48")
        submitted = _submit(page, root)
    # one run: a refused submit created none
    assert [r.id for r in _runs_of_pipeline(root) if r.id not in before] == [submitted.id]
    assert submitted.parameters["params"]["evaluate"]["batch_size"] == 48
    fr = _wait(root, submitted.id, timeout=600)
    stage_runs = {stage: _flow_runs(root, stage) for stage in STAGES}
    ids = [str(r.id) for runs in stage_runs.values() for r in runs]
    with _client(root) as c:
        from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

        artifacts = c.read_artifacts(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[*ids, str(fr.id)]))
        )
    return {"run": fr, "handoff": str(fr.id), "stage_runs": stage_runs, "artifacts": artifacts}


def test_pipeline_runs_every_stage_on_its_pools_worker(root: Path, pipeline: dict) -> None:
    assert pipeline["run"].state.is_completed(), pipeline["run"].state
    cfg = load_config(root / "params.yaml")
    handoff = pipeline["handoff"]  # the pipeline's default hand-off key
    commit = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()

    objects = _objects(root)
    for stage in STAGES:
        runs = [r for r in pipeline["stage_runs"][stage] if r.parameters["handoff"] == handoff]
        assert len(runs) == 1, (stage, runs)
        fr = runs[0]
        assert fr.state.is_completed(), (stage, fr.state)
        pool = cfg.pools.stages[stage]
        assert fr.work_pool_name == pool
        assert str(fr.parent_task_run_id)
        # the lineage record in S3 names the worker of the stage's own pool and its flow run
        [record] = [
            json.loads(v)
            for k, v in objects.items()
            if k.startswith(f"moe-pipeline/lineage/{stage}/") and str(fr.id) in k
        ]
        assert record["worker"].startswith(f"worker-{pool}@"), record["worker"]
        assert record["flow_run_id"] == str(fr.id) and record["pool"] == pool
        assert record["code"]["commit"] == commit  # the copies' commit, via env
        assert f"moe-pipeline/runs/{handoff}/{stage}/manifest.json" in objects
        # the stage ran with the value changed in the run form, and the rest as params.yaml
        resolved = load_config(params=fr.parameters["params"])
        assert resolved.evaluate.batch_size == 48 and resolved.pretrain == cfg.pretrain
    # the pipeline run ends with its report artifact, linking each stage's run
    from tasks.presentation import PIPELINE_REPORT

    [report] = [a for a in pipeline["artifacts"] if a.key == PIPELINE_REPORT]
    for stage in STAGES:
        [fr] = [r for r in pipeline["stage_runs"][stage] if r.parameters["handoff"] == handoff]
        assert f"- {stage}: [{fr.id}](" in report.data
    # no shared disk: each pool's folder holds what its stages made or fetched
    work = root / stack_processes.STATE_DIR / "work"
    assert (work / "gpu-h100/models/pretrain/checkpoints/latest").is_file()
    assert not (work / "gpu-h100/data/prepared/train.bin").exists()
    # the user's side (cpu) gets the final model's export back, and no stage's own model
    assert sorted(p.name for p in (work / "cpu/models").iterdir()) == ["export"]
    assert json.loads((work / "cpu/reports/metrics.json").read_text())["cost_total"] > 0

    keys = {a.key for a in pipeline["artifacts"]}
    assert {
        f"{s.replace('_', '-')}-{kind}" for s in STAGES for kind in ("summary", "lineage")
    } <= keys, keys


def _journal(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not yet written, or replaced right now
        return {"fingerprint": None, "attempts": []}


def test_a_machine_lost_twice_is_recovered_without_a_human(root: Path, pipeline: dict) -> None:
    """The pipeline deployment runs pretrain; at two random steps the gpu-h100 machine dies
    (its worker and the flow run, SIGKILL). After the kills the test only watches: the
    watchdog starts the worker again (its health check), the heartbeat automation marks the
    lost run Crashed, the recovery automation runs the stage again with its parameters, it
    resumes from its newest checkpoint, and the pipeline, which waited, completes. The final
    weights are those of an uninterrupted run; each kill cost at most one checkpoint interval
    of steps; the API links each recovery run to the run it replaces."""
    from flows.recovery import LINK, RECOVERY_TAG
    from moe.checkpoint.tensors import weights_digest
    from tasks.pretraining import pretrain_model

    seed = random.randrange(10**6)
    rng = random.Random(seed)
    print(f"kill moments from seed {seed}")
    state = stack_processes.load_state(root)
    every, steps = 25, 300
    cfg = load_config(
        root / "params.yaml",
        [
            *state["overrides"],
            f"pretrain.max_steps={steps}",
            f"pretrain.checkpoint_every={every}",
            "pretrain.log_every=25",
            f"pretrain.eval_every={steps}",
            # small steps: what is tested is where the kills land in steps and checkpoints,
            # not the work of each step (this run and its reference are most of the file's
            # CPU time on a 2-core machine)
            "pretrain.batch_size=2",
        ],
    )
    # prepare and publish of the pipeline run, handed off under a key of this test's own
    handoff = f"preempted-{seed}"
    s3, bucket = _s3(root)
    for key in _objects(root):
        for stage in ("prepare", "publish"):
            old = f"moe-pipeline/runs/{pipeline['handoff']}/{stage}/"
            if key.startswith(old):
                new = key.replace(pipeline["handoff"], handoff, 1)
                s3.copy_object(Bucket=bucket, Key=new, CopySource={"Bucket": bucket, "Key": key})
    work = root / stack_processes.STATE_DIR / "work/gpu-h100"
    journal = work / "models/pretrain/checkpoints/attempts.json"
    before = _journal(journal)["fingerprint"]
    run = _start(
        root,
        "pipeline",
        {"params": cfg.to_dict(), "stages": ["pretrain"], "handoff": handoff},
    )
    killed_at = []
    for attempt, lo, hi in ((1, 30, 90), (2, 0, 0)):
        if attempt == 2:
            lo, hi = killed_at[0] + 30, killed_at[0] + 90
        at = rng.randint(lo, hi)
        deadline = time.time() + 400
        while True:
            j = _journal(journal)
            runs = j["attempts"]
            if j["fingerprint"] != before and len(runs) == attempt and runs[-1]["last_step"] >= at:
                break
            assert len(runs) <= attempt or j["fingerprint"] == before, runs
            assert time.time() < deadline, f"attempt {attempt} did not reach step {at}: {j}"
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.3))
        worker = stack_processes.live_process(
            stack_processes.load_state(root)["procs"]["worker-gpu-h100"]
        )
        assert worker is not None
        stack_processes.kill_tree(
            worker, sig="kill"
        )  # the machine dies: worker and flow run at once
        killed_at.append(_journal(journal)["attempts"][-1]["last_step"])
        if attempt == 1:
            # Meanwhile (each lost run is noticed only after crashed_after_s: idle time), the
            # same training uninterrupted, here, from the data the worker verified
            [meta] = list((work / ".cache/datasets").glob("*/*/meta.json"))
            reference = ThreadPoolExecutor(1).submit(
                pretrain_model.fn,
                cfg,
                meta.parent,
                Path(tempfile.mkdtemp()) / "ref",
                lambda r: None,
            )
    # From here on the test only watches.
    fr = _wait(root, run.id, timeout=900)
    assert fr.state.is_completed(), (fr.state, fr.state.message)

    runs = sorted(
        (r for r in _flow_runs(root, "pretrain") if r.parameters.get("handoff") == handoff),
        key=lambda r: r.created,
    )
    assert [r.state.type.value for r in runs] == ["CRASHED", "CRASHED", "COMPLETED"], runs
    assert "heartbeat" in runs[0].state.message and "heartbeat" in runs[1].state.message
    for prev, rec in zip(runs, runs[1:], strict=False):
        assert RECOVERY_TAG in rec.tags and LINK + str(prev.id) in rec.tags, rec.tags
        assert rec.parameters == prev.parameters  # same hand-off key, same resolved params

    # the premise of crashed_after_s=60 with 30 s heartbeats, checked, not assumed: on this
    # machine no live run went that long without a sign of life (the server's own events)
    gaps = [_heartbeat_gaps(root, r.id) for r in runs]
    assert all(gaps), gaps  # each run: Running, then at least one heartbeat
    assert max(g for each in gaps for g in each) < cfg.recovery.crashed_after_s, gaps

    record = json.loads((work / "models/pretrain/lineage.json").read_text())
    assert record["flow_run_id"] == str(runs[-1].id)
    lost = record["interruptions"]
    assert lost["count"] == 2 and lost["attempts"] == 3
    for kill, each in zip(killed_at, lost["each"], strict=True):
        assert each["at_step"] >= kill  # the journal saw at least the step the test saw
        assert each["steps_lost"] <= every  # at most one checkpoint interval redone
        assert each["down_s"] > 0 and each["restart_s"] > 0
    assert 0 < lost["goodput"] < 1 and lost["cost"] > 0
    assert record["metrics"]["steps"] == steps

    ref = reference.result(timeout=600)
    assert ref.steps == steps
    from safetensors.torch import load_file

    got = load_file(str(work / "models/pretrain/model.safetensors"))
    want = load_file(str(Path(ref.checkpoint).parents[1] / "model.safetensors"))
    assert weights_digest(got) == weights_digest(want)


def test_an_unchanged_stage_is_skipped_on_its_worker(root: Path, pipeline: dict) -> None:
    # prepare already ran on the cpu worker for the pipeline; again, with a new hand-off key
    result = stack.run(root, stages=["prepare"], handoff="again", say=lambda m: None)
    assert result["completed"], result
    [fr] = [r for r in _flow_runs(root, "prepare") if r.parameters.get("handoff") == "again"]
    assert fr.state.is_completed()
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.time() + 30  # logs reach the API in batches
    while True:
        with _client(root) as c:
            logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
        if any("stage prepare skipped" in log.message for log in logs):
            break
        assert time.time() < deadline, [log.message for log in logs]
        time.sleep(1)
    # a skipped stage still hands its outputs off under the new run key
    assert "moe-pipeline/runs/again/prepare/manifest.json" in _objects(root)


def test_planted_secrets_appear_nowhere(root: Path, pipeline: dict) -> None:
    texts = [str(a.data) for a in pipeline["artifacts"]]
    for p in root.rglob("*"):
        if p.is_file() and p.stat().st_size < 50 << 20 and ".venv" not in p.parts:
            texts.append(p.read_bytes().decode("utf-8", "replace"))
    texts += [v.decode("utf-8", "replace") for v in _objects(root).values()]
    with _client(root) as c:
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        ids = [str(r.id) for runs in pipeline["stage_runs"].values() for r in runs]
        texts += [
            log.message
            for log in c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=ids)))
        ]
        texts += [json.dumps(c.read_flow_run(i).parameters) for i in ids]
    for name, secret in PLANTED.items():
        assert not any(secret in t for t in texts), f"{name} leaked"


def _down_stops_exactly_what_up_started(root: Path) -> None:
    """Every process `up` started and its children stop; nothing under .stack/ is lost."""
    state = stack_processes.load_state(root)
    family = []
    for entry in state["procs"].values():
        p = stack_processes.live_process(entry)
        assert p is not None
        family += [p, *p.children(recursive=True)]
    files_before = sorted((root / stack_processes.STATE_DIR).rglob("*"))
    stopped = stack.down(root, say=lambda m: None)
    assert set(stopped) == {
        "prefect-server",
        "moto-s3",
        stack.WATCHDOG,
        *(f"worker-{p}" for p in load_config(root / "params.yaml").pools.definitions),
    }
    for p in family:
        assert not p.is_running() or p.status() == psutil.STATUS_ZOMBIE, p
    assert stack.status(root)["processes"] == {}
    # Nothing lost: every file is still there (SQLite's -wal/-shm go when the server closes).
    gone = [f for f in files_before if not f.exists() and not f.name.endswith(("-wal", "-shm"))]
    assert not gone, gone
