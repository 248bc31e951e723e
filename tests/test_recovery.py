"""flows/recovery.py without a server: when a crashed stage is run again and after how long,
and the two automations as Prefect will evaluate them (the stack test runs them for real)."""

from __future__ import annotations

from datetime import timedelta
from uuid import uuid4

import pytest

from flows.recovery import STAGE_TAG, automations, decide
from tasks.config import RecoveryConfig


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


def test_the_automations_prefect_evaluates() -> None:
    from prefect.client.schemas.objects import StateType
    from prefect.events.schemas.automations import Posture

    rec = RecoveryConfig(heartbeat_s=30, crashed_after_s=75)
    dep = uuid4()
    detect, recover = automations(rec, dep)
    t = detect.trigger
    assert t.posture == Posture.Proactive and t.within == timedelta(seconds=75)
    assert t.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.Crashed" in t.expect
    assert t.for_each == {"prefect.resource.id"}
    # only the stage runs of this project: another project's runs on the same server (with
    # Prefect's default 180 s heartbeats) are never crashed by it
    assert t.match_related.get("prefect.resource.id") == [f"prefect.tag.{STAGE_TAG}"]
    assert detect.actions[0].state == StateType.CRASHED
    r = recover.trigger
    assert r.expect == {"prefect.flow-run.Crashed"} and r.posture == Posture.Reactive
    assert r.match_related.get("prefect.resource.id") == [f"prefect.tag.{STAGE_TAG}"]
    action = recover.actions[0]
    assert action.deployment_id == dep and action.parameters == {
        "crashed": "{{ event.resource.id }}"
    }


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


class _Runs:
    """The part of Prefect's client that `follow` reads, over runs held here."""

    def __init__(self, *runs: object) -> None:
        self.runs = {r.id: r for r in runs}

    def read_flow_run(self, flow_run_id: object) -> object:
        return self.runs[flow_run_id]

    def read_flow_runs(self, flow_run_filter: object) -> list:
        [tag] = flow_run_filter.tags.all_
        return [r for r in self.runs.values() if tag in r.tags]


def _run(name: str, state: object, tags: list[str] | None = None) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(id=uuid4(), name=name, state=state, tags=tags or [])


def test_follow_waits_through_the_chain_of_recovery_runs() -> None:
    from prefect.states import Completed, Crashed

    from flows.recovery import LINK, follow

    a = _run("a", Crashed())
    b = _run("b", Crashed(), [LINK + str(a.id)])
    c = _run("c", Completed(), [LINK + str(b.id)])
    assert follow(_Runs(a, b, c), a, wait_s=5, poll_s=0) is c
    # no recovery run: after wait_s the crashed run is returned; one given up on: at once
    assert follow(_Runs(a), a, wait_s=0, poll_s=0) is a
    from flows.recovery import GAVE_UP

    gave_up = _run("g", Crashed(), [GAVE_UP])
    assert follow(_Runs(gave_up), gave_up, wait_s=3600, poll_s=0) is gave_up
    # a run that did not crash is not followed
    done = _run("d", Completed())
    assert follow(_Runs(done), done, wait_s=3600) is done
