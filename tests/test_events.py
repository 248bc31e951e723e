"""The pipeline's alerts as Prefect events, read back from a real Prefect server (the test
fixture's): the trainer's budget alert and budget stop, reached through the stage's own
training wiring (tasks/training.py), and a stage's completion; the example automation sends
a budget alert to a notification block (a webhook to an HTTP server of this test's)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tasks.events import BUDGET_ALERT, BUDGET_STOP, STAGE_COMPLETED


@pytest.fixture
def api(prefect_server: dict[str, str]) -> Iterator[str]:
    """The fixture's server as this process's Prefect API (flows run here report to it)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        yield prefect_server["PREFECT_API_URL"]


def _flush_events() -> None:
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()


def events_of(flow_run_id: Any, names: list[str], want: int, timeout: float = 60) -> list[Any]:
    """The server's events about a flow run with these names, once `want` of them are there
    (the server stores events asynchronously: a bound on the wait, not a verdict)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    _flush_events()
    wanted = EventFilter(
        event=EventNameFilter(name=names),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"]),
    )
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            got = list(client.read_events(wanted, limit=50).events)
            if len(got) >= want or time.monotonic() > deadline:
                return sorted(got, key=lambda e: e.occurred)
            time.sleep(0.5)


def _budgeted_training(tmp_path: Path) -> tuple[str, Any]:
    """A real flow run whose training spends its budget: a clock that advances one second
    per reading and a price of 3600/h make each step cost about 1; the stage's share is 10,
    so the alert (0.8) and then the stop come at known steps on any machine."""
    from prefect import flow
    from prefect.runtime import flow_run

    from moe.recipes.fit import fit_and_save
    from moe.train.stop import Budget
    from tasks.config import Config
    from tasks.training import stage_context
    from tests.test_resilience import _clocked
    from tests.test_train import _data, _trainer

    cfg = Config()
    data = _data(tmp_path / "data")

    @flow(name="budgeted-training")
    def budgeted() -> tuple[str, Any]:
        t = _trainer(data, tmp_path / "ckpt", 40)
        _clocked(t, tick=0.5)  # two readings a step: one second a step
        t.stop.budget = Budget(price_per_hour=3600.0, left=10.0, alert=cfg.cost.alert_fraction)
        return str(flow_run.get_id()), fit_and_save(
            t, tmp_path / "out", "pretrain/x", stage_context(cfg, "pretrain", lambda row: None)
        )

    return budgeted()


def test_the_budget_alert_and_stop_are_events_of_the_stage_run(api: str, tmp_path: Path) -> None:
    run_id, result = _budgeted_training(tmp_path)
    assert result.stop_reason.startswith("budget")
    alert, stop = events_of(run_id, [BUDGET_ALERT, BUDGET_STOP], want=2)
    assert (alert.event, stop.event) == (BUDGET_ALERT, BUDGET_STOP)
    for e in (alert, stop):
        assert e.resource.id == f"prefect.flow-run.{run_id}"
        assert e.resource["moe.stage"] == "pretrain" and e.resource["moe.pool"] == "gpu-h100"
        assert e.payload["stage"] == "pretrain" and e.payload["pool"] == "gpu-h100"
        assert e.payload["currency"] == "USD"
    assert 8 <= alert.payload["cost"] < 10 and alert.payload["budget_left"] == 10.0
    assert "of the budget left for this stage spent" in alert.payload["message"]
    assert stop.payload["cost"] >= 10 and stop.payload["step"] > alert.payload["step"]
    assert stop.payload["reason"].startswith("budget")


def test_a_stage_under_torchrun_emits_its_budget_and_early_stop_events_once(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pretrain.nproc 2: the training runs in torchrun's rank processes, outside the flow
    run, yet the stage's run has its budget alert and its early stop, each once, with the
    rank's figures. The run is started as a process worker starts a deployment's run: its
    id and the API in the environment, which the ranks inherit. Any spend raises the alert
    (alert_fraction 1e-9 of 1.0 left) and the time budget (1e-9 s) stops after step 1, so
    both come at step 1 on any machine."""
    from prefect import flow
    from prefect.events import emit_event
    from prefect.runtime import flow_run

    from tasks.events import EARLY_STOP
    from tasks.launch import processes
    from tasks.pretraining import pretrain_model
    from tests.test_distributed import torchrun_config
    from tests.test_train import _data

    cfg = torchrun_config("cpu")  # gloo on CPU, GPU host or not
    cfg.pretrain.time_budget_s = 1e-9
    cfg.cost.alert_fraction = 1e-9
    assert processes(cfg, "pretrain") == 2
    data = _data(tmp_path / "data")
    rows: list[dict] = []

    @flow(name="pretrain-under-torchrun")
    def stage() -> tuple[str, Any]:
        run_id = str(flow_run.get_id())
        monkeypatch.setenv("PREFECT__FLOW_RUN_ID", run_id)
        monkeypatch.setenv("PREFECT_API_URL", api)
        return run_id, pretrain_model.fn(cfg, data, tmp_path / "model", rows.append, 1.0)

    run_id, result = stage()
    assert result.world == 2 and result.steps == 1
    assert result.stop_reason.startswith("time budget")
    # the ranks' rows reached the stage (replayed): the alert and the stop among them
    assert [r["step"] for r in rows if "budget_alert" in r or "early_stop" in r] == [1, 1]
    # a marker after both: once it is stored, so is every event sent before it
    emit_event(
        event="moe.test.marker", resource={"prefect.resource.id": f"prefect.flow-run.{run_id}"}
    )
    events_of(run_id, ["moe.test.marker"], want=1)
    got = events_of(run_id, [BUDGET_ALERT, BUDGET_STOP, EARLY_STOP], want=2)
    assert [e.event for e in got] == [BUDGET_ALERT, EARLY_STOP], [e.payload for e in got]
    alert, stopped = got
    for e in got:
        assert e.resource.id == f"prefect.flow-run.{run_id}"
        assert e.payload["stage"] == "pretrain" and e.payload["pool"] == "gpu-h100"
        assert e.payload["step"] == 1
    assert 0 < alert.payload["cost"] < 1.0 and alert.payload["budget_left"] == 1.0
    assert stopped.payload["reason"].startswith("time budget")


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        body = self.rfile.read(int(self.headers["Content-Length"]))
        _Hook.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _automation_loaded(timeout: float = 120) -> None:
    """The alert automation is loaded by the server's trigger service (which reads new ones
    some time after they are stored, and matches only events that arrive after): probe
    budget alerts about a flow run of no one's, one every few seconds, until one reaches the
    webhook. A condition; the timeout bounds the wait."""
    import uuid

    from prefect.events import emit_event

    deadline = time.monotonic() + timeout
    while True:
        emit_event(
            event=BUDGET_ALERT,
            resource={"prefect.resource.id": f"prefect.flow-run.{uuid.uuid4()}"},
            payload={"stage": "probe", "message": "is the automation loaded?"},
        )
        _flush_events()
        wait = time.monotonic() + 3
        while time.monotonic() < wait:
            if any("(probe)" in r["subject"] for r in _Hook.received):
                return
            time.sleep(0.1)
        assert time.monotonic() < deadline, "the server never ran the alert automation"


def _from_runs() -> list[dict]:
    """What the webhook received about real runs (not _automation_loaded's probes)."""
    return [r for r in _Hook.received if "(probe)" not in r["subject"]]


def test_the_alert_automation_sends_a_budget_alert_to_a_block(
    api: str, tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """`moe-pipeline alerts install` on the server, pointed at a webhook block (a Slack webhook block is
    the same kind of block); a budget alert from a training run reaches the webhook with its
    stage, pool and cost."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock
    from prefect.client.orchestration import get_client

    from flows.deployments import ALERT
    from tests.conftest import cli_env, pipeline_cli

    server = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Hook.received.clear()
    try:
        block = CustomWebhookNotificationBlock(
            name="moe-test-hook",
            url=f"http://127.0.0.1:{server.server_port}/hook",
            json_data={"subject": "{{subject}}", "text": "{{body}}"},
            allow_private_urls=True,
        )
        block.save("moe-test-hook", overwrite=True)
        env = cli_env(prefect_server)
        for _ in range(2):  # again: replaced, not doubled
            r = pipeline_cli(
                ["alerts", "install", "--block", "custom-webhook/moe-test-hook"], tmp_path, env
            )
            assert r.returncode == 0, r.stderr
            assert f"automation {ALERT!r}" in r.stdout
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name(ALERT)) == 1
        r = pipeline_cli(["alerts", "install", "--block", "custom-webhook/nope"], tmp_path, env)
        assert r.returncode == 2 and "no notification block custom-webhook/nope" in r.stderr
        _automation_loaded()  # the server matches events to an automation once it loaded it
        run_id, _ = _budgeted_training(tmp_path)
        deadline = time.monotonic() + 90  # a bound on the wait, not the verdict
        while not _from_runs() and time.monotonic() < deadline:
            time.sleep(0.5)
        [sent] = _from_runs()
        assert "moe.budget.alert" in sent["subject"] and "(pretrain)" in sent["subject"]
        assert "stage pretrain on pool gpu-h100" in sent["text"], sent
        assert "cost so far 8" in sent["text"] or "cost so far 9" in sent["text"], sent
    finally:
        server.shutdown()
        with get_client(sync_client=True) as client:
            for a in client.read_automations_by_name(ALERT):
                client.delete_automation(a.id)


def test_a_completed_stage_is_an_event_with_its_figures_and_cost(
    api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prepare stage, as a real flow run on a small corpus of this test's."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    from flows.stages import STAGE_FLOWS
    from tests.conftest import ROOT, merge, tiny_params

    monkeypatch.chdir(tmp_path)
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    (tmp_path / "corpus.txt").write_text(
        "\n\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000))
    )
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), tiny_params())
    params["data"].update(source="corpus.txt", doc_max_bytes=512)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    results, events = {}, {}
    for stage in ("prepare", "publish"):  # publish's figures include floats (its ratio, seconds)
        name = f"{stage}-for-events-{tmp_path.name}"
        results[stage] = STAGE_FLOWS[stage].with_options(flow_run_name=name)(
            params_file="params.yaml"
        )
        with get_client(sync_client=True) as client:
            [fr] = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
            )
        [events[stage]] = events_of(fr.id, [STAGE_COMPLETED], want=1)
    for stage, done in events.items():
        result, out = results[stage], {"prepare": "data/prepared", "publish": "data/published"}
        record = json.loads((tmp_path / out[stage] / "lineage.json").read_text())
        assert done.resource["moe.stage"] == stage and done.payload["pool"] == "cpu"
        assert "completed on pool cpu" in done.payload["message"]
        # the figures as the stage made them: every scalar, each of its own type (a float
        # stays a float, not an int, a string or left out)
        figures = done.payload["figures"]
        scalars = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}
        assert figures == scalars
        assert {k: type(v) for k, v in figures.items()} == {k: type(v) for k, v in scalars.items()}
        for key in ("cost", "wall_s"):  # the lineage record's figures, as floats
            assert isinstance(done.payload[key], float), (key, done.payload[key])
            assert done.payload[key] == record[key] and record[key] > 0, key
    floats = {k for k, v in events["publish"].payload["figures"].items() if type(v) is float}
    assert {"token_archive_ratio", "seconds"} <= floats
    assert 0 < events["publish"].payload["figures"]["token_archive_ratio"] < 1


def test_deployments_configure_fills_the_run_forms_in(
    api: str, tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """`moe-pipeline deployments configure` after `prefect deploy`: the stage and pipeline
    deployments' default `params` become the params file's resolved configuration (what the
    UI's form opens with), the pipeline's `stages` all of them; other parameters are kept."""
    from prefect.client.orchestration import get_client

    from tasks.config import load_config
    from tasks.pools import STAGES
    from tests.conftest import ROOT, cli_env, pipeline_cli

    with get_client(sync_client=True) as client:
        for name in ("pretrain", "pipeline"):
            client.create_deployment(
                flow_id=client.create_flow_from_name(name),
                name=name,
                entrypoint=f"flows/x.py:{name}",
                parameters={"dispatch": "deployments"} if name == "pipeline" else {},
            )
    r = pipeline_cli(
        [
            "deployments",
            "configure",
            "--params",
            str(ROOT / "params.yaml"),
            "--set",
            "pretrain.lr=7e-4",
        ],
        tmp_path,
        cli_env(prefect_server),
    )
    assert r.returncode == 0, r.stderr
    assert "pretrain/pretrain" in r.stdout and "pipeline/pipeline" in r.stdout
    want = load_config(ROOT / "params.yaml", ["pretrain.lr=7e-4"]).to_dict()
    with get_client(sync_client=True) as client:
        stage = client.read_deployment_by_name("pretrain/pretrain").parameters
        pipe = client.read_deployment_by_name("pipeline/pipeline").parameters
    assert stage["params"] == want and stage["params"]["pretrain"]["lr"] == 7e-4
    assert pipe["params"] == want and pipe["stages"] == list(STAGES)
    assert pipe["dispatch"] == "deployments"  # what was there stays
