"""The pipeline's alerts as Prefect events, so that a Prefect user routes them (Slack, e-mail,
a pager) with automations, as any other event of theirs.

Every event's resource is the stage's flow run (`prefect.flow-run.<id>`, what the UI links
to), labelled with the stage and its pool; the payload holds the stage, the pool, the cost so
far, the currency and a one-line message, plus what the event is about. Outside a flow run
(a test calling a task's function, a torchrun rank: its parent replays its rows) nothing is
emitted. An event that cannot be sent is logged and never stops the work it reports on.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

from tasks.config import Config

log = logging.getLogger(__name__)

BUDGET_ALERT = "moe.budget.alert"  # cost.alert_fraction of a stage's budget spent
BUDGET_STOP = "moe.budget.stop"  # a stage stopped: its share of cost.budget is spent
EARLY_STOP = "moe.training.stopped-early"  # validation stopped improving, or a time budget
RECOVERED = "moe.recovery.started"  # a lost stage's run is run again
GAVE_UP = "moe.recovery.gave-up"  # recovery.max_attempts or max_stalled: a human looks
STAGE_COMPLETED = "moe.stage.completed"  # with its headline figures and cost
EVENTS = (BUDGET_ALERT, BUDGET_STOP, EARLY_STOP, RECOVERED, GAVE_UP, STAGE_COMPLETED)


def emit(
    event: str,
    cfg: Config,
    stage: str,
    message: str,
    cost: float | None = None,
    flow_run: tuple[str, str] | None = None,
    once: str | None = None,
    **payload: Any,
) -> Any:
    """Emit `event` about `stage` (resource: `flow_run` as (id, name), default the flow run
    this runs in); returns the event, or None when there is no flow run or it was not sent.
    `once` names what the event is about when it may be emitted twice (two runs of the same
    automation): the event's id is derived from it, and the server keeps one."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.events import emit_event
    from prefect.runtime import flow_run as current

    if flow_run is None and FlowRunContext.get() is None and TaskRunContext.get() is None:
        # not in a run (a torchrun rank, a node's pod), even where the worker's
        # PREFECT__FLOW_RUN_ID was inherited: the parent replays its rows, and emits them once
        return None
    run_id, run_name = flow_run or (current.get_id(), current.get_name())
    if not run_id:
        return None
    pool, spec = cfg.pool_of(stage)
    try:
        return emit_event(
            event=event,
            id=uuid.uuid5(uuid.NAMESPACE_URL, f"{event}/{once}") if once else None,
            resource={
                "prefect.resource.id": f"prefect.flow-run.{run_id}",
                "prefect.resource.name": str(run_name or run_id),
                "moe.stage": stage,
                "moe.pool": pool,
            },
            payload={
                "stage": stage,
                "pool": pool,
                "pricing": spec.pricing if spec else "",
                "cost": round(cost, 6) if cost is not None else None,
                "currency": cfg.cost.currency,
                "message": message,
                **payload,
            },
        )
    except Exception as e:  # noqa: BLE001 - an alert that fails must not stop the stage
        log.warning("event %s not sent: %s", event, e)
        return None


def row_events(cfg: Config, stage: str) -> Callable[[dict[str, Any]], None]:
    """A metrics-row listener: the trainer's budget alert and stop rows become events."""

    def on_row(row: dict[str, Any]) -> None:
        if "budget_alert" in row:
            emit(
                BUDGET_ALERT,
                cfg,
                stage,
                row["budget_alert"],
                row.get("cost"),
                step=row.get("step"),
                budget_left=row.get("budget_left"),
                alert_fraction=cfg.cost.alert_fraction,
            )
        elif "early_stop" in row:
            reason = str(row["early_stop"])
            emit(
                BUDGET_STOP if reason.startswith("budget") else EARLY_STOP,
                cfg,
                stage,
                f"stopped at step {row.get('step')}: {reason}",
                row.get("cost"),
                step=row.get("step"),
                reason=reason,
            )

    return on_row
