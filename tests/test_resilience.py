"""Contract of moe/train/resilience.py and its use by the trainer: the Young/Daly interval minimises
the expected wall time under exponential interruptions, `checkpoint.every: auto` saves at the
interval it logs, and an interrupted attempt is accounted for (steps redone, time lost,
goodput) while the resumed run still ends bit-identical."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import model_tensors, weights_digest
from moe.train.resilience import (
    AttemptJournal,
    choose_interval,
    daly_interval_s,
    expected_wall_s,
)
from tests.test_train import _data, _trainer


@pytest.mark.parametrize(("save_s", "mtbi_s"), [(2.0, 3600.0), (30.0, 4 * 3600.0), (60, 1800)])
def test_daly_interval_minimises_the_expected_wall_time(save_s: float, mtbi_s: float) -> None:
    tau = daly_interval_s(save_s, mtbi_s)
    assert tau == pytest.approx(math.sqrt(2 * save_s * mtbi_s), rel=0.15)  # Young, first order

    def wall(t: float) -> float:
        return expected_wall_s(100 * 3600, t, save_s, 30.0, mtbi_s)

    grid = [tau * (0.2 + 0.01 * i) for i in range(400)]
    best = min(grid, key=wall)
    # Daly's estimate is within 1% of the numerical optimum of the same model's wall time
    assert wall(tau) <= wall(best) * 1.01
    assert wall(tau) < wall(tau / 3) and wall(tau) < wall(tau * 3)


def test_daly_limits() -> None:
    assert math.isinf(daly_interval_s(5.0, 0.0))  # no interruptions declared
    assert daly_interval_s(100.0, 40.0) == 40.0  # a save dearer than 2M: the rule returns M
    # in steps: tau / step time, at least 1, at most max_steps; none declared -> fallback
    c = choose_interval(save_s=2.0, step_s=0.5, mtbi_s=3600.0, fallback_steps=100, max_steps=10**6)
    assert c.steps == round(daly_interval_s(2.0, 3600.0) / 0.5) and c.rule == "young-daly"
    assert choose_interval(2.0, 0.5, 3600.0, 100, max_steps=50).steps == 50
    assert choose_interval(2.0, 0.5, 0.0, 100, 10**6).steps == 100


def test_journal_accounts_for_an_interrupted_attempt(tmp_path: Path) -> None:
    now = [100.0]
    j = AttemptJournal(tmp_path / "attempts.json", "fp", wall=lambda: now[0])
    assert j.begin(started_at=95.0, resumed_step=0, restore_s=0.0) is None
    for step in range(1, 38):  # one step a second; a checkpoint at 30; dies after step 37
        now[0] += 1.0
        j.progress(step, force=step == 30)
    j.progress(37, force=True)
    # A new process (another machine) starts at 150 and trains from step 30 at 160.
    now[0] = 160.0
    j2 = AttemptJournal(tmp_path / "attempts.json", "fp", wall=lambda: now[0])
    lost = j2.begin(started_at=150.0, resumed_step=30, restore_s=2.0)
    assert lost == {
        "attempt": 1,
        "at_step": 37,
        "resumed_step": 30,
        "steps_lost": 7,
        "redo_s": 7.0,
        "down_s": 13.0,  # 137 (last sign of life) -> 150 (new process)
        "restart_s": 8.0,  # 150 -> 160, less the 2 s restore
        "restore_s": 2.0,
        "lost_s": 30.0,
        "billed_lost_s": 17.0,
    }
    now[0] = 180.0
    j2.finish(50)
    s = j2.summary(productive_s=50.0)
    assert s["attempts"] == 2 and s["steps_lost"] == 7 and s["lost_s"] == 30.0
    assert s["lost_attempts_s"] == 137.0 - 95.0
    assert s["goodput"] == round(50.0 / (180.0 - 95.0), 4)
    # A finished stage started again is a new history; other params are another journal.
    j3 = AttemptJournal(tmp_path / "attempts.json", "fp", wall=lambda: now[0])
    assert j3.begin(200.0, 0, 0.0) is None and j3.summary(1.0)["attempts"] == 1
    other = AttemptJournal(tmp_path / "attempts.json", "other", wall=lambda: now[0])
    assert other.begin(200.0, 0, 0.0) is None


def _clocked(t, tick: float = 0.125) -> None:
    """Every clock reading is `tick` after the last: a step (timed by two readings) and a save
    alike cost one tick, on any CPU."""
    ticks = iter(range(10**6))
    t.clock = lambda: next(ticks) * tick


def test_auto_interval_saves_where_it_says(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "a", 40)
    _clocked(t)
    t.cadence.auto_mtbi_s = 4.0  # a (very) unreliable pool: Young/Daly gives a few steps
    t.checkpointer.store = CheckpointStore(tmp_path / "a", max_retain=100)
    result = t.fit()
    rows = [json.loads(r) for r in (tmp_path / "a.jsonl").read_text().splitlines()]
    chosen = [r for r in rows if "checkpoint_interval" in r]
    assert chosen, "the choice is logged"
    first = chosen[0]["checkpoint_interval"]
    assert first["rule"] == "young-daly" and first["mtbi_s"] == 4.0
    expect = round(daly_interval_s(first["save_stall_s"], 4.0) / first["step_s"])
    assert first["every_steps"] == expect and 1 < expect < 10
    saved = [r["step"] for r in rows if "checkpoint_stall_s" in r]
    assert saved[0] == 3  # the measuring save: after min(checkpoint_every=3, 10) steps
    assert saved[1] - saved[0] == expect
    assert result.resilience["checkpoint_interval"]["every_steps"] == expect
    # a pool without declared interruptions keeps the stage's checkpoint_every
    t2 = _trainer(data, tmp_path / "b", 12)
    t2.cadence.auto_mtbi_s = 0.0
    t2.fit()
    rows = [json.loads(r) for r in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "checkpoint_stall_s" in r] == [3, 6, 9, 12]


def test_interrupted_attempt_is_recorded_and_the_resume_is_exact(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    straight = _trainer(data, tmp_path / "a", 10)
    straight.fit()
    journal = tmp_path / "b" / "attempts.json"
    seconds = iter(range(10**6))  # a wall clock a second further at each reading: every
    wall = lambda: float(next(seconds))  # noqa: E731 - step's progress reaches the file
    first = _trainer(data, tmp_path / "b", 10, stop_after=5)  # dies after step 5
    first.journal = AttemptJournal(journal, first.checkpointer.fingerprint, wall=wall)
    assert first.fit().stop_reason == "stop_after"
    second = _trainer(data, tmp_path / "b", 10)
    second.journal = AttemptJournal(journal, second.checkpointer.fingerprint, wall=wall)
    result = second.fit()
    assert weights_digest(model_tensors(second.model)) == weights_digest(
        model_tensors(straight.model)
    )
    res = result.resilience
    assert res["attempts"] == 2 and len(res["interruptions"]) == 1
    lost = res["interruptions"][0]
    assert (lost["at_step"], lost["resumed_step"], lost["steps_lost"]) == (5, 3, 2)
    assert 0 < res["goodput"] <= 1
    rows = [json.loads(r) for r in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [r["interruption"]["steps_lost"] for r in rows if "interruption" in r] == [2]


def test_a_retry_in_the_same_process_has_no_time_down(tmp_path: Path) -> None:
    """A Prefect task retry runs in the process that failed: it started before the failure,
    so its restart is counted from the failure and nothing was down."""
    now = [100.0]
    j = AttemptJournal(tmp_path / "attempts.json", "fp", wall=lambda: now[0])
    j.begin(started_at=90.0, resumed_step=0, restore_s=0.0)
    now[0] = 120.0
    j.progress(20, force=True)
    now[0] = 130.0  # the retry trains again 10 s after the failure, same process (start 90)
    lost = j.begin(started_at=90.0, resumed_step=20, restore_s=1.0)
    assert lost is not None
    assert (lost["down_s"], lost["restart_s"], lost["steps_lost"]) == (0.0, 9.0, 0)
