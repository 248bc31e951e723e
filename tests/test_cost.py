"""The cost report adds up: stage costs sum to the total, phases sum to their stage's compute
cost, the saving is measured against the dearest pool, and the chart is drawn."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config import Config, load_config
from tasks.cost import cost_ledger, phase_costs, storage_costs
from tasks.presentation import plot_cost


def _records() -> list[dict]:
    return [
        {"stage": "prepare", "pool": "cpu", "wall_s": 36.0, "cost": 0.001},
        {"stage": "pretrain", "pool": "gpu-h100", "wall_s": 360.0, "cost": 0.32},
        {"stage": "finetune_sql", "pool": "gpu-a100", "wall_s": 180.0, "cost": 0.055},
    ]


def test_ledger_adds_up_and_measures_the_saving() -> None:
    cfg = Config()
    shares = {"pretrain": [[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]}
    ledger = cost_ledger(cfg, _records(), shares)
    assert ledger["total"] == pytest.approx(sum(r["cost"] for r in _records()))
    assert sum(ledger["by_pool"].values()) == pytest.approx(ledger["total"])
    assert ledger["by_expert"]["expert_0"] == pytest.approx(0.16)
    # All three stages on the dearest pool (H100, 3.20/h) for their wall time.
    assert ledger["all_on_pool"]["pool"] == "gpu-h100"
    assert ledger["all_on_pool"]["cost"] == pytest.approx(576 / 3600 * 3.20)
    assert ledger["saving"] == pytest.approx(ledger["all_on_pool"]["cost"] - ledger["total"])


def test_budget_alert_on_a_tiny_budget() -> None:
    cfg = Config()
    cfg.cost.budget = 0.3
    ledger = cost_ledger(cfg, _records())
    assert ledger["budget_alert"] is True and ledger["budget_used"] > 1


def test_stages_that_share_a_pool_are_billed_together_on_it() -> None:
    """The shipped params.yaml puts several stages on one pool (prepare and publish on cpu):
    that pool's line of the bill is the sum of its stages, not the last one's cost."""
    from tests.conftest import ROOT

    cfg = load_config(ROOT / "params.yaml")
    stages = cfg.pools.stages
    costs = {s: 0.001 * (i + 1) for i, s in enumerate(stages)}  # each stage its own figure
    records = [
        {"stage": s, "pool": pool, "wall_s": 60.0, "cost": costs[s]} for s, pool in stages.items()
    ]
    shared = {p for p in stages.values() if list(stages.values()).count(p) > 1}
    assert shared, "params.yaml no longer puts two stages on one pool: pick records that do"
    ledger = cost_ledger(cfg, records)
    assert set(ledger["by_pool"]) == set(stages.values())
    for pool in stages.values():
        on_it = [costs[s] for s, p in stages.items() if p == pool]
        assert ledger["by_pool"][pool] == pytest.approx(sum(on_it)), (pool, on_it)


@pytest.mark.parametrize(
    ("spend", "alert"),
    [(0.79, False), (0.8, True), (0.85, True), (0.99, True), (1.2, True), (0.1, False)],
)
def test_the_budget_alert_fires_at_its_fraction_not_only_past_the_budget(
    spend: float, alert: bool
) -> None:
    """alert_fraction 0.8 of a budget of 1: a spend of 0.8 up to the budget already raises
    the alert (what a user sets alert_fraction for); below 0.8 it does not."""
    cfg = Config()
    cfg.cost.budget, cfg.cost.alert_fraction = 1.0, 0.8
    records = [
        {"stage": "prepare", "pool": "cpu", "wall_s": 10.0, "cost": spend / 2},
        {"stage": "pretrain", "pool": "gpu-h100", "wall_s": 10.0, "cost": spend / 2},
    ]
    ledger = cost_ledger(cfg, records)
    assert ledger["budget_used"] == pytest.approx(spend)
    assert ledger["budget_alert"] is alert, ledger


def test_each_phase_is_billed_by_value_on_a_known_schedule() -> None:
    """Loss falls 0.05 a step to step 60 then sits at 5.00-5.02; cost is 0.01 a step. Warm-up
    is steps 0-20 (0.20), convergence 20-60 (0.40), plateau 60-100 (0.40): each phase by its
    own value, not by a sum that holds whatever the split."""
    rows = [
        {"step": s, "loss": 8 - s * 0.05 if s < 60 else 5.0 + (s % 3) * 0.01, "cost": s * 0.01}
        for s in range(10, 101, 10)
    ]
    phases = phase_costs(rows, warmup_steps=20)
    assert phases["plateau_from_step"] == 60
    assert phases["warm-up"] == pytest.approx(0.2)
    assert phases["convergence"] == pytest.approx(0.4)
    assert phases["plateau"] == pytest.approx(0.4)
    # A schedule still falling at the end: no plateau, all after warm-up is convergence.
    falling = [{"step": s, "loss": 8 - s * 0.05, "cost": s * 0.01} for s in range(10, 101, 10)]
    phases = phase_costs(falling, warmup_steps=20)
    assert phases["convergence"] == pytest.approx(0.8) and phases["plateau"] == 0.0
    assert phase_costs([], 10) == {}


def test_a_multi_node_stage_is_billed_for_every_machine(tmp_path: Path) -> None:
    """The lineage price, the trainer's budget and reports/cost.json all count each of the
    stage's machines."""
    from tasks.lineage import StageRecord
    from tasks.training import stage_price

    cfg = Config()
    cfg.pretrain.nodes = 4
    pool = cfg.pools.definitions[cfg.pools.stages["pretrain"]]
    assert pool.rate > 0
    assert stage_price(cfg, "pretrain") == pytest.approx(4 * pool.rate)  # the trainer's Budget
    record = StageRecord(cfg, "pretrain", tmp_path).build({}, {}, compute_s=3600.0)
    assert record["machines"] == 4 and record["price_per_hour"] == pytest.approx(4 * pool.rate)
    assert record["cost"] == pytest.approx(4 * pool.rate, rel=1e-4)  # one hour of 4 machines
    ledger = cost_ledger(cfg, [record])
    assert ledger["by_stage"]["pretrain"]["cost"] == pytest.approx(4 * pool.rate, rel=1e-4)
    top = max(p.rate for p in cfg.pools.definitions.values())
    # the same hour on the dearest pool also rents 4 machines
    assert ledger["all_on_pool"]["cost"] == pytest.approx(4 * top * record["wall_s"] / 3600)


def test_storage_and_chart(tmp_path: Path) -> None:
    cfg = Config()
    s = storage_costs(cfg, 2_000_000_000, 1_000_000_000)
    assert s["storage_per_month"] == pytest.approx(2 * cfg.cost.storage_per_gb_month)
    assert s["transfer"] == pytest.approx(cfg.cost.egress_per_gb)
    ledger = cost_ledger(cfg, _records(), {"pretrain": [[0.5, 0.5]]})
    png = plot_cost(ledger, tmp_path / "cost.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_interruptions_and_spot_prices_reach_the_record_and_the_bill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage that survived an interruption bills the lost attempt's machine time and says
    what the interruption cost; a spot pool is billed at its spot price."""
    from tasks.lineage import StageRecord

    monkeypatch.chdir(tmp_path)
    cfg = Config()
    h100 = cfg.pools.definitions["gpu-h100"]
    h100.pricing = "spot"
    lost = {"steps_lost": 7, "lost_s": 30.0, "billed_lost_s": 17.0}
    resilience = {
        "attempts": 2,
        "interruptions": [lost],
        "steps_lost": 7,
        "lost_s": 30.0,
        "billed_lost_s": 17.0,
        "lost_attempts_s": 42.0,
        "goodput": 0.6,
    }
    rec = StageRecord(cfg, "pretrain", tmp_path)
    rec.t0 -= 100.0  # this attempt ran 100 s; the lost one ran 42 s before it
    resilience["lost_spans"] = [[rec.t0 - 50.0, rec.t0 - 8.0]]
    # compute_s holds the kept training time of both attempts: not billed on top
    r = rec.build({}, {}, {"resilience": resilience}, compute_s=130.0)
    assert r["pricing"] == "spot" and r["price_per_hour"] == h100.spot_price_per_hour
    assert r["wall_s"] == pytest.approx(142.0, abs=0.5)
    assert r["cost"] == pytest.approx(142.0 / 3600 * h100.spot_price_per_hour, rel=0.01)
    i = r["interruptions"]
    assert (i["count"], i["steps_lost"], i["goodput"]) == (1, 7, 0.6)
    assert i["cost"] == pytest.approx(17.0 / 3600 * h100.spot_price_per_hour, abs=1e-6)
    ledger = cost_ledger(cfg, [*_records()[:1], r])
    assert ledger["by_stage"]["pretrain"]["interruptions"] == 1
    assert ledger["interruptions"] == {"count": 1, "cost": i["cost"], "lost_s": 30.0}


def test_a_retry_inside_the_flow_run_is_not_billed_twice(tmp_path: Path) -> None:
    """A task retry in the same process: the lost attempt lies inside this flow run's wall
    time, which is all the bill counts."""
    from tasks.lineage import StageRecord

    cfg = Config()
    rec = StageRecord(cfg, "pretrain", tmp_path)
    rec.t0 -= 100.0
    resilience = {
        "attempts": 2,
        "interruptions": [{"steps_lost": 1, "lost_s": 5.0, "billed_lost_s": 5.0}],
        "lost_spans": [[rec.t0 + 10.0, rec.t0 + 40.0]],
        "billed_lost_s": 5.0,
        "goodput": 0.9,
    }
    r = rec.build({}, {}, {"resilience": resilience}, compute_s=95.0)
    assert r["wall_s"] == pytest.approx(100.0, abs=0.5)
    assert r["interruptions"]["lost_attempts_s"] == 0.0
