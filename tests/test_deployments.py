"""prefect.yaml and params.yaml agree: one deployment per stage flow, on the pool that
params.yaml assigns to the stage, with an entrypoint that exists."""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import yaml

from moe.config import STAGES, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_stage_has_a_deployment_on_its_pool() -> None:
    cfg = load_config(ROOT / "params.yaml")
    deployments = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert set(STAGES) | {"pipeline", "recover"} == set(deployments)
    for stage in STAGES:
        assert deployments[stage]["work_pool"]["name"] == cfg.pools.stages[stage]
        assert "moe-stage" in deployments[stage]["tags"]  # what the recovery automation watches
    assert deployments["recover"]["work_pool"]["name"] == "cpu"
    # the stage runs send heartbeats as often as the crash detector expects, on any pool
    heartbeat = str(cfg.recovery.heartbeat_s)
    for t in (ROOT / "infra/pools").glob("*.json"):
        env = json.loads(t.read_text())["variables"]["properties"]["env"]["default"]
        assert env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == heartbeat, t.name
    assert "moe-stage" not in deployments["recover"].get("tags", [])
    for d in deployments.values():
        module, func = d["entrypoint"].split(":")
        flow = getattr(importlib.import_module(module.removesuffix(".py").replace("/", ".")), func)
        assert flow.name == d["name"]
    assert all(s["active"] is False for s in deployments["pipeline"]["schedules"])


def _placeholders(node: object) -> set[str]:
    if isinstance(node, str):
        return set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", node))
    if isinstance(node, dict):
        return set().union(*(_placeholders(v) for v in node.values())) if node else set()
    if isinstance(node, list):
        return set().union(*(_placeholders(v) for v in node)) if node else set()
    return set()


def test_base_job_templates_define_every_variable_and_request_gpus() -> None:
    templates = {
        p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "infra/pools").glob("*.json"))
    }
    assert set(templates) == {"process", "docker", "kubernetes"}
    for name, t in templates.items():
        used = _placeholders(t["job_configuration"])
        defined = set(t["variables"]["properties"])
        assert used <= defined, (name, used - defined)
    docker = templates["docker"]["variables"]["properties"]
    [request] = docker["device_requests"]["default"]
    assert request["Capabilities"] == [["gpu"]] and request["Driver"] == "nvidia"
    k8s = templates["kubernetes"]
    container = k8s["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][
        0
    ]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ gpus }}"
    assert "nvidia.com/gpu.product" in k8s["variables"]["properties"]["node_selector"]["default"]


def test_a_prefect_server_accepts_the_templates(prefect_server: dict[str, str]) -> None:
    """Work pools of each type are created from infra/pools/*.json on a real server (the
    docker and kubernetes workers' own job configurations build them in test_pools.py)."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate

    with SyncPrefectClient(prefect_server["PREFECT_API_URL"]) as client:
        for kind in ("process", "docker", "kubernetes"):
            template = json.loads((ROOT / f"infra/pools/{kind}.json").read_text())
            name = f"template-check-{kind}"
            client.create_work_pool(
                WorkPoolCreate(name=name, type=kind, base_job_template=template), overwrite=True
            )
            assert client.read_work_pool(name).base_job_template == template


def test_the_image_keeps_dependencies_apart_and_runs_as_a_user() -> None:
    """infra/Dockerfile, read as Docker reads it (no daemon here to build it): the dependency
    layer holds only pyproject and the lock (a docs or code edit does not reinstall torch),
    the image records its commit and runs as the non-root user the Kubernetes template
    expects, and bytecode is not switched off by a variable set to 0."""
    lines = []
    for raw in (ROOT / "infra/Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if raw.strip() and not raw.lstrip().startswith("#"):
            lines.append(raw.split(None, 1))
    ops = [op.upper() for op, _ in lines]
    assert ops[0] == "FROM"
    copies = [arg for op, arg in lines if op.upper() == "COPY"]
    installs = [
        i for i, (op, arg) in enumerate(lines) if op.upper() == "RUN" and "pip install" in arg
    ]
    first_copy = ops.index("COPY")
    assert copies[0].split()[:-1] == ["pyproject.toml", "requirements.lock"]
    assert first_copy < installs[0] < ops.index("COPY", first_copy + 1)
    assert "PYTHONDONTWRITEBYTECODE" not in (ROOT / "infra/Dockerfile").read_text()
    env = " ".join(arg for op, arg in lines if op.upper() == "ENV")
    assert "MOE_CODE_COMMIT=$MOE_CODE_COMMIT" in env and "MOE_PIPELINE_DIR=/app" in env
    template = json.loads((ROOT / "infra/pools/kubernetes.json").read_text())
    user = template["variables"]["properties"]["run_as_user"]["default"]
    assert lines[-1] == ["USER", str(user)]
