"""Training across nodes: a Kubernetes Indexed Job of `nodes` pods, joined by torchrun's c10d
rendezvous, with everything a node needs coming through the object store.

What the launch creates (the Job's manifests) and the cluster API it goes through are in
tasks/cluster.py, with why an Indexed Job: any pod that fails fails the Job, and the stage's
Prefect retry launches a new Job that resumes from the newest checkpoint, on whatever
machines the cluster gives it.

What travels, and how (all verified by sha256, tasks/storage.push_files/pull_files):
- the job description (stage, resolved params, the dataset receipt): a ConfigMap mounted
  at /etc/moe;
- the data: every node downloads the published archive from the receipt, as a
  single-machine stage does;
- the model a finetune stage starts from: uploaded by the flow run to multinode/<job>/init;
- checkpoints: the process that writes them (global rank 0) mirrors the checkpoint folder to
  checkpoints/<run key>/mirror after every save; every node restores the mirror before it
  starts, so a new set of machines (or another node count) resumes where the last one
  stopped;
- the result: the node that held rank 0 uploads the final model, its metrics and the
  result to multinode/<job>/out, which the flow run fetches into the stage's folder with
  the checkpoint mirror.

The flow run launches the Job, follows it (state changes and the newest mirrored step in
its log), and deletes it if the flow run is cancelled, so no node keeps billing; a Job that
ended (done or failed: its pods have stopped) is kept for its logs, its Service and
ConfigMap removed.
If the flow run's own machine dies, the Job keeps training; the recovered flow run finds it
by its run-key label and follows it instead of launching a second one.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.checkpoint.layout import step_of
from moe.train.report import TrainResult
from tasks.cluster import (
    MOUNT,
    RUN_LABEL,
    Cluster,
    JobState,
    NodeJob,
    job_name,
    manifests,
    open_cluster,
    pool_image,
)
from tasks.config import Config, load_config
from tasks.storage import ObjectStore, open_store, pull_files, push_files

log = logging.getLogger("tasks.multinode")  # also when run as __main__ (a pod)

MODEL_FILES = ("model.safetensors", "model.json")
OUT_FILES = (*MODEL_FILES, "metrics.jsonl", "metrics.csv", ".dist/result.json")


def mirror_prefix(run_key: str) -> str:
    return f"checkpoints/{run_key}/mirror"


# ------------------------------------------------------------------------- checkpoints


def sync_checkpoints(
    store: ObjectStore, root: Path, run_key: str, digests: dict | None = None
) -> dict[str, Any]:
    """Mirror the checkpoint folder (every finished file; the journal too) to the store."""
    files = {
        p.relative_to(root).as_posix(): p
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }
    return push_files(
        store, mirror_prefix(run_key), files, {"run_key": run_key}, digests, addressed=True
    )


def share_object(store: ObjectStore, run_key: str, path: Path, digest: str) -> str:
    """Put one file of a sharded checkpoint among the mirror's content-addressed objects
    (once: an object never changes); returns its key, which the checkpoint's manifest keeps."""
    key = f"{mirror_prefix(run_key)}/objects/{digest}"
    if not store.exists(key):
        store.put(path, key)
    return key


def restore_checkpoints(store: ObjectStore, root: Path, run_key: str) -> int:
    """Fetch the mirrored checkpoints of `run_key` into `root` (none yet: nothing to do)."""
    if not store.exists(f"{mirror_prefix(run_key)}/manifest.json"):
        return 0
    return pull_files(store, mirror_prefix(run_key), root, "")


def newest_mirrored_step(store: ObjectStore, run_key: str) -> int | None:
    if not store.exists(f"{mirror_prefix(run_key)}/manifest.json"):
        return None
    files = json.loads(store.read_text(f"{mirror_prefix(run_key)}/manifest.json"))["files"]
    steps = [step_of(k.split("/")[0]) for k in files]
    return max((s for s in steps if s is not None), default=None)


# ------------------------------------------------------------------------- one node


def node_main(job_file: Path) -> int:
    """One pod: fetch the data, the start model and the checkpoints; run this node's share
    of torchrun (c10d rendezvous at pod 0); the node that held rank 0 uploads the result."""
    from tasks.archive import download_dataset

    spec = NodeJob(**json.loads(job_file.read_text()))
    cfg = load_config(params=spec.params)
    store = open_store(cfg.storage)
    index = os.environ.get("JOB_COMPLETION_INDEX", "?")
    t0 = time.time()
    data_dir = download_dataset.fn(cfg, spec.receipt)
    init_dir = Path("models") / spec.init if spec.init else None
    if init_dir is not None:
        pull_files(store, f"{spec.prefix}/init", init_dir, "the launcher did not upload it")
    out_dir = Path("models") / spec.stage
    restored = restore_checkpoints(store, out_dir / "checkpoints", spec.run_key)
    log.info(
        "node %s of %s: data, model and %d checkpoint files fetched in %.1f s",
        index,
        spec.job,
        restored,
        time.time() - t0,
    )
    work = out_dir / ".dist"
    work.mkdir(parents=True, exist_ok=True)
    cfg.dump(work / "params.yaml")
    (work / "result.json").unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--nproc_per_node={spec.nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={spec.rdzv_endpoint}",
        f"--rdzv_id={spec.job}",
        # pod 0 hosts the rendezvous store (its name is the endpoint)
        f"--rdzv_conf=join_timeout={spec.join_timeout_s}"
        + (f",is_host={int(index == '0')}" if index != "?" else ""),
        "--max_restarts=0",  # a node that fails fails the Job; the retry is Prefect's
        "-m",
        "tasks.dist_entry",
        spec.stage,
        str(work / "params.yaml"),
        str(data_dir),
        str(out_dir),
        str(init_dir or ""),
        spec.pairs_file,
        str(spec.budget_left),
    ]
    env = {
        **os.environ,
        "MOE_ATTEMPT_STARTED": str(spec.started),
        "MOE_CHECKPOINT_MIRROR": spec.run_key,  # rank 0 mirrors each checkpoint it saves
    }
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0:
        log.error("node %s: torchrun exited with %d", index, rc)
        return rc
    if (work / "result.json").is_file():  # this node held global rank 0: it has the outputs
        sync_checkpoints(store, out_dir / "checkpoints", spec.run_key)
        files = {name: out_dir / name for name in OUT_FILES if (out_dir / name).is_file()}
        push_files(store, f"{spec.prefix}/out", files, {"job": spec.job})
        log.info("node %s: outputs of %s uploaded to %s", index, spec.job, store.uri)
    return 0


# ------------------------------------------------------------------------- the flow run's side


def run_on_cluster(
    cfg: Config,
    stage: str,
    receipt: dict[str, Any],
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    init_dir: Path | None = None,
    pairs_file: str = "",
    budget_left: float = 0.0,
    cluster: Cluster | None = None,
    image: str = "",
) -> TrainResult:
    """Launch `stage` as an Indexed Job of `nodes` pods, follow it to the end, and bring its
    result, model, metrics and checkpoints into out_dir. A failed Job raises (the task's
    retry launches a new one, which resumes from the mirrored checkpoints)."""
    from moe.recipes.fit import training_fingerprint
    from tasks.events import row_events
    from tasks.runs import replay_metrics

    m = cfg.multinode
    cluster = cluster or open_cluster()
    store = open_store(cfg.storage)
    fingerprint = training_fingerprint(cfg, stage, data_dir, init_dir)
    run_key = f"{stage}/{fingerprint[:16]}"
    labels = {RUN_LABEL: run_key.replace("/", ".")}
    running = cluster.running_jobs(m.namespace, labels)
    if running:  # the flow run before this one died; its Job did not
        job, nodes = running[0], None
        log.info("%s: following the Job %s that is still training it", stage, job)
    else:
        job = job_name(stage, fingerprint)
        spec = NodeJob(
            job=job,
            stage=stage,
            run_key=run_key,
            params=cfg.to_dict(),
            receipt=receipt,
            nodes=getattr(cfg, stage).nodes,
            nproc=cfg.processes(stage),
            rdzv_endpoint=f"{job}-0.{job}:{m.rdzv_port}",
            join_timeout_s=m.join_timeout_s,
            init=init_dir.name if init_dir is not None else "",
            pairs_file=pairs_file,
            budget_left=budget_left,
        )
        _launch(cfg, spec, cluster, store, init_dir, image)
        nodes = spec.nodes
    state = _follow_to_end(cluster, store, m, job, run_key, stage, nodes)
    if not state.complete:
        raise RuntimeError(
            f"{stage}: Job {job} failed ({state.reason or f'{state.failed} pod(s) failed'}); "
            f"its pods' logs: kubectl -n {m.namespace} logs -l moe-pipeline/job={job}. "
            f"A retry launches a new Job that resumes from {store.uri}/{mirror_prefix(run_key)}"
        )
    pull_files(store, f"multinode/{job}/out", out_dir, f"Job {job} ended without its outputs")
    restore_checkpoints(store, out_dir / "checkpoints", run_key)
    result = TrainResult(**json.loads((out_dir / ".dist" / "result.json").read_text()))
    replay_metrics(out_dir, log_fn, row_events(cfg, stage))
    return result


def _launch(
    cfg: Config,
    spec: NodeJob,
    cluster: Cluster,
    store: ObjectStore,
    init_dir: Path | None,
    image: str,
) -> None:
    """Upload the start model (if any) and create the Job's manifests: in the commit's
    image of the stage's pool unless `image` names one."""
    m = cfg.multinode
    commit = os.environ.get("MOE_CODE_COMMIT", "")
    pool = cfg.pool_of(spec.stage)[1]
    assert pool is not None  # the config check makes sure
    image = image or pool_image(pool, commit if commit not in ("", "unknown") else "")
    if init_dir is not None:
        push_files(store, f"{spec.prefix}/init", {n: init_dir / n for n in MODEL_FILES})
    try:
        for manifest in manifests(cfg, spec, image):
            cluster.create(manifest)
    except Exception:  # RBAC, quota: leave nothing half-made behind
        _clean_up(cluster, m.namespace, spec.job, ("Job", "Service", "ConfigMap"))
        raise
    log.info(
        "%s: launched Job %s in %s: %d nodes x %d processes, image %s",
        spec.stage,
        spec.job,
        m.namespace,
        spec.nodes,
        spec.nproc,
        image,
    )


def _follow_to_end(
    cluster: Cluster,
    store: ObjectStore,
    m: Any,
    job: str,
    run_key: str,
    stage: str,
    nodes: int | None,
) -> JobState:
    """`_follow` the Job; then delete what it no longer needs. If the flow run ends first:
    cancelled, the Job too (its machines bill); else (this machine is going away) nothing,
    and the stage's next flow run follows the Job."""
    finished = False
    try:
        state = _follow(cluster, store, m, job, run_key, stage, nodes)
        finished = True
    finally:
        if finished or _cancelled():
            if not finished:  # the user cancelled the stage: stop the nodes, they bill
                log.warning("%s: the flow run was cancelled: deleting Job %s", stage, job)
            kinds = ("Service", "ConfigMap") if finished else ("Job", "Service", "ConfigMap")
            _clean_up(cluster, m.namespace, job, kinds)
        else:  # this machine is going away (evicted, preempted): the Job trains on
            log.warning(
                "%s: this flow run is ending; Job %s trains on, and the stage's next flow run "
                "follows it (or: kubectl -n %s delete job,service,configmap %s)",
                stage,
                job,
                m.namespace,
                job,
            )
    return state


def _follow(
    cluster: Cluster,
    store: ObjectStore,
    m: Any,
    job: str,
    run_key: str,
    stage: str,
    nodes: int | None,
) -> JobState:
    """Poll the Job until it succeeds or fails; log its pods and newest checkpoint on change.
    A read that fails (the API server or the store briefly away) is retried, 5 in a row at
    most. A Job whose `nodes` pods are not all running within join_timeout_s (no machine
    free, an image that cannot be pulled) is failed rather than waited on forever."""
    seen: tuple[int, int, int, int | None] | None = None
    t0 = time.time()
    all_up, errors = nodes is None, 0
    while True:
        try:
            state = cluster.job_state(m.namespace, job)
            step = newest_mirrored_step(store, run_key)
            errors = 0
        except Exception as e:  # noqa: BLE001 - retried; the fifth in a row is raised
            errors += 1
            if errors >= 5:
                raise
            log.warning("%s: reading Job %s failed (%s); retrying", stage, job, e)
            time.sleep(m.poll_s)
            continue
        now = (state.active, state.succeeded, state.failed, step)
        if now != seen:
            log.info(
                "%s: Job %s after %.0f s: %d pods running, %d done, %d failed; newest "
                "checkpoint: %s",
                stage,
                job,
                time.time() - t0,
                *now[:3],
                f"step {step}" if step is not None else "none yet",
            )
            seen = now
        if state.complete or state.reason:
            return state
        all_up = all_up or state.ready + state.succeeded >= (nodes or 0)
        if not all_up and time.time() - t0 > m.join_timeout_s:
            cluster.delete("Job", m.namespace, job)
            return JobState(
                state.active,
                state.succeeded,
                state.failed,
                False,
                f"only {state.ready} of {nodes} pods running after {m.join_timeout_s} s "
                f"(multinode.join_timeout_s): no free machines of the pool, or an image the "
                f"nodes cannot pull (kubectl -n {m.namespace} describe pods -l "
                f"moe-pipeline/job={job})",
            )
        time.sleep(m.poll_s)


def _clean_up(cluster: Cluster, namespace: str, job: str, kinds: tuple[str, ...]) -> None:
    for kind in kinds:
        try:
            cluster.delete(kind, namespace, job)
        except Exception as e:  # noqa: BLE001 - what failed first is what the user needs
            log.warning("could not delete %s %s: %s (delete it with kubectl)", kind, job, e)


def _cancelled() -> bool:
    """Whether this flow run is being cancelled (outside a flow run, or unknown: no)."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.runtime import flow_run

        run_id = flow_run.get_id()
        if not run_id:
            return False
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
        return state is not None and state.type.value in ("CANCELLING", "CANCELLED")
    except Exception:  # noqa: BLE001 - the API is away: assume not, the Job trains on
        return False


def main(argv: list[str]) -> int:
    if argv[:1] != ["node"]:
        print("usage: python -m tasks.multinode node   (inside a pod; reads $MOE_NODE_JOB)")
        return 2
    import tasks

    tasks.offline_defaults()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return node_main(Path(os.environ.get("MOE_NODE_JOB", f"{MOUNT}/job.json")))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
