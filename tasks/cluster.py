"""The Kubernetes side of training across nodes (tasks/multinode.py): what one launch
creates (`manifests`: a ConfigMap, a headless Service and an Indexed Job of `nodes` pods) and
the cluster API the launcher creates, reads and deletes them through.

Why an Indexed Job and a headless Service rather than a Kubeflow PyTorchJob or a JobSet:
both are core Kubernetes (batch/v1, GA since 1.24), so the cluster needs no operator or CRD
installed and the namespace's service account needs only the rights to create Jobs,
Services and ConfigMaps. An Indexed Job gives pod i the hostname `<job>-<i>`; with the
Service as its subdomain, pod 0 is reachable as `<job>-0.<service>` before any pod is
ready (publishNotReadyAddresses), which is all torchrun's c10d rendezvous needs. The Job
has backoffLimit 0: any pod that fails fails the Job (a lost node breaks every rank's
collectives anyway), and the stage's Prefect retry launches a new Job that resumes from the
newest checkpoint, on whatever machines the cluster gives it.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from moe.errors import InputError
from tasks.config import Config
from tasks.pools import PoolSpec

log = logging.getLogger(__name__)

MOUNT = "/etc/moe"  # where each pod finds job.json (the ConfigMap)
RUN_LABEL = "moe-pipeline/run-key"


def pool_image(spec: PoolSpec, tag: str = "") -> str:
    """The pool's image: its own setting, else the tier's (`moe-pipeline:gpu` / `:cpu`), or
    with `tag` (the commit) the image prefect.yaml's build steps make for the tier:
    `$MOE_IMAGE_REPO:<tag>-gpu` (repository moe-pipeline by default)."""
    if spec.image:
        return spec.image
    tier = "gpu" if spec.gpus else "cpu"
    repo = os.environ.get("MOE_IMAGE_REPO") or "moe-pipeline"
    return f"{repo}:{tag}-{tier}" if tag else f"moe-pipeline:{tier}"


# ------------------------------------------------------------------------- the job


@dataclass
class NodeJob:
    """What every node of one launch reads (job.json in the ConfigMap)."""

    job: str  # the Job's name; also the rendezvous id
    stage: str
    run_key: str  # <stage>/<fingerprint[:16]>: the checkpoints' key, the same for every launch
    params: dict[str, Any]  # the resolved configuration
    receipt: dict[str, Any]  # the published dataset
    nodes: int
    nproc: int
    rdzv_endpoint: str  # host:port of pod 0
    join_timeout_s: int
    init: str = ""  # finetune: the stage whose model it starts from (fetched from the store)
    pairs_file: str = ""
    budget_left: float = 0.0
    started: float = field(default_factory=time.time)

    @property
    def prefix(self) -> str:
        return f"multinode/{self.job}"


def job_name(stage: str, fingerprint: str) -> str:
    """A Kubernetes name (<= 63 chars, DNS-1123) unique per launch: moe-<stage>-<fp>-<rand>."""
    return f"moe-{stage.replace('_', '-')}-{fingerprint[:8]}-{secrets.token_hex(3)}"


def manifests(cfg: Config, spec: NodeJob, image: str) -> list[dict[str, Any]]:
    """The ConfigMap, the headless Service and the Indexed Job of one launch, in the order
    they are created. Each pod asks for one machine of the stage's pool (its GPUs, CPUs,
    memory, /dev/shm, node selector) and runs `python -m tasks.multinode node`."""
    m = cfg.multinode
    pool_name, pool = cfg.pool_of(spec.stage)
    if pool is None:
        raise InputError(f"{spec.stage}: pools.stages names no pool in pools.definitions")
    labels = {
        "app.kubernetes.io/name": "moe-pipeline",
        "moe-pipeline/stage": spec.stage,
        RUN_LABEL: spec.run_key.replace("/", "."),
        "moe-pipeline/job": spec.job,
    }
    meta = {"name": spec.job, "namespace": m.namespace, "labels": labels}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {"job.json": json.dumps(asdict(spec), indent=1)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",  # headless: DNS names for the pods, no load balancing
            "publishNotReadyAddresses": True,  # pod 0 resolves before any pod is ready
            "selector": {"moe-pipeline/job": spec.job},
            "ports": [{"name": "rdzv", "port": m.rdzv_port, "targetPort": m.rdzv_port}],
        },
    }
    resources = _resources(pool)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.nodes,
        "parallelism": spec.nodes,
        "backoffLimit": 0,  # one lost node fails the Job; the Prefect retry resumes it
        "ttlSecondsAfterFinished": 3600,
        "template": {
            "metadata": {"labels": labels},
            "spec": _pod_spec(cfg, spec, pool, image, resources),
        },
    }
    if m.deadline_s:
        job_spec["activeDeadlineSeconds"] = m.deadline_s
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}
    log.debug("pool %s: %d nodes x %s", pool_name, spec.nodes, resources)
    return [config_map, service, job]


def _resources(pool: PoolSpec) -> dict[str, dict[str, Any]]:
    """One machine of the pool: its CPUs, memory and GPUs."""
    resources: dict[str, dict[str, Any]] = {
        "requests": {"cpu": f"{pool.cpu:g}", "memory": f"{pool.memory_gib}Gi"},
        "limits": {"memory": f"{pool.memory_gib}Gi"},
    }
    if pool.gpus:
        resources["requests"]["nvidia.com/gpu"] = pool.gpus
        resources["limits"]["nvidia.com/gpu"] = pool.gpus
    return resources


def _node_env(cfg: Config) -> list[dict[str, str]]:
    return [
        {"name": "MOE_NODE_JOB", "value": f"{MOUNT}/job.json"},
        {"name": "PREFECT_LOGGING_EXTRA_LOGGERS", "value": "moe,tasks,flows"},
        # the Hub only where it is the object store
        {"name": "HF_HUB_OFFLINE", "value": "0" if cfg.storage.backend == "hf" else "1"},
        {"name": "WANDB_SILENT", "value": "true"},
        # NCCL finds its interface and reports why it fails; torchrun's agents talk over the
        # pod network (the rendezvous), the ranks over NCCL (InfiniBand / RoCE if present).
        {"name": "NCCL_DEBUG", "value": "WARN"},
    ]


def _pod_spec(
    cfg: Config, spec: NodeJob, pool: PoolSpec, image: str, resources: dict[str, Any]
) -> dict[str, Any]:
    """A node's pod: the image's `python -m tasks.multinode node`, job.json mounted, scratch
    disk, /dev/shm in memory, on a machine of the pool."""
    m = cfg.multinode
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else "latest"
    tagged = tag not in ("gpu", "cpu", "latest")  # a commit's tag, never moved
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "subdomain": spec.job,  # pod i: <job>-i.<job>.<namespace>.svc
        "nodeSelector": {"nvidia.com/gpu.product": pool.gpu_product} if pool.gpu_product else {},
        "tolerations": (
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
            if pool.gpus
            else []
        ),
        "containers": [
            {
                "name": "node",
                "image": image,
                "imagePullPolicy": "IfNotPresent"
                if tagged
                else "Always",  # a commit tag is immutable
                "command": ["python", "-m", "tasks.multinode", "node"],
                "workingDir": "/work",
                "env": _node_env(cfg),
                "envFrom": [{"secretRef": {"name": m.credentials_secret, "optional": True}}],
                "ports": [{"name": "rdzv", "containerPort": m.rdzv_port}],
                "resources": resources,
                "volumeMounts": [
                    {"name": "job", "mountPath": MOUNT, "readOnly": True},
                    {"name": "work", "mountPath": "/work"},
                    {"name": "dshm", "mountPath": "/dev/shm"},
                ],
                "securityContext": {"allowPrivilegeEscalation": False},
            }
        ],
        "volumes": [
            {"name": "job", "configMap": {"name": spec.job}},
            # a node's disk is scratch: what must survive is in the object store
            {"name": "work", "emptyDir": {}},
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{pool.shm_gib}Gi"}},
        ],
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            "fsGroup": 1000,
        },
    }
    if m.service_account:
        pod_spec["serviceAccountName"] = m.service_account
    if m.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": s} for s in m.image_pull_secrets]
    return pod_spec


# ------------------------------------------------------------------------- clusters


@dataclass
class JobState:
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    complete: bool = False  # (kept in this order: positional use below)  # the Job's Complete condition: every index succeeded
    reason: str = ""  # set when the Job failed: why (BackoffLimitExceeded, DeadlineExceeded)
    ready: int = 0  # pods running (the container has no readiness probe: ready = running)


class Cluster(Protocol):
    """What the launcher needs from a cluster. KubernetesCluster is the real one."""

    def create(self, manifest: dict[str, Any]) -> None: ...
    def job_state(self, namespace: str, name: str) -> JobState: ...
    def running_jobs(self, namespace: str, labels: dict[str, str]) -> list[str]: ...
    def delete(self, kind: str, namespace: str, name: str) -> None: ...


class KubernetesCluster:
    """The Kubernetes API through kubernetes_asyncio (installed with prefect-kubernetes):
    in-cluster credentials in a pod (the flow run's service account), else ~/.kube/config."""

    def _run(self, fn: Callable[[Any], Any]) -> Any:
        from kubernetes_asyncio import client, config

        async def go() -> Any:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                await config.load_kube_config()
            async with client.ApiClient() as api:
                return await fn(api)

        return asyncio.run(go())

    def create(self, manifest: dict[str, Any]) -> None:
        from kubernetes_asyncio import client

        ns, kind = manifest["metadata"]["namespace"], manifest["kind"]

        async def go(api: Any) -> None:
            if kind == "Job":
                await client.BatchV1Api(api).create_namespaced_job(ns, manifest)
            elif kind == "Service":
                await client.CoreV1Api(api).create_namespaced_service(ns, manifest)
            else:
                await client.CoreV1Api(api).create_namespaced_config_map(ns, manifest)

        self._run(go)

    def job_state(self, namespace: str, name: str) -> JobState:
        from kubernetes_asyncio import client

        async def go(api: Any) -> JobState:
            job = await client.BatchV1Api(api).read_namespaced_job_status(name, namespace)
            s = job.status
            true = {c.type: c for c in s.conditions or [] if c.status == "True"}
            failed = true.get("Failed")
            reason = f"{failed.reason}: {failed.message}" if failed else ""
            complete = "Complete" in true
            return JobState(
                s.active or 0, s.succeeded or 0, s.failed or 0, complete, reason, s.ready or 0
            )

        return self._run(go)

    def running_jobs(self, namespace: str, labels: dict[str, str]) -> list[str]:
        from kubernetes_asyncio import client

        selector = ",".join(f"{k}={v}" for k, v in labels.items())

        async def go(api: Any) -> list[str]:
            jobs = await client.BatchV1Api(api).list_namespaced_job(
                namespace, label_selector=selector
            )
            return [  # not yet finished: also one whose pods are not created yet
                j.metadata.name
                for j in jobs.items
                if not any(
                    c.type in ("Failed", "Complete") and c.status == "True"
                    for c in j.status.conditions or []
                )
            ]

        return self._run(go)

    def delete(self, kind: str, namespace: str, name: str) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async def go(api: Any) -> None:
            try:
                if kind == "Job":  # its pods with it
                    await client.BatchV1Api(api).delete_namespaced_job(
                        name, namespace, propagation_policy="Background"
                    )
                elif kind == "Service":
                    await client.CoreV1Api(api).delete_namespaced_service(name, namespace)
                else:
                    await client.CoreV1Api(api).delete_namespaced_config_map(name, namespace)
            except ApiException as e:
                if e.status != 404:
                    raise

        self._run(go)


def open_cluster() -> Cluster:
    """The cluster the launcher talks to: Kubernetes, or the class MOE_CLUSTER names
    (module:Class; the tests run pods as local processes this way)."""
    spec = os.environ.get("MOE_CLUSTER", "")
    if not spec:
        return KubernetesCluster()
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)()
