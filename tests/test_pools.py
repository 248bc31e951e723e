"""The pool templates as the workers that run them build them: every pool of
`pools.definitions`, through prefect-kubernetes' and prefect-docker's own job configurations
(`from_template_and_values`, then `prepare_for_flow_run`), and the result through the
Kubernetes and Docker client libraries' own models. No cluster and no Docker daemon run
here: the daemon's version query is the one thing stubbed (the Docker worker asks it to add a
host entry)."""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

import pytest

from flows.pools import job_template
from tasks.config import Config


def _flow_run() -> Any:
    from prefect.client.schemas.objects import FlowRun

    return FlowRun(id=uuid4(), name="quiet-otter", flow_id=uuid4(), deployment_id=uuid4())


def _built(cls: Any, template: dict, values: dict | None = None) -> Any:
    from prefect.client.orchestration import PrefectClient

    # No block or variable references in our templates: the client is never called.
    client = PrefectClient("http://127.0.0.1:9/api")
    conf = asyncio.run(cls.from_template_and_values(template, values or {}, client=client))
    conf.prepare_for_flow_run(_flow_run())
    return conf


@pytest.mark.parametrize("pool", sorted(Config().pools.definitions))
def test_kubernetes_job_of_every_pool(pool: str) -> None:
    from kubernetes_asyncio.client import ApiClient, V1Job
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    cfg = Config()
    spec = cfg.pools.definitions[pool]
    conf = _built(KubernetesWorkerJobConfiguration, job_template(cfg, pool, "kubernetes"))
    manifest = conf.job_manifest

    # the Kubernetes client's own model of a Job takes it, field by field
    async def as_job() -> V1Job:
        async with ApiClient() as api:
            return api._ApiClient__deserialize(manifest, "V1Job")

    job = asyncio.run(as_job())
    pod = job.spec.template.spec
    [c] = pod.containers
    limits, requests = c.resources.limits, c.resources.requests
    assert c.image == ("moe-pipeline:gpu" if spec.gpus else "moe-pipeline:cpu")
    if spec.gpus:
        assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == str(spec.gpus)
        assert pod.node_selector == {"nvidia.com/gpu.product": spec.gpu_product}
        assert pod.tolerations[0].key == "nvidia.com/gpu"
    else:
        assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == "0"
        assert not pod.node_selector and not pod.tolerations
    assert limits["memory"] == requests["memory"] == f"{spec.memory_gib}Gi"
    assert requests["cpu"] == f"{spec.cpu:g}"
    vols = {v.name: v for v in pod.volumes}
    assert vols["dshm"].empty_dir.medium == "Memory"
    assert vols["dshm"].empty_dir.size_limit == f"{spec.shm_gib}Gi"
    assert vols["work"].persistent_volume_claim.claim_name == f"moe-work-{pool}"
    assert pod.security_context.run_as_non_root and pod.security_context.run_as_user == 1000
    assert job.spec.active_deadline_seconds == 7 * 24 * 3600
    env = {e.name: e.value for e in c.env}
    assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"
    assert env["MOE_PIPELINE_DIR"] == "/app"
    assert env["PREFECT__FLOW_RUN_ID"]  # the worker's own variables reached the container
    assert c.args[:3] == ["prefect", "flow-run", "execute"] or "prefect" in " ".join(c.args)


def test_kubernetes_overrides_a_deployment_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a deployment's job_variables change (prefect.yaml or the UI) reaches the Job; the
    commit's image (`pools create --image-tag`) names the repository of MOE_IMAGE_REPO."""
    monkeypatch.setenv("MOE_IMAGE_REPO", "registry.example/ml/moe")
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    cfg = Config()
    conf = _built(
        KubernetesWorkerJobConfiguration,
        job_template(cfg, "gpu-h100", "kubernetes", image_tag="abc123"),
        {"gpus": 8, "cpu": "64", "env": {"EXTRA": "1"}, "image_pull_secrets": [{"name": "reg"}]},
    )
    pod = conf.job_manifest["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == "registry.example/ml/moe:abc123-gpu"
    assert (
        c["resources"]["limits"]["nvidia.com/gpu"] == 8
        and c["resources"]["requests"]["cpu"] == "64"
    )
    assert pod["imagePullSecrets"] == [{"name": "reg"}]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["EXTRA"] == "1" and env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


class _Daemon:
    """The one thing of a Docker daemon the worker asks before it creates a container."""

    def version(self) -> dict[str, str]:
        return {"Version": "27.3.1"}


@pytest.mark.parametrize("pool", sorted(Config().pools.definitions))
def test_docker_container_of_every_pool(pool: str) -> None:
    import docker
    from docker.models.containers import _create_container_args
    from prefect_docker.worker import DockerWorker, DockerWorkerJobConfiguration

    cfg = Config()
    spec = cfg.pools.definitions[pool]
    conf = _built(DockerWorkerJobConfiguration, job_template(cfg, pool, "docker"))
    worker = DockerWorker.__new__(DockerWorker)  # only its container-settings builder is used
    settings = DockerWorker._build_container_settings(worker, _Daemon(), conf)
    # docker-py turns them into the create call (unknown or malformed keys raise here)
    args = _create_container_args(
        {**settings, "version": docker.constants.DEFAULT_DOCKER_API_VERSION}
    )
    host = args["host_config"]
    if spec.gpus:
        [req] = host["DeviceRequests"]
        assert req["Count"] == spec.gpus and req["Capabilities"] == [["gpu"]]
    else:  # a host without the NVIDIA runtime runs the cpu pool
        assert not host.get("DeviceRequests")
    assert host["Memory"] == spec.memory_gib << 30
    assert host["ShmSize"] == spec.shm_gib << 30
    assert host["Binds"] == [f"moe-work-{pool}:/app/models"]  # a volume per pool
    assert args["image"] == ("moe-pipeline:gpu" if spec.gpus else "moe-pipeline:cpu")
    assert args["environment"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


def test_pools_create_puts_each_pools_template_on_the_server(
    prefect_server: dict[str, str], tmp_path: Any
) -> None:
    """`moe-pipeline pools create --type kubernetes`: the server holds one pool per
    definition, each with its own defaults (what its workers build jobs from)."""
    import os
    import subprocess
    import sys

    from prefect.client.orchestration import SyncPrefectClient

    env = {**os.environ, **prefect_server}
    r = subprocess.run(
        [sys.executable, "-m", "flows.cli", "pools", "create", "--type", "kubernetes"],
        env=env,
        cwd=tmp_path,  # no params.yaml here: the embedded default
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    cfg = Config()
    with SyncPrefectClient(prefect_server["PREFECT_API_URL"]) as c:
        for pool, spec in cfg.pools.definitions.items():
            wp = c.read_work_pool(pool)
            assert wp.type == "kubernetes"
            props = wp.base_job_template["variables"]["properties"]
            assert props["gpus"]["default"] == spec.gpus
            assert props["work_claim"]["default"] == f"moe-work-{pool}"
            assert f"pool {pool} (kubernetes)" in r.stdout


def test_a_stage_trains_on_the_gpus_its_pool_gives() -> None:
    """nproc 0 (the default): one process per GPU of the stage's pool; more processes than
    the pool's GPUs is a configuration error naming both; on a machine without a GPU the
    launcher runs one process (a laptop running the pipeline locally)."""
    from moe.config import ConfigError
    from tasks.config import load_config
    from tasks.launch import processes as _processes

    eight = ["pools.definitions.gpu-h100.gpus=8"]
    cfg = load_config(None, eight)
    assert cfg.processes("pretrain") == 8 and cfg.processes("finetune_sql") == 1
    assert load_config(None, [*eight, "pretrain.nproc=4"]).processes("pretrain") == 4
    with pytest.raises(
        ConfigError, match=r"pretrain.nproc = 16: is more than the 8 GPU\(s\) its pool gpu-h100"
    ):
        load_config(None, [*eight, "pretrain.nproc=16"])
    load_config(None, ["pretrain.nproc=2", "pretrain.device=cpu"])  # CPU processes: any count
    cpu_here = load_config(None, [*eight, "pretrain.device=cpu"])
    assert cpu_here.processes("pretrain") == 8 and _processes(cpu_here, "pretrain") == 1


def test_the_expert_parallel_degree_must_divide_the_processes_and_the_experts() -> None:
    """8 experts on 16 CPU processes: refused as it was, unless the experts are split over
    groups of a divisor of both; a degree that divides neither is named."""
    from moe.config import ConfigError
    from tasks.config import load_config

    cpu16 = ["pretrain.nproc=16", "pretrain.device=cpu", "pretrain.batch_size=16"]
    with pytest.raises(ConfigError, match=r"pretrain.nproc = '16': must divide moe.num_experts"):
        load_config(None, cpu16)
    assert load_config(None, [*cpu16, "pretrain.expert_parallel=8"]).pretrain.expert_parallel == 8
    with pytest.raises(
        ConfigError, match=r"pretrain.expert_parallel = 3: must divide the process count \(16\)"
    ):
        load_config(None, [*cpu16, "pretrain.expert_parallel=3"])
    with pytest.raises(
        ConfigError, match=r"pretrain.expert_parallel = 16: must divide moe.num_experts \(8\)"
    ):
        load_config(None, [*cpu16, "pretrain.expert_parallel=16"])


def test_expert_growth_refuses_more_than_one_process() -> None:
    """Growth replaces parameters in place, which the sharded engine cannot follow: a config
    asking for both is refused, naming the fix."""
    from moe.config import ConfigError
    from tasks.config import load_config

    growth = ["moe.growth.enabled=true", "pretrain.device=cpu"]
    load_config(None, [*growth, "pretrain.nproc=1"])
    with pytest.raises(ConfigError, match=r"expert growth runs in one process: set pretrain.nproc"):
        load_config(None, [*growth, "pretrain.nproc=2"])
    with pytest.raises(ConfigError, match=r"expert growth runs in one process"):
        load_config(None, [*growth, "pretrain.nodes=2", "storage.backend=s3", "storage.bucket=b"])
