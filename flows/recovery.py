"""A stage whose machine vanished is noticed, marked Crashed and run again, by Prefect itself.

Three pieces of Prefect's own machinery, no supervisor of ours:

1. **Heartbeats.** A flow run's engine sends `prefect.flow-run.heartbeat` every
   `recovery.heartbeat_s` (workers get PREFECT_FLOWS_HEARTBEAT_FREQUENCY; `stack up` sets it).
2. **Detect** (automation `DETECT`): a run whose heartbeat is not followed by another one, or
   by a final state, within `recovery.crashed_after_s` is set to Crashed. (A flow-run process
   that dies under a live worker is marked Crashed by the worker itself; a machine that
   vanishes, worker and all, only stops its heartbeats.)
3. **Recover** (automation `RECOVER`): a stage run (deployment tag `moe-stage`) that enters
   Crashed starts the `recover` deployment on the cpu pool with the crashed run's id. The
   `recover` flow below starts the stage's deployment again with the same parameters (the same
   hand-off key and resolved params), tagged `moe-recovery` and `recovers:<crashed id>`
   (the link the UI shows), after a back-off, unless the stage has used up its attempts.
   The new run lands on whatever worker of the pool is alive, and training resumes from the
   newest verified checkpoint (moe/train/trainer.py).

The pipeline flow (dispatch: deployments) that waits for a stage follows the chain of
recovery runs (`follow`) instead of failing on the first Crashed state.

`install()` creates both automations on a server (`stack up` calls it; on your own server or
Prefect Cloud: `moe-pipeline recovery install`).
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

from prefect import flow

import tasks
from tasks import events
from tasks.config import RecoveryConfig, load_config
from tasks.events import emit
from tasks.pools import STAGES

log = logging.getLogger("flows.recovery")  # by name: a deployment loads this file as a script
tasks.offline_defaults()  # as a script it is loaded without the flows package

DETECT = "moe-pipeline: crash runs whose heartbeats stopped"
RECOVER = "moe-pipeline: run crashed stages again"
STAGE_TAG = "moe-stage"  # on every stage deployment (prefect.yaml): what RECOVER watches
RECOVERY_TAG = "moe-recovery"
LINK = "recovers:"  # tag prefix on a recovery run: the id of the run it replaces
GAVE_UP = "recovery:gave-up"  # tag on a crashed run that will not be recovered
# How long the pipeline waits for a crashed stage's recovery run to appear (the automation
# and the recover flow on the cpu pool take seconds; more means they are not there).
RECOVERY_WAIT_S = 300


def automations(rec: RecoveryConfig, recover_deployment_id: UUID) -> list[Any]:
    """The two automations (prefect.automations.Automation objects, not yet created)."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture

    final = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    detect = Automation(
        name=DETECT,
        description=(
            f"A flow run that sent a heartbeat and then neither another one nor a final state "
            f"for {rec.crashed_after_s} s (heartbeats every {rec.heartbeat_s} s) lost its "
            "machine: it is marked Crashed."
        ),
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *final},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            # only this project's stage runs: a run elsewhere on the server (other heartbeat
            # settings, another project) is none of its business
            match_related={
                "prefect.resource.role": "tag",
                "prefect.resource.id": f"prefect.tag.{STAGE_TAG}",
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=rec.crashed_after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {rec.crashed_after_s} s: its machine is gone",
            )
        ],
    )
    recover = Automation(
        name=RECOVER,
        description="A stage run that crashed is run again by the recover deployment "
        "(same parameters, resumed from its newest checkpoint), with back-off and a cap.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "tag",
                "prefect.resource.id": f"prefect.tag.{STAGE_TAG}",
            },
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            RunDeployment(
                source="selected",
                deployment_id=recover_deployment_id,
                parameters={"crashed": "{{ event.resource.id }}"},
            )
        ],
    )
    return [detect, recover]


def install(client: Any, rec: RecoveryConfig) -> list[str]:
    """Create (or replace) both automations on the server `client` talks to; returns their
    names. Needs the `recover/recover` deployment (prefect.yaml)."""
    from prefect.events.schemas.automations import AutomationCore

    remove(client)
    if not rec.enabled:
        return []
    dep = client.read_deployment_by_name("recover/recover")
    made = []
    for a in automations(rec, dep.id):
        client.create_automation(AutomationCore(**a.model_dump(exclude={"id"})))
        made.append(a.name)
    return made


def remove(client: Any) -> None:
    """Delete both automations (`stack down` does, before it stops the workers: their runs
    end Crashed, and nothing should run them again)."""
    for name in (DETECT, RECOVER):
        for old in client.read_automations_by_name(name):
            client.delete_automation(old.id)


def _uuid(resource_id: str) -> UUID:
    return UUID(resource_id.removeprefix("prefect.flow-run."))


def _link(fr: Any) -> str | None:
    return next((t[len(LINK) :] for t in fr.tags if t.startswith(LINK)), None)


def _progress(client: Any, flow_run_id: UUID) -> float | None:
    """How far a run got: the newest figure of its progress artifact (tasks/progress.py);
    None when it has none (torchrun ranks write no artifact): unknown, not "no progress"."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterType,
        FlowRunFilter,
        FlowRunFilterId,
    )

    arts = client.read_artifacts(
        artifact_filter=ArtifactFilter(type=ArtifactFilterType(any_=["progress"])),
        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
    )
    figures = [float(a.data) for a in arts if isinstance(a.data, (int, float))]
    return max(figures) if figures else None


def _recoveries(client: Any, flow_run_id: UUID) -> list[Any]:
    """The recovery runs started for a crashed run (at most one: see the idempotency key)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    return client.read_flow_runs(
        flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[LINK + str(flow_run_id)]))
    )


def chain(client: Any, flow_run_id: UUID) -> list[Any]:
    """The crashed runs this one replaces, oldest first, ending with this one."""
    runs = [client.read_flow_run(flow_run_id)]
    while (prev := _link(runs[0])) is not None and len(runs) < 1000:
        runs.insert(0, client.read_flow_run(UUID(prev)))
    return runs


def decide(rec: RecoveryConfig, progress: list[float | None]) -> tuple[bool, float, str]:
    """From the progress each crashed attempt reached (oldest first; None = not known):
    recover or not, the back-off in seconds, and why. A crashed attempt that got no further
    than the one before it is "stalled"; `max_stalled` in a row is a crash loop, not bad
    luck. Unknown progress is never counted as stalled (only max_attempts caps it)."""
    attempts = len(progress)
    stalled = 0
    for before, now in zip([None, *progress], progress, strict=False):
        known = before is not None and now is not None
        stalled = stalled + 1 if known and now <= before else 0
    if attempts > rec.max_attempts:
        return False, 0.0, f"{attempts - 1} recoveries used (recovery.max_attempts)"
    if stalled >= rec.max_stalled:
        return (
            False,
            0.0,
            (
                f"the last {stalled} attempts got no further than the one before "
                "(recovery.max_stalled): a crash loop, not a lost machine"
            ),
        )
    delay = min(rec.backoff_max_s, rec.backoff_s * 2**stalled)
    return True, delay, f"attempt {attempts + 1}, after {delay:.0f} s"


@flow(name="recover", log_prints=True)
def recover(crashed: str) -> dict[str, Any]:
    """Run a crashed stage's deployment again (started by the RECOVER automation with the
    crashed flow run's resource id)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    crashed_id = _uuid(crashed)
    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(crashed_id)
        if fr.state is None or not fr.state.is_crashed():
            return {
                "recovered": False,
                "why": f"flow run {fr.name} is {fr.state_name}, not Crashed",
            }
        if fr.deployment_id is None:
            return {"recovered": False, "why": "not a deployment run"}
        dep = client.read_deployment(fr.deployment_id)
        if dep.name not in STAGES:
            return {"recovered": False, "why": f"deployment {dep.name} is not a stage"}
        params = dict(fr.parameters or {})
        done = _recoveries(client, crashed_id)
        if done:  # the automation fired again for the same crash: nothing more to start
            log.info("flow run %s already has its recovery run %s", fr.name, done[0].name)
            return {"recovered": True, "flow_run_id": str(done[0].id), "why": "already recovered"}
        cfg = load_config(
            params.get("params_file"), params.get("overrides") or [], params.get("params")
        )
        rec = cfg.recovery
        runs = chain(client, crashed_id)
        progress = [_progress(client, r.id) for r in runs]
        ok, delay, why = decide(rec, progress)
        about = (str(fr.id), fr.name)
        if not ok:
            client.update_flow_run(crashed_id, tags=[*fr.tags, GAVE_UP])
            log.error("stage %s (flow run %s) is not recovered: %s", dep.name, fr.name, why)
            emit(
                events.GAVE_UP,
                cfg,
                dep.name,
                f"stage {dep.name} is not recovered: {why}",
                flow_run=about,
                once=str(fr.id),
                attempts=len(runs),
                progress=progress[-1],
            )
            return {"recovered": False, "why": why}
        when = datetime.now(UTC) + timedelta(seconds=delay)
        new = client.create_flow_run_from_deployment(
            dep.id,
            parameters=params,
            state=Scheduled(scheduled_time=when),
            name=f"{fr.name}-r{len(runs)}",
            tags=[t for t in fr.tags if not t.startswith(LINK)] + [RECOVERY_TAG, LINK + str(fr.id)],
            idempotency_key=f"recovery-of-{fr.id}",  # the automation firing twice runs it once
        )
        log.warning(
            "stage %s lost flow run %s; recovery run %s (%s) starts in %.0f s on pool %s",
            dep.name,
            fr.name,
            new.name,
            why,
            delay,
            dep.work_pool_name,
        )
        emit(
            events.RECOVERED,
            cfg,
            dep.name,
            f"stage {dep.name} lost its machine; recovery run {new.name} starts in {delay:.0f} s",
            flow_run=about,
            once=str(fr.id),
            recovery_flow_run_id=str(new.id),
            attempt=len(runs) + 1,
            delay_s=delay,
            progress=progress[-1],
        )
        return {"recovered": True, "flow_run_id": str(new.id), "delay_s": delay, "why": why}


def follow(client: Any, fr: Any, wait_s: float, poll_s: float = 1.0) -> Any:
    """A stage run that ended Crashed: wait for its recovery run (the RECOVER automation
    starts one within seconds, unless the stage used up its attempts) and for that run's end;
    repeat. Returns the last run of the chain. Gives up on a run with no recovery after
    `wait_s` seconds, or at once when it is tagged as given up."""
    while fr.state is not None and fr.state.is_crashed():
        deadline = time.monotonic() + wait_s
        nxt = None
        while nxt is None:
            found = _recoveries(client, fr.id)
            if found:
                nxt = found[0]
                break
            fr = client.read_flow_run(fr.id)
            if GAVE_UP in fr.tags or time.monotonic() > deadline:
                return fr
            time.sleep(poll_s)
        log.warning("stage run %s crashed; following its recovery run %s", fr.name, nxt.name)
        while not (nxt.state is not None and nxt.state.is_final()):
            time.sleep(poll_s)
            nxt = client.read_flow_run(nxt.id)
        fr = nxt
    return fr
