"""flows/recovery.py: when a crashed stage is run again and after how long; the automations,
the recover flow and the pipeline's `follow` against a real Prefect server (the test fixture's);
the stack's watchdog with real worker processes. The stack test runs the whole loop with a
machine lost twice."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from flows.recovery import GAVE_UP, LINK, RECOVERY_TAG, STAGE_TAG, decide, follow, recover
from tasks import events
from tasks.config import RecoveryConfig
from tests.conftest import ROOT


def test_a_run_that_made_progress_is_recovered_at_once_a_crash_loop_is_not() -> None:
    rec = RecoveryConfig(max_attempts=5, max_stalled=2, backoff_s=10, backoff_max_s=25)
    assert decide(rec, [30.0]) == (True, 10.0, "attempt 2, after 10 s")
    assert decide(rec, [30.0, 60.0, 90.0])[:2] == (True, 10.0)  # each got further
    ok, delay, _ = decide(rec, [30.0, 30.0])  # one stalled: back off, doubled
    assert ok and delay == 20.0
    ok, _, why = decide(rec, [30.0, 30.0, 30.0])  # two in a row got nowhere
    assert not ok and "max_stalled" in why
    assert decide(RecoveryConfig(max_stalled=9, backoff_s=10, backoff_max_s=25), [5.0] * 4)[1] == 25
    ok, _, why = decide(rec, [10.0, 20.0, 30.0, 40.0, 50.0, 60.0])  # six crashes, five recoveries
    assert not ok and "max_attempts" in why
    assert decide(rec, [10.0, 20.0, 30.0, 40.0, 50.0])[0]
    # progress not known (torchrun ranks write no artifact): never a stall, only the cap
    assert decide(rec, [None, None, None]) == (True, 10.0, "attempt 4, after 10 s")


FINAL = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}


@pytest.fixture
def client(prefect_server: dict[str, str]) -> Iterator[Any]:
    """A client of the fixture's server; the recover flow's own `get_client` reaches it too."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as c:
            yield c


def _deployment(client: Any, flow: str, name: str, tags: list[str]) -> UUID:
    return client.create_deployment(
        flow_id=client.create_flow_from_name(flow),
        name=name,
        tags=tags,
        entrypoint=f"flows/{flow}.py:{flow}",
        enforce_parameter_schema=False,
    )


def test_the_automations_the_server_stores(client: Any) -> None:
    """install() puts both automations on the server; read back, each trigger is whole."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import Posture

    from flows.recovery import DETECT, RECOVER, install, remove

    dep = _deployment(client, "recover", "recover", [])
    rec = RecoveryConfig(heartbeat_s=30, crashed_after_s=75)
    assert install(client, rec) == [DETECT, RECOVER]
    assert install(client, rec) == [DETECT, RECOVER]  # again: replaced, not doubled
    [detect] = client.read_automations_by_name(DETECT)
    [recover] = client.read_automations_by_name(RECOVER)
    t = detect.trigger
    assert t.posture == Posture.Proactive and t.within == timedelta(seconds=75)
    assert t.threshold == 1
    # armed by a heartbeat; disarmed by the next heartbeat or any final state, nothing else
    assert t.after == {"prefect.flow-run.heartbeat"}
    assert t.expect == {"prefect.flow-run.heartbeat", *FINAL}
    assert t.match.get("prefect.resource.id") == ["prefect.flow-run.*"]
    assert t.for_each == {"prefect.resource.id"}  # each run on its own clock
    # only the stage runs of this project: another project's runs on the same server (with
    # Prefect's default 180 s heartbeats) are never crashed by it
    assert t.match_related.get("prefect.resource.id") == [f"prefect.tag.{STAGE_TAG}"]
    assert [a.type for a in detect.actions] == ["change-flow-run-state"]
    assert detect.actions[0].state == StateType.CRASHED
    r = recover.trigger
    assert r.expect == {"prefect.flow-run.Crashed"} and r.posture == Posture.Reactive
    assert r.after == set() and r.threshold == 1
    assert r.match.get("prefect.resource.id") == ["prefect.flow-run.*"]
    assert r.match_related.get("prefect.resource.id") == [f"prefect.tag.{STAGE_TAG}"]
    [action] = recover.actions
    assert action.deployment_id == dep and action.parameters == {
        "crashed": "{{ event.resource.id }}"
    }
    assert detect.enabled and recover.enabled
    remove(client)
    assert not client.read_automations_by_name(DETECT)
    assert not client.read_automations_by_name(RECOVER)
    rec.enabled = False
    assert install(client, rec) == [] and not client.read_automations_by_name(RECOVER)


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("heartbeat_s", 10, "Prefect's minimum"),
        ("crashed_after_s", 45, "at least twice heartbeat_s"),
        ("max_stalled", 0, ">= 1"),
    ],
)
def test_settings_that_would_crash_live_runs_are_refused(key: str, value: int, why: str) -> None:
    from moe.config import ConfigError
    from tasks.config import load_config

    with pytest.raises(ConfigError, match=why):
        load_config(None, [f"recovery.{key}={value}"])


def _crashed(
    client: Any, dep: UUID, params: dict, tags: list[str] = (), progress: float | None = None
) -> Any:
    """A run of the stage deployment that crashed, having reached `progress` (its progress
    artifact, as tasks/progress.py writes it)."""
    from prefect.client.schemas.actions import ArtifactCreate
    from prefect.states import Crashed

    fr = client.create_flow_run_from_deployment(dep, parameters=params, tags=list(tags))
    if progress is not None:
        client.create_artifact(ArtifactCreate(type="progress", data=progress, flow_run_id=fr.id))
    client.set_flow_run_state(fr.id, Crashed(message="no heartbeat"), force=True)
    return client.read_flow_run(fr.id)


def _recoveries_of(client: Any, fr: Any) -> list[Any]:
    """Read here with the server's own tag filter, not through the code under test."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[LINK + str(fr.id)]))
    )


def _settled(flow_run_id: Any) -> None:
    """Every event this process sent about the run so far is on the server (or was refused
    there as a duplicate of one that is): a marker event, sent after them through the same
    events client (one queue, one websocket, in order), has been stored. The server reads
    what a websocket sends in order and persists it in that order, in batches: the marker
    is stored with the events before it or after them. A condition, not a time window."""
    from prefect.events import emit_event

    from tests.test_events import events_of

    marker = emit_event(
        event="moe.test.settled",
        resource={"prefect.resource.id": f"prefect.flow-run.{flow_run_id}"},
    )
    assert marker is not None
    stored = events_of(flow_run_id, [marker.event], want=1)
    assert [e.id for e in stored] == [marker.id], "the marker event never reached the server"


def test_a_crashed_stage_is_run_again_once_then_given_up_on(
    client: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recover flow against the server: the crashed run's parameters and tags go to one
    recovery run, however often the automation fires; when the attempts are used up the run
    is tagged as given up, the log says why, and the pipeline's `follow` stops at it."""
    from prefect.states import Completed

    dep = _deployment(client, "pretrain", "pretrain", [STAGE_TAG])
    params = {"overrides": ["recovery.max_attempts=1", "recovery.backoff_s=0"], "handoff": "k1"}
    first = _crashed(client, dep, params, ["pool:gpu"])
    assert STAGE_TAG in first.tags  # from the deployment: what the automations match on
    got = recover.fn(crashed=f"prefect.flow-run.{first.id}")
    assert got["recovered"] and got["delay_s"] == 0
    again = recover.fn(crashed=f"prefect.flow-run.{first.id}")  # the automation fired twice
    assert again == {
        "recovered": True,
        "flow_run_id": got["flow_run_id"],
        "why": "already recovered",
    }
    # two recover runs that both looked before either had started its run (the automation
    # fired twice at once): the server's idempotency key makes it one run
    monkeypatch.setattr("flows.recovery._recoveries", lambda client, flow_run_id: [])
    raced = recover.fn(crashed=f"prefect.flow-run.{first.id}")
    monkeypatch.undo()
    assert raced["flow_run_id"] == got["flow_run_id"]
    [second] = _recoveries_of(client, first)
    assert str(second.id) == got["flow_run_id"] and second.parameters == params
    assert {RECOVERY_TAG, LINK + str(first.id), "pool:gpu"} <= set(second.tags)

    # one event for the stage run's loss, however often the recover flow ran for it: counted
    # once the server has stored a marker sent after the three recover runs' events
    from tests.test_events import events_of

    _settled(first.id)
    [started] = events_of(first.id, [events.RECOVERED], want=1)
    assert started.payload["recovery_flow_run_id"] == got["flow_run_id"]
    assert started.payload["stage"] == "pretrain" and started.payload["attempt"] == 2

    # the recovery run crashes too: one recovery was allowed (max_attempts=1)
    from prefect.states import Crashed

    client.set_flow_run_state(second.id, Crashed(message="no heartbeat"), force=True)
    with caplog.at_level(logging.ERROR, logger="flows.recovery"):
        out = recover.fn(crashed=f"prefect.flow-run.{second.id}")
    assert not out["recovered"] and "max_attempts" in out["why"]
    assert GAVE_UP in client.read_flow_run(second.id).tags
    assert not _recoveries_of(client, second)
    [line] = [
        r.getMessage()
        for r in caplog.records
        if r.name == "flows.recovery" and r.levelno == logging.ERROR
    ]
    assert "is not recovered" in line and "max_attempts" in line and second.name in line
    _settled(second.id)
    [gave_up] = events_of(second.id, [events.GAVE_UP], want=1)
    assert "max_attempts" in gave_up.payload["message"] and gave_up.payload["attempts"] == 2
    # the pipeline waiting on the first run follows the chain and stops at the given-up run
    # at once (wait_s would otherwise hold it for an hour)
    end = follow(client, client.read_flow_run(first.id), wait_s=3600, poll_s=0.1)
    assert end.id == second.id

    # a run that is not Crashed, or not a stage's, is left alone
    done = client.create_flow_run_from_deployment(dep, parameters=params)
    client.set_flow_run_state(done.id, Completed(), force=True)
    assert "not Crashed" in recover.fn(crashed=f"prefect.flow-run.{done.id}")["why"]
    other = _deployment(client, "pretrain", "nightly", [STAGE_TAG])
    lone = _crashed(client, other, params)
    assert "not a stage" in recover.fn(crashed=f"prefect.flow-run.{lone.id}")["why"]


def test_a_crash_loop_is_read_from_the_runs_progress_artifacts(client: Any) -> None:
    """Two attempts that crashed at the same progress (their artifacts on the server) are a
    crash loop at max_stalled=1; one that got further is recovered, and `follow` waits for
    its recovery run's end."""
    from prefect.states import Completed

    dep = _deployment(client, "finetune_sql", "finetune_sql", [STAGE_TAG])
    params = {"overrides": ["recovery.max_stalled=1", "recovery.backoff_s=0"], "handoff": "k2"}
    a = _crashed(client, dep, params, progress=30.0)
    b = _crashed(client, dep, params, [LINK + str(a.id)], progress=30.0)
    out = recover.fn(crashed=f"prefect.flow-run.{b.id}")
    assert not out["recovered"] and "crash loop" in out["why"]

    c = _crashed(client, dep, params, progress=30.0)
    d = _crashed(client, dep, params, [LINK + str(c.id)], progress=55.0)
    out = recover.fn(crashed=f"prefect.flow-run.{d.id}")
    assert out["recovered"], out
    [e] = _recoveries_of(client, d)
    client.set_flow_run_state(e.id, Completed(), force=True)
    assert follow(client, client.read_flow_run(c.id), wait_s=5, poll_s=0.1).id == e.id


def _parent_of_a_sleeper() -> tuple[Any, Any]:
    """A process (Popen, in a session of its own) that started a sleeping child in a session
    of its own, as a worker starts a flow run or the watchdog a worker: (parent, child as a
    psutil.Process)."""
    import subprocess
    import sys

    import psutil

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
            " start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    return parent, psutil.Process(int(parent.stdout.readline()))


def test_the_watchdog_replaces_an_unhealthy_worker_and_spares_its_flow_runs(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """A worker process that lives but fails its health check: after `grace` seconds of
    failing (a clock the test sets) the watchdog kills that process alone (a flow run it
    started, in a session of its own, goes on) and starts a real worker in its place, which
    answers its health check; a dead worker is started again at once."""
    import time

    import psutil

    from flows import stack, stack_processes

    root = tmp_path
    (root / stack_processes.STATE_DIR / "work" / "cpu").mkdir(parents=True)
    (root / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    # a hung worker: alive, its health port answers nothing; it started a flow run
    hung, flow_run = _parent_of_a_sleeper()
    me = psutil.Process()
    state = {
        "api_url": prefect_server["PREFECT_API_URL"],
        "params_file": str(root / "params.yaml"),
        "procs": {
            # the watchdog only asks whether the server's process lives: this one does
            "prefect-server": {"pid": me.pid, "started": me.create_time()},
            "worker-cpu": {
                "pid": hung.pid,
                "started": psutil.Process(hung.pid).create_time(),
                "health_port": stack_processes.free_port(),
                "pool": "cpu",
                "query_seconds": 1,
                "log": str(root / "hung.log"),
            },
        },
    }
    stack_processes.save_state(root, state)
    said: list[str] = []
    started: list[psutil.Process] = []
    try:
        failing: dict[str, float] = {}
        stack._watch_once(root, state, failing, grace=60, say=said.append)
        assert "worker-cpu" in failing and not said  # failing, not yet for `grace` seconds
        assert hung.poll() is None
        failing["worker-cpu"] = time.monotonic() - 61  # as if it had failed for 61 s
        stack._watch_once(root, state, failing, grace=60, say=said.append)
        assert said == ["worker-cpu failed its health check for 60 s: restarting it"]
        assert hung.wait(10) is not None
        assert flow_run.is_running()  # its flow run was not killed with it
        new = stack_processes.load_state(root)["procs"]["worker-cpu"]
        worker = stack_processes.live_process(new)
        assert worker is not None and worker.pid != hung.pid
        started.append(worker)
        deadline = time.monotonic() + 120  # a bound on the wait, not the verdict
        while not stack.healthy(new):
            assert stack_processes.live_process(new) is not None, Path(new["log"]).read_text()[
                -2000:
            ]
            assert time.monotonic() < deadline, "the new worker never answered its health check"
            time.sleep(0.5)

        # the machine dies: no grace for a worker that is gone
        stack_processes.kill_tree(worker, sig="kill")
        said.clear()
        stack._watch_once(root, stack_processes.load_state(root), {}, grace=60, say=said.append)
        assert said == ["worker-cpu is gone: starting it again"]
        again = stack_processes.live_process(
            stack_processes.load_state(root)["procs"]["worker-cpu"]
        )
        assert again is not None and again.pid != worker.pid
        started.append(again)
    finally:
        stack_processes.kill_trees([p for p in started if p.is_running()], timeout=10)
        for p in (hung, flow_run):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_down_stops_a_worker_the_watchdog_started_in_its_own_turn(tmp_path: Path) -> None:
    """A worker the watchdog started again is the watchdog's child. `stack down` stops the
    watchdog first, and with it only what is not one of the stack's own processes: the
    worker is stopped, and named, in the workers' turn (it was killed with the watchdog and
    left out of what `down` said it stopped)."""

    import psutil

    from flows import stack, stack_processes

    watchdog, worker = _parent_of_a_sleeper()
    assert worker.ppid() == watchdog.pid
    procs = {"watchdog": psutil.Process(watchdog.pid), "worker-cpu": worker}
    state = {
        "procs": {n: {"pid": p.pid, "started": p.create_time()} for n, p in procs.items()},
    }
    (tmp_path / stack_processes.STATE_DIR).mkdir()
    stack_processes.save_state(tmp_path, state)
    said: list[str] = []
    try:
        stopped = stack.down(tmp_path, say=said.append, timeout=10)
        assert stopped == ["watchdog", "worker-cpu"], said
        assert said == [f"stopped {n} (pid {p.pid})" for n, p in procs.items()]
        assert watchdog.wait(10) is not None
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    finally:
        watchdog.stdout.close()
        stack_processes.kill_trees([p for p in procs.values() if p.is_running()], timeout=10)
