"""What the deployments on a server need beyond prefect.yaml, set by `stack up` and by
`moe-pipeline deployments configure` on a server of one's own:

- **The run form filled in.** Each stage deployment's and the pipeline's default `params` is
  the project's resolved configuration, so the UI's custom-run form opens with every field
  (tasks/form.py) rather than an empty "None"; the pipeline's `stages` default to all.
- **Alerts.** `alert_automation` routes the pipeline's events (tasks/events.py) to a
  notification block (Slack, e-mail, a webhook): the budget alert by default.
"""

from __future__ import annotations

from typing import Any

from tasks.config import Config
from tasks.events import BUDGET_ALERT
from tasks.pools import STAGES

ALERT = "moe-pipeline: notify on the budget alert"


def set_form_defaults(
    client: Any, cfg: Config, pipeline: dict[str, Any] | None = None
) -> list[str]:
    """Set the default parameters of the stage deployments and the pipeline's (plus
    `pipeline`, e.g. dispatch and overrides); returns the deployments changed."""
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.exceptions import ObjectNotFound

    params = cfg.to_dict()
    changed = []
    for name in (*STAGES, "pipeline"):
        try:
            dep = client.read_deployment_by_name(f"{name}/{name}")
        except ObjectNotFound:
            continue
        values = {**(dep.parameters or {}), "params": params}
        if name == "pipeline":
            values.update(stages=list(STAGES), **(pipeline or {}))
        client.update_deployment(dep.id, DeploymentUpdate(parameters=values))
        changed.append(f"{name}/{name}")
    return changed


def alert_automation(block_id: Any, events: tuple[str, ...] = (BUDGET_ALERT,)) -> Any:
    """An automation that sends each of `events` to the notification block `block_id`, with
    the stage, pool, cost and message of the event (a prefect.automations.Automation)."""
    from prefect.automations import Automation
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import EventTrigger, Posture

    body = (
        "{{ event.event }}: {{ event.payload.message }}\n"
        "stage {{ event.payload.stage }} on pool {{ event.payload.pool }}, "
        "cost so far {{ event.payload.cost }} {{ event.payload.currency }}\n"
        "flow run {{ event.resource['prefect.resource.name'] }}"
    )
    return Automation(
        name=ALERT,
        description=f"The pipeline's {', '.join(events)} (tasks/events.py) sent to a "
        "notification block with the stage, pool and cost.",
        trigger=EventTrigger(
            expect=set(events),
            match={"prefect.resource.id": "prefect.flow-run.*"},
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            SendNotification(
                block_document_id=block_id,
                subject="moe-pipeline: {{ event.event }} ({{ event.payload.stage }})",
                body=body,
            )
        ],
    )


def install_alert(client: Any, block_id: Any, events: tuple[str, ...] = (BUDGET_ALERT,)) -> str:
    """Create (or replace) the alert automation on the server `client` talks to."""
    from prefect.events.schemas.automations import AutomationCore

    for old in client.read_automations_by_name(ALERT):
        client.delete_automation(old.id)
    a = alert_automation(block_id, events)
    client.create_automation(AutomationCore(**a.model_dump(exclude={"id"})))
    return a.name
