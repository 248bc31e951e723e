"""The bill: per stage, pool and phase, with storage and transfer, from the lineage records.

The evaluate stage sums the stages' records (each priced at its pool's rate for its wall
time) into `reports/cost.json`; `phase_costs` splits a training stage's cost by phase from
its metrics rows, and `storage_costs` prices what is kept and moved.
"""

from __future__ import annotations

import logging
from typing import Any

from tasks.config import Config

log = logging.getLogger(__name__)


def cost_ledger(
    cfg: Config,
    records: list[dict[str, Any]],
    expert_shares: dict[str, list[list[float]] | None] | None = None,
) -> dict[str, Any]:
    """Sum stage records into a bill per stage, per pool and per expert, with a budget check.

    Per expert: each training stage's cost is split over experts by the
    share of routed tokens each took in that stage, averaged over MoE layers. NOTE: this
    attributes attention and dense compute to experts in proportion too; it answers "which
    experts is the money flowing through", not "what did the expert FLOPs cost".
    """
    by_stage = {
        r["stage"]: {"pool": r["pool"], "wall_s": r["wall_s"], "cost": r["cost"]} for r in records
    }
    for r in records:  # what preemptions cost each stage (included in its cost)
        if r.get("interruptions", {}).get("count"):
            i = r["interruptions"]
            by_stage[r["stage"]].update(
                interruptions=i["count"], interruption_cost=i["cost"], goodput=i["goodput"]
            )
    by_pool: dict[str, float] = {}
    for r in records:
        by_pool[r["pool"]] = round(by_pool.get(r["pool"], 0.0) + r["cost"], 6)
    total = round(sum(r["cost"] for r in records), 6)
    ledger: dict[str, Any] = {
        "currency": cfg.cost.currency,
        "total": total,
        "by_stage": by_stage,
        "by_pool": by_pool,
        "budget": cfg.cost.budget,
    }
    if cfg.cost.budget > 0:
        used = total / cfg.cost.budget
        ledger["budget_used"] = round(used, 4)
        ledger["budget_alert"] = used >= cfg.cost.alert_fraction
        if ledger["budget_alert"]:
            log.warning(
                "spend %.4f %s is %.0f%% of the budget %.2f",
                total,
                cfg.cost.currency,
                100 * used,
                cfg.cost.budget,
            )
    by_expert: dict[str, float] = {}
    for stage, share in (expert_shares or {}).items():
        if not share or stage not in by_stage:
            continue
        for e in range(len(share[0])):
            frac = sum(layer[e] for layer in share) / len(share)
            key = f"expert_{e}"
            by_expert[key] = round(by_expert.get(key, 0.0) + frac * by_stage[stage]["cost"], 6)
    if by_expert:
        ledger["by_expert"] = by_expert
    # The saving of this placement against running every stage on the dearest pool.
    pools = cfg.pools.definitions
    top = max(pools, key=lambda n: pools[n].rate)
    # every machine a record paid for (a multi-node stage rents `machines` of them)
    all_top = sum(r["wall_s"] * r.get("machines", 1) for r in records) / 3600 * pools[top].rate
    ledger["all_on_pool"] = {"pool": top, "cost": round(all_top, 6)}
    ledger["saving"] = round(all_top - total, 6)
    ledger["saving_fraction"] = round(1 - total / all_top, 4) if all_top > 0 else 0.0
    lost = [r["interruptions"] for r in records if r.get("interruptions", {}).get("count")]
    ledger["interruptions"] = {
        "count": sum(i["count"] for i in lost),
        "cost": round(sum(i["cost"] for i in lost), 6),
        "lost_s": round(sum(i["lost_s"] for i in lost), 3),
    }
    return ledger


def phase_costs(rows: list[dict[str, Any]], warmup_steps: int) -> dict[str, float]:
    """Split a training stage's compute cost into three phases from its metrics rows
    (each logged row carries the cumulative `cost`): warm-up (lr warm-up steps), plateau
    (from the first logged step whose loss is within 2% of the final loss and never leaves
    that band again), and convergence in between."""
    logged = [r for r in rows if "loss" in r and "cost" in r]
    if not logged:
        return {}
    final = logged[-1]["loss"]
    plateau_from = logged[-1]["step"]
    for r in reversed(logged):
        if abs(r["loss"] - final) <= 0.02 * abs(final):
            plateau_from = r["step"]
        else:
            break

    def cost_at(step: int) -> float:
        before = [r["cost"] for r in logged if r["step"] <= step]
        return before[-1] if before else 0.0

    total = logged[-1]["cost"]
    warm = cost_at(warmup_steps)
    plateau_start = max(cost_at(plateau_from), warm)
    return {
        "warm-up": round(warm, 6),
        "convergence": round(plateau_start - warm, 6),
        "plateau": round(total - plateau_start, 6),
        "plateau_from_step": plateau_from,
    }


def storage_costs(cfg: Config, stored_bytes: int, transferred_bytes: int) -> dict[str, float]:
    """A month of storage for what the run keeps, and the transfer it caused, at the
    `cost` section's rates."""
    gb = 1e9
    return {
        "stored_gb": round(stored_bytes / gb, 4),
        "storage_per_month": round(stored_bytes / gb * cfg.cost.storage_per_gb_month, 6),
        "transferred_gb": round(transferred_bytes / gb, 4),
        "transfer": round(transferred_bytes / gb * cfg.cost.egress_per_gb, 6),
    }
