"""Training across nodes (tasks/multinode.py, tasks/cluster.py): the Indexed Job, Service
and ConfigMap the launcher renders, checked field by field against the Kubernetes API's own
models; and two torchrun "nodes" on 127.0.0.1 joined by the c10d rendezvous, fed through a
real S3 server (moto), run from those manifests by tests/local_cluster.py (Kubernetes itself
cannot run here: no image can be pulled)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch
from safetensors.torch import load_file

from moe.config import ConfigError
from tasks.archive import publish_dataset
from tasks.cluster import MOUNT, NodeJob, manifests
from tasks.config import StorageConfig, load_config
from tasks.multinode import mirror_prefix, newest_mirrored_step, run_on_cluster
from tasks.pools import PoolSpec
from tasks.storage import open_store
from tests.conftest import free_port
from tests.local_cluster import LocalCluster
from tests.test_distributed import torchrun_config


@pytest.fixture(autouse=True)
def _fresh_cluster() -> Any:
    """Every test starts with no Job and leaves no pod running (tests/local_cluster.py)."""
    from tests import local_cluster

    local_cluster.reset()
    yield
    local_cluster.reset()


def _spec(cfg: Any, nodes: int = 2) -> NodeJob:
    return NodeJob(
        job="moe-pretrain-abcdef12-0a1b2c",
        stage="pretrain",
        run_key="pretrain/abcdef1234567890",
        params=cfg.to_dict(),
        receipt={"name": "d", "version": "v"},
        nodes=nodes,
        nproc=4,
        rdzv_endpoint="moe-pretrain-abcdef12-0a1b2c-0.moe-pretrain-abcdef12-0a1b2c:29400",
        join_timeout_s=900,
    )


def _h100_cfg(nodes: int = 2) -> Any:
    cfg = load_config(
        overrides=[
            f"pretrain.nodes={nodes}",
            "pools.definitions.gpu-h100.gpus=4",
            "storage.backend=s3",
            "storage.bucket=bkt",
            "multinode.image_pull_secrets=[regcred]",
            "multinode.deadline_s=86400",
        ]
    )
    return cfg


def _strict(obj: Any, model: str, path: str = "") -> None:
    """Every key of `obj` is a field of the Kubernetes API model `model` (kubernetes_asyncio's
    generated classes carry the API's schema), recursively: a misspelt or misplaced field,
    which the API server would drop or refuse, fails here."""
    from kubernetes_asyncio import client

    if model.startswith("list["):
        assert isinstance(obj, list), path
        for i, item in enumerate(obj):
            _strict(item, model[5:-1], f"{path}[{i}]")
        return
    if model.startswith("dict("):
        assert isinstance(obj, dict), path
        inner = model[5:-1].split(", ", 1)[1]
        for k, v in obj.items():
            _strict(v, inner, f"{path}.{k}")
        return
    cls = getattr(client, model, None)
    if cls is None:  # str, int, bool, object
        return
    assert isinstance(obj, dict), f"{path}: {model} must be a mapping"
    by_json = {v: k for k, v in cls.attribute_map.items()}
    for key, value in obj.items():
        assert key in by_json, f"{path}.{key}: not a field of {model}"
        _strict(value, cls.openapi_types[by_json[key]], f"{path}.{key}")


def test_the_manifests_are_an_indexed_job_the_api_knows() -> None:
    cfg = _h100_cfg()
    spec = _spec(cfg)
    config_map, service, job = manifests(cfg, spec, "registry/moe:abc-gpu")
    _strict(config_map, "V1ConfigMap")
    _strict(service, "V1Service")
    _strict(job, "V1Job")

    # the pods find pod 0 through the headless Service, before any pod is ready
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    pod = job["spec"]["template"]
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == spec.job
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert spec.rdzv_endpoint == f"{spec.job}-0.{spec.job}:{cfg.multinode.rdzv_port}"
    # one pod per node, all at once; one lost node fails the Job (the Prefect retry resumes)
    j = job["spec"]
    assert (j["completionMode"], j["completions"], j["parallelism"], j["backoffLimit"]) == (
        "Indexed",
        2,
        2,
        0,
    )
    assert j["activeDeadlineSeconds"] == 86400
    # each pod is one machine of the stage's pool
    (c,) = pod["spec"]["containers"]
    h100 = cfg.pools.definitions["gpu-h100"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert c["resources"]["requests"] == {
        "cpu": f"{h100.cpu:g}",
        "memory": "128Gi",
        "nvidia.com/gpu": 4,
    }
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": h100.gpu_product}
    shm = [v for v in pod["spec"]["volumes"] if v["name"] == "dshm"][0]["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["image"] == "registry/moe:abc-gpu"
    assert c["command"] == ["python", "-m", "tasks.multinode", "node"]
    assert c["envFrom"] == [{"secretRef": {"name": "moe-credentials", "optional": True}}]
    # the job description is the ConfigMap, mounted where the node entry reads it
    env = {e["name"]: e["value"] for e in c["env"]}
    mount = [m for m in c["volumeMounts"] if m["name"] == "job"][0]
    assert mount["mountPath"] == MOUNT and env["MOE_NODE_JOB"] == f"{MOUNT}/job.json"
    assert NodeJob(**json.loads(config_map["data"]["job.json"])) == spec
    # a CPU pool's pods ask for no GPU and tolerate no GPU taint
    cfg.pools.stages["pretrain"] = "cpu"
    (_, _, cpu_job) = manifests(cfg, spec, "img")
    cpu_pod = cpu_job["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in cpu_pod["containers"][0]["resources"]["limits"]
    assert cpu_pod["tolerations"] == [] and cpu_pod["nodeSelector"] == {}


def test_a_multi_node_stage_is_checked_before_it_launches() -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["pretrain.nodes=2"])  # the default store is a local folder
    assert "pretrain.nodes" in str(e.value) and "storage.backend s3 or hf" in str(e.value)
    with pytest.raises(ConfigError) as e:  # 8 experts over 3 nodes x 1 process
        load_config(overrides=["finetune_sql.nodes=3", "storage.backend=s3", "storage.bucket=bkt"])
    assert "finetune_sql.nproc" in str(e.value) and "3 (3 nodes x 1)" in str(e.value)
    # the bill counts every machine
    cfg = _h100_cfg(nodes=2)
    assert cfg.machines("pretrain") == 2 and cfg.machines("evaluate") == 1
    assert cfg.world("pretrain") == 8


@pytest.mark.slow
def _saves(pod: Path) -> Any:
    return pod.rglob("checkpoints/step_*/manifest.json")


def test_two_nodes_train_like_one_machine_and_resume_on_new_machines(
    tmp_path: Path, moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pretrain.nodes 2 x nproc 1: two pods join at pod 0's rendezvous; each fetches the data
    from S3 on an empty disk. A node's machine dies after the first checkpoint: the Job fails.
    The next launch runs on two new machines, resumes from the mirrored checkpoint, and ends
    with the same weights as one machine running 2 processes without interruption."""
    from tasks.pretraining import pretrain_model
    from tests.test_train import _data

    monkeypatch.chdir(tmp_path)
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="nodes"
    )
    cfg = torchrun_config("cpu")
    cfg.pretrain.max_steps, cfg.pretrain.checkpoint_every, cfg.pretrain.eval_every = 40, 2, 40
    cfg.storage = StorageConfig(backend="s3", bucket="nodes", endpoint_url=moto_server)
    cfg.pools.definitions["cpu-node"] = PoolSpec(price_per_hour=0.1)
    cfg.pools.stages["pretrain"] = "cpu-node"
    cfg.multinode.rdzv_port, cfg.multinode.poll_s = free_port(), 0.2
    receipt = publish_dataset.fn(cfg, _data(tmp_path / "prepared"), tmp_path / "pub").to_dict()
    data = tmp_path / "prepared"

    # the reference: one machine, two processes (standalone torchrun)
    ref = pretrain_model.fn(cfg, data, tmp_path / "one-machine", lambda r: None)
    want = load_file(str(tmp_path / "one-machine" / "model.safetensors"))

    cfg.pretrain.nproc, cfg.pretrain.nodes = 1, 2
    store = open_store(cfg.storage)
    cluster = LocalCluster(tmp_path / "cluster")
    out = tmp_path / "launcher" / "models" / "pretrain"

    def lose_pod_1() -> None:
        """Once a checkpoint is saved, the machine of the node that does not write it dies
        (c10d gives global rank 0, the writer, to either pod). The pods are looked at only
        while both are stopped, so the death lands before step 40 on any machine; then the
        other node is stopped for good, and dies once the writer has mirrored the save."""
        while not LocalCluster.created:
            time.sleep(0.01)
        name = LocalCluster.created[-1]["metadata"]["name"]
        while not cluster.started(name):
            time.sleep(0.01)
        pods = (0, 1)
        while True:
            for i in pods:
                cluster.freeze(name, i)
            saved = [i for i in pods if next(_saves(cluster.pod_dir(name, i)), None)]
            if saved:
                break
            for i in pods:
                cluster.freeze(name, i, frozen=False)
            time.sleep(0.005)
        writer = saved[0]
        cluster.freeze(name, writer, frozen=False)  # the other waits at its next collective
        while newest_mirrored_step(store, run_key()) is None:
            time.sleep(0.05)
        cluster.kill(name, 1 - writer)

    def run_key() -> str:
        return json.loads(LocalCluster.created[0]["data"]["job.json"])["run_key"]

    LocalCluster.created.clear()
    LocalCluster.deleted.clear()
    killer = threading.Thread(target=lose_pod_1, daemon=True)
    killer.start()
    with pytest.raises(RuntimeError, match="failed .*resumes from s3://nodes/"):
        run_on_cluster(cfg, "pretrain", receipt, data, out, lambda r: None, cluster=cluster)
    killer.join(timeout=5)
    first = LocalCluster.created[-1]["metadata"]["name"]
    died_at = newest_mirrored_step(store, run_key())
    assert died_at is not None and died_at < 40, died_at
    # the failed launch cleaned up after itself
    assert {("Service", first), ("ConfigMap", first)} <= set(LocalCluster.deleted)

    rows: list[dict] = []
    result = run_on_cluster(cfg, "pretrain", receipt, data, out, rows.append, cluster=cluster)
    second = LocalCluster.created[-1]["metadata"]["name"]
    assert second != first
    assert result.resumed_from is not None and result.resumed_from >= died_at
    assert result.steps == 40 and ref.steps == 40
    # both nodes of the second Job started on empty disks and fetched what they needed
    for i in (0, 1):
        log = (cluster.pod_dir(second, i) / "pod.log").read_text()
        assert "checkpoint files fetched" in log, log[-2000:]
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the flow run's machine has the result, the metrics and the checkpoints
    assert [r["step"] for r in rows if "loss" in r][-1] == 40
    assert (out / "checkpoints" / "step_00000040" / "manifest.json").is_file()
    assert store.exists(f"{mirror_prefix(run_key())}/manifest.json")
    # Saved sharded, each node its own rank's files: those of the node that did not write the
    # manifest are named where the mirror holds them (no rank gathered the whole state).
    from moe.checkpoint.manifest import Manifest

    m = Manifest.read(out / "checkpoints" / "step_00000040")
    assert m.sharded and {"r000.L0.bin", "r001.L0.bin", "r001.L1.bin"} <= set(m.files)
    assert {n for n in m.locations if n.startswith("r001.")} == {
        n for n in m.files if n.startswith("r001.")
    }
    assert all(
        loc.startswith(f"{mirror_prefix(run_key())}/objects/") for loc in m.locations.values()
    )
    # One process reads it whole, fetching the other node's files from the mirror:
    # `moe-pipeline checkpoint export` on the flow run's machine gives the final weights.
    from flows.cli import main as cli

    exported = tmp_path / "export.safetensors"
    storage = ["storage.backend=s3", "storage.bucket=nodes", f"storage.endpoint_url={moto_server}"]
    sets = [arg for kv in storage for arg in ("--set", kv)]
    assert cli(["checkpoint", "export", str(out), "--out", str(exported), *sets]) == 0
    got = load_file(str(exported))
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_new_flow_run_follows_the_job_its_predecessor_launched(tmp_path: Path) -> None:
    """The flow run's own machine died; its Job did not. The recovered flow run finds that
    Job by its run-key label and follows it instead of launching a second one."""
    from moe.errors import InputError
    from moe.recipes.fit import training_fingerprint
    from tests.test_train import _data

    cfg = torchrun_config("cpu")
    cfg.pretrain.nodes, cfg.pretrain.nproc = 2, 1
    cfg.storage = StorageConfig(backend="local", root=str(tmp_path / "store"))
    cfg.multinode.poll_s = 0.1
    data = _data(tmp_path / "data")
    run_key = f"pretrain/{training_fingerprint(cfg, 'pretrain', data)[:16]}"
    spec = NodeJob("moe-pretrain-orphan", "pretrain", run_key, {}, {}, 2, 1, "x:1", 60)
    cluster = LocalCluster(tmp_path / "cluster")
    config_map, _, job = manifests(cfg, spec, "img")
    pod = job["spec"]["template"]["spec"]["containers"][0]
    # A Job still training: its pods run until the launcher has found and followed it (the
    # first job_state read releases them), so no sleep has to outlast the launcher's setup.
    release = tmp_path / "release"
    pod["command"] = [
        "python",
        "-c",
        f"import os, time\nwhile not os.path.exists({str(release)!r}): time.sleep(0.02)",
    ]
    cluster.create(config_map)
    cluster.create(job)
    LocalCluster.created.clear()
    follow = cluster.job_state

    def job_state(namespace: str, name: str) -> Any:
        release.touch()
        return follow(namespace, name)

    cluster.job_state = job_state  # type: ignore[method-assign]
    with pytest.raises(InputError, match="Job moe-pretrain-orphan ended without its outputs"):
        run_on_cluster(cfg, "pretrain", {}, data, tmp_path / "out", lambda r: None, cluster=cluster)
    assert LocalCluster.created == []  # nothing launched
    assert ("Service", "moe-pretrain-orphan") in LocalCluster.deleted


def test_a_job_whose_pods_never_start_fails_instead_of_waiting(tmp_path: Path) -> None:
    """No free machine, or an image the nodes cannot pull: the pods stay pending. After
    multinode.join_timeout_s the launch fails saying so, and deletes the Job."""
    from tasks.cluster import JobState
    from tasks.multinode import _follow

    class Pending:  # a cluster whose pods never run (a stand-in for the API server)
        deleted: list[str] = []

        def job_state(self, namespace: str, name: str) -> JobState:
            return JobState(active=2, ready=0)

        def delete(self, kind: str, namespace: str, name: str) -> None:
            self.deleted.append(kind)

    cfg = _h100_cfg()
    cfg.multinode.join_timeout_s, cfg.multinode.poll_s = 0, 0.01
    store = open_store(StorageConfig(backend="local", root=str(tmp_path)))
    state = _follow(Pending(), store, cfg.multinode, "moe-x", "pretrain/x", "pretrain", 2)
    assert not state.complete and "only 0 of 2 pods running" in state.reason
    assert Pending.deleted == ["Job"]


class Scripted:
    """A stand-in for the Kubernetes API server (none runs here) that answers job_state
    from a script of states, one per poll, and records what is deleted."""

    def __init__(self, states: list[Any]) -> None:
        self.states, self.deleted = list(states), []

    def job_state(self, namespace: str, name: str) -> Any:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self.deleted.append(kind)


def test_a_job_whose_pods_all_run_outlives_the_join_timeout(tmp_path: Path) -> None:
    """join_timeout_s is how long the pods may take to *start*; once all run, the Job
    trains as long as it needs. The timeout here is 0 s: already past at every poll, so
    only having seen every pod running keeps the Job alive (no wall-clock margin)."""
    from tasks.cluster import JobState
    from tasks.multinode import _follow

    running = JobState(active=2, ready=2)
    cluster = Scripted([running] * 6 + [JobState(succeeded=2, complete=True)])
    cfg = _h100_cfg()
    cfg.multinode.join_timeout_s, cfg.multinode.poll_s = 0, 0.0
    store = open_store(StorageConfig(backend="local", root=str(tmp_path)))
    state = _follow(cluster, store, cfg.multinode, "moe-x", "pretrain/x", "pretrain", 2)
    assert state.complete and cluster.deleted == []


def _launch_config(tmp_path: Path) -> Any:
    cfg = torchrun_config("cpu")
    cfg.pretrain.nodes, cfg.pretrain.nproc = 2, 1
    cfg.storage = StorageConfig(backend="local", root=str(tmp_path / "store"))
    cfg.multinode.poll_s = 0.05
    return cfg


def _sleeping_job(cfg: Any, job: str, run_key: str, seconds: float) -> list[dict[str, Any]]:
    """The ConfigMap and Job of two pods that sleep `seconds` and exit 0, as the launcher
    renders them."""
    spec = NodeJob(job, run_key.split("/")[0], run_key, {}, {}, 2, 1, "x:1", 60)
    config_map, _, manifest = manifests(cfg, spec, "img")
    pod = manifest["spec"]["template"]["spec"]["containers"][0]
    pod["command"] = ["python", "-c", f"import time; time.sleep({seconds})"]
    return [config_map, manifest]


def _quick_job(cluster: LocalCluster, cfg: Any, job: str, run_key: str, seconds: float) -> None:
    """A Job of two pods that sleep `seconds` and exit 0, created on `cluster`."""
    for manifest in _sleeping_job(cfg, job, run_key, seconds):
        cluster.create(manifest)


FOLLOWER = r"""
import json, logging, pickle, sys
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from tasks.multinode import run_on_cluster
from tests import local_cluster
from tests.local_cluster import LocalCluster

work, job = Path(sys.argv[1]), sys.argv[2]
cfg = pickle.loads((work / "cfg.pickle").read_bytes())


class Cluster(LocalCluster):
    def delete(self, kind, namespace, name):  # said as it happens: SIGTERM ends this process
        super().delete(kind, namespace, name)
        print("deleted", kind, name, flush=True)


cluster = Cluster(work / f"cluster-{job}")
for manifest in json.loads((work / f"{job}.json").read_text()):
    cluster.create(manifest)  # the Job the flow run before this one launched: it trains on
print("pods", json.dumps([p.pid for p, _ in local_cluster._JOBS[job]["procs"]]), flush=True)
follower = logging.getLogger("tasks.multinode")
follower.setLevel(logging.INFO)
follower.addHandler(logging.StreamHandler(sys.stdout))


@flow(name="follow-a-job")
def follow_a_job() -> None:
    print("flow run", flow_run.get_id(), flush=True)
    run_on_cluster(cfg, "pretrain", {}, work / "data", work / "out", lambda r: None, cluster=cluster)


follow_a_job()
"""


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_cancelled_flow_run_deletes_its_job_and_an_ended_one_keeps_it(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """The follower stops (the flow run ends) while the Job trains. Cancelled by the user:
    the Job goes, the machines bill. Otherwise (the flow run's machine went away) the Job
    trains on, and after a Job ends, its Job object is kept for its logs.

    Two real flow runs on the fixture's Prefect server, each a process of its own following
    a training Job (its pods sleep). One is cancelled as the UI cancels (its state set to
    Cancelling on the server), then its process gets the SIGTERM its worker sends a
    cancelled run; the other gets the SIGTERM alone, as from a machine that is going away.
    Each is signalled once its follower has polled the Job (its log line): a condition."""
    import os
    import pickle
    import signal
    import subprocess
    import sys

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Cancelling

    from moe.errors import InputError
    from moe.recipes.fit import training_fingerprint
    from tests.conftest import cli_env
    from tests.test_train import _data

    cfg = _launch_config(tmp_path)
    data = _data(tmp_path / "data")
    run_key = f"pretrain/{training_fingerprint(cfg, 'pretrain', data)[:16]}"
    (tmp_path / "cfg.pickle").write_bytes(pickle.dumps(cfg))
    runs: dict[bool, tuple[str, Path, subprocess.Popen]] = {}
    for cancelled in (True, False):
        job = f"moe-pretrain-follow-{str(cancelled).lower()}"
        (tmp_path / f"{job}.json").write_text(json.dumps(_sleeping_job(cfg, job, run_key, 600)))
        out = tmp_path / f"{job}.log"
        with open(out, "w") as f:
            runs[cancelled] = (
                job,
                out,
                subprocess.Popen(
                    [sys.executable, "-c", FOLLOWER, str(tmp_path), job],
                    env=cli_env(prefect_server),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    text=True,
                ),
            )

    def said(out: Path, proc: subprocess.Popen, what: str) -> list[str]:
        deadline = time.monotonic() + 300  # a bound on the wait, not the verdict
        while what not in (text := out.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, text[-3000:]
            time.sleep(0.1)
        return text.splitlines()

    def pods(out: Path) -> list[int]:  # the pids of the Job's pods, as the follower said
        return [
            p for x in out.read_text().splitlines() if x[:5] == "pods " for p in json.loads(x[5:])
        ]

    try:
        with temporary_settings({PREFECT_API_URL: prefect_server["PREFECT_API_URL"]}):
            with get_client(sync_client=True) as client:
                for cancelled, (job, out, proc) in runs.items():
                    lines = said(out, proc, f"Job {job} after")  # the follower has polled
                    [run_id] = [x.split()[-1] for x in lines if x.startswith("flow run ")]
                    if cancelled:  # the user cancels the stage's flow run
                        state = client.set_flow_run_state(run_id, Cancelling()).state
                        assert state is not None and state.type == StateType.CANCELLING
                    proc.send_signal(signal.SIGTERM)
                    # Prefect's SIGTERM bridge lets the flow's code finish, then ends the
                    # process by the signal
                    assert proc.wait(timeout=120) == -signal.SIGTERM, out.read_text()[-3000:]
                    lines = out.read_text().splitlines()
                    kinds = {x.split()[1] for x in lines if x.startswith("deleted ")}
                    assert all(x.endswith(f" {job}") for x in lines if x.startswith("deleted "))
                    if cancelled:
                        assert kinds == {"Job", "Service", "ConfigMap"}, lines[-20:]
                        assert any("was cancelled: deleting Job" in x for x in lines)
                    else:
                        assert kinds == set(), lines[-20:]
                        assert any(f"Job {job} trains on" in x for x in lines)
                    # deleted: its pods were killed; kept: they train on without a follower
                    assert [_alive(pid) for pid in pods(out)] == [not cancelled] * 2
    finally:
        for _, out, proc in runs.values():
            proc.kill()
            proc.wait(timeout=60)
            for pid in pods(out):  # tidy: stop the pods of a Job that trains on
                if _alive(pid):
                    os.killpg(pid, signal.SIGKILL)
    # A Job that ended: its Service and ConfigMap go, the Job (its pods' logs) stays.
    cluster = LocalCluster(tmp_path / "cluster-ended")
    _quick_job(cluster, cfg, "moe-pretrain-ended", run_key, 0)
    LocalCluster.deleted.clear()
    with pytest.raises(InputError, match="ended without its outputs"):
        run_on_cluster(cfg, "pretrain", {}, data, tmp_path / "out", lambda r: None, cluster=cluster)
    assert {k for k, _ in LocalCluster.deleted} == {"Service", "ConfigMap"}


def test_a_recovered_flow_run_adopts_only_its_own_stages_job(tmp_path: Path) -> None:
    """Another stage's Job (its own run key) trains in the same namespace: a flow run of
    pretrain launches its own Job and leaves that one alone."""
    from moe.recipes.fit import training_fingerprint
    from tests.test_train import _data

    cfg = _launch_config(tmp_path)
    data = _data(tmp_path / "data")
    cluster = LocalCluster(tmp_path / "cluster")
    other_key = "finetune_sql/0123456789abcdef"
    _quick_job(cluster, cfg, "moe-finetune-sql-other", other_key, 30)
    assert cluster.running_jobs("default", {}) == ["moe-finetune-sql-other"]
    LocalCluster.created.clear()
    LocalCluster.deleted.clear()

    def fail_fast(manifest: dict[str, Any]) -> None:  # stop right after the launch
        LocalCluster.created.append(manifest)
        raise RuntimeError("quota")

    cluster.create = fail_fast  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="quota"):
        run_on_cluster(cfg, "pretrain", {}, data, tmp_path / "out", lambda r: None, cluster=cluster)
    own = f"pretrain/{training_fingerprint(cfg, 'pretrain', data)[:16]}"
    launched = [m for m in LocalCluster.created if m["kind"] == "ConfigMap"]
    assert launched and launched[0]["metadata"]["name"].startswith("moe-pretrain-")
    assert own.replace("/", ".") in json.dumps(launched[0]["metadata"]["labels"])
    assert not any(name == "moe-finetune-sql-other" for _, name in LocalCluster.deleted)


def test_the_nodes_run_the_commits_image_from_the_image_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prefect.yaml builds `$MOE_IMAGE_REPO:<commit>-gpu`; the launcher puts that image in
    the Job it creates (read back from the manifest the cluster received)."""
    from tests.test_train import _data

    cfg = _launch_config(tmp_path)
    cfg.pools.definitions[cfg.pools.stages["pretrain"]].image = ""
    monkeypatch.setenv("MOE_IMAGE_REPO", "registry.example.com/team/moe")
    monkeypatch.setenv("MOE_CODE_COMMIT", "0a1b2c3d")
    data = _data(tmp_path / "data")
    cluster = LocalCluster(tmp_path / "cluster")
    LocalCluster.created.clear()

    def record_only(manifest: dict[str, Any]) -> None:
        LocalCluster.created.append(manifest)
        if manifest["kind"] == "Job":
            raise RuntimeError("stop after the Job is rendered")

    cluster.create = record_only  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="stop after"):
        run_on_cluster(cfg, "pretrain", {}, data, tmp_path / "out", lambda r: None, cluster=cluster)
    (job,) = [m for m in LocalCluster.created if m["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    tier = "gpu" if cfg.pool_of("pretrain")[1].gpus else "cpu"
    assert container["image"] == f"registry.example.com/team/moe:0a1b2c3d-{tier}"
