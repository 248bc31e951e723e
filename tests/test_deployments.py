"""prefect.yaml and params.yaml agree: one deployment per stage flow, on the pool that
params.yaml assigns to the stage, with an entrypoint that exists."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config import load_config
from tasks.pools import STAGES

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


def test_dvc_yaml_and_prefect_yaml_agree_with_the_stage_declarations() -> None:
    """One declaration per stage (flows/stages.py STAGE_LIST): dvc.yaml has a stage that runs
    it, whose params include its section and whose outputs hold its folder (where its
    lineage record lands) and its hand-off files; prefect.yaml a deployment of its flow.
    A stage declared and not wired (or wired and not declared) fails here, by name."""
    from flows.stages import STAGE_LIST

    cfg = load_config(ROOT / "params.yaml")
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    deployments = {
        d["name"]: d for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    }
    assert [s.name for s in STAGE_LIST] == list(dvc) == list(STAGES)
    for stage in STAGE_LIST:
        d = dvc[stage.name]
        assert d["cmd"] == f"moe-pipeline stage {stage.name}", stage.name
        params = [p.split(".")[0] for p in d["params"]]
        assert stage.section in params, (stage.name, stage.section, params)
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in d["outs"]]
        folder = stage.out(cfg).as_posix()
        assert any(folder == o or folder.startswith(o + "/") for o in outs), (stage.name, outs)
        assert deployments[stage.name]["entrypoint"] == f"flows/stages.py:{stage.name}"


def _moe_modules(path: Path) -> set[str]:
    """The moe/ modules a source file imports (anywhere in it, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("moe"):
            package = node.module.replace(".", "/")
            # `from moe.sql.joins import key`, and `from moe.sql import scopes` (a module)
            found |= {package + ".py"} | {f"{package}/{a.name}.py" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.replace(".", "/") + ".py" for a in node.names if a.name[:4] == "moe."}
    return {p for p in found if (ROOT / p).is_file()}


def test_a_stage_reruns_when_any_code_it_runs_changes() -> None:
    """A stage's skip decision hashes the .py deps dvc.yaml lists for it (as DVC does): every
    moe/ module its task modules import, directly or through other moe/ modules, must be
    listed, or a change there (the SFT batches of moe/data/tokens.py, say) would leave the stage
    skipped with stale outputs; so must the task modules those import from tasks/ to compute
    outputs (evaluate scores models through moe/recipes/evaluate.py). The configuration's
    declarations (moe/config.py, each part's moe/<part>/config.py, the tree that composes
    them: moe/recipes/params.py) and moe/errors.py are exempt: their effect on a run is the params, tracked as params. The
    plumbing (store, progress, launch) is deliberately not a dep: see dvc.yaml."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in dvc.items():
        deps = {d for d in stage["deps"] if d.endswith(".py")}
        needed, todo = set(), [d for d in deps if d.startswith("tasks/")]
        assert todo, f"dvc.yaml stage {name} lists no task module"
        while todo:
            for module in _moe_modules(ROOT / todo.pop()) - needed:
                needed.add(module)
                todo.append(module)
        declared = {m for m in needed if m.endswith("config.py")} | {"moe/errors.py"}
        declared.add("moe/recipes/params.py")  # the params tree: its effect is the params
        missing = needed - deps - declared
        assert not missing, f"dvc.yaml stage {name}: add to deps {sorted(missing)}"


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


def test_one_image_per_commit_and_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """prefect.yaml's build steps as `prefect deploy` runs them, up to Docker (no daemon
    here): the commit and repository steps run for real in a git checkout, the build and push
    steps' inputs bind to prefect-docker's own step functions, and every deployment's image is
    the commit's tag of its pool's tier (gpu where the pool has GPUs)."""
    import asyncio
    import inspect
    import shutil
    import subprocess

    from prefect.utilities.templating import apply_values
    from prefect_docker.deployments import steps as docker_steps

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    shutil.copy(ROOT / "prefect.yaml", tmp_path / "prefect.yaml")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    commit = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()

    outputs: dict = {}
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MOE_IMAGE_REPO", "registry.example/ml/moe")
    for step in spec["build"]:
        ((fqn, inputs),) = step.items()
        if fqn.startswith("prefect_docker."):
            inputs = apply_values(dict(inputs), outputs)
            inputs.pop("id"), inputs.pop("requires")
            inspect.signature(docker_steps.build_docker_image).bind(**inputs)
            outputs[step[fqn]["id"]] = {
                "image": f"{inputs['image_name']}:{inputs['tag']}",
                "image_name": inputs["image_name"],
                "tag": inputs["tag"],
            }
            assert inputs["buildargs"]["MOE_CODE_COMMIT"] == commit
            # the image knows where it was pushed: a multi-node stage's pods pull the same
            assert inputs["buildargs"]["MOE_IMAGE_REPO"] == "registry.example/ml/moe"
        else:  # as run_step does, less its block and variable lookups (no server here)
            module, name = fqn.rsplit(".", 1)
            fn = getattr(importlib.import_module(module), name)
            kwargs = apply_values({k: v for k, v in inputs.items() if k != "id"}, outputs)
            outputs[inputs["id"]] = asyncio.run(fn(**apply_values(kwargs, dict(os.environ))))
    assert outputs["image-gpu"]["image"] == f"registry.example/ml/moe:{commit}-gpu"
    assert outputs["image-cpu"]["image"] == f"registry.example/ml/moe:{commit}-cpu"
    for step in spec["push"]:
        ((_, inputs),) = step.items()
        inputs = apply_values({k: v for k, v in inputs.items() if k != "requires"}, outputs)
        inspect.signature(docker_steps.push_docker_image).bind(**inputs)
    cfg = load_config(ROOT / "params.yaml")
    for d in spec["deployments"]:
        tier = "gpu" if cfg.pools.definitions[d["work_pool"]["name"]].gpus else "cpu"
        assert (
            apply_values(d["job_variables"], outputs)["image"] == outputs[f"image-{tier}"]["image"]
        )


def test_the_stack_deploys_without_images(tmp_path: Path) -> None:
    """The local stack's copy of prefect.yaml: no build or push step (no Docker needed), no
    image job variable (process workers), the same deployments otherwise."""
    from flows.stack_server import local_deployments

    for name in ("prefect.yaml",):
        (tmp_path / name).write_text((ROOT / name).read_text())
    spec = yaml.safe_load(local_deployments(tmp_path).read_text())
    full = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    assert "build" not in spec and "push" not in spec and spec["pull"] == full["pull"]
    assert [d["name"] for d in spec["deployments"]] == [d["name"] for d in full["deployments"]]
    assert not any("image" in (d.get("job_variables") or {}) for d in spec["deployments"])


def test_a_worker_without_moe_pipeline_dir_is_told_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pull steps, run as a worker runs them: without MOE_PIPELINE_DIR they stop with a
    message naming it (not a chdir into ''); with it they enter the folder."""
    import asyncio

    from prefect.utilities.templating import apply_values

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())

    def pull() -> None:
        for step in spec["pull"]:
            ((fqn, inputs),) = step.items()
            module, name = fqn.rsplit(".", 1)
            fn = getattr(importlib.import_module(module), name)
            kwargs = apply_values(dict(inputs), dict(os.environ))
            result = fn(**kwargs)
            if asyncio.iscoroutine(result):
                asyncio.run(result)

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MOE_PIPELINE_DIR", raising=False)
    with pytest.raises(RuntimeError, match="MOE_PIPELINE_DIR is unset on this worker"):
        pull()
    assert Path.cwd() == tmp_path
    (tmp_path / "code").mkdir()
    monkeypatch.setenv("MOE_PIPELINE_DIR", str(tmp_path / "code"))
    pull()
    assert Path.cwd() == tmp_path / "code"


# The plumbing a stage body calls to move files or report progress (the object store, the
# hand-off, W&B, the config loader): a change to how files travel does not retrain a model,
# so these are not deps of the stages that only move files with them (dvc.yaml says so).
PLUMBING = {
    "tasks/storage.py",
    "tasks/archive.py",
    "tasks/handoff.py",
    "tasks/tracking.py",
    "tasks/config.py",
}


def _body_modules(stage: str) -> set[str]:
    """The tasks/ and flows/ modules a stage's body uses, read from the body's own module
    (flows/bodies/): the names the body function (and the module-level helpers it calls,
    transitively) refer to, mapped to the module each was imported from."""
    import flows.stages as stages

    body = stages.STAGES_BY_NAME[stage].body
    path = Path(sys.modules[body.__module__].__file__).resolve().relative_to(ROOT).as_posix()
    tree = ast.parse((ROOT / path).read_text())
    imported = {
        a.asname or a.name: node.module.replace(".", "/") + ".py"
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module
        and node.module.split(".")[0] in ("tasks", "flows")
        for a in node.names
    }
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    root = body.__name__ if body.__name__ in functions else body.__qualname__.split(".")[0]
    seen, todo, found = set(), [root], {"flows/stages.py", path}
    while todo:
        name = todo.pop()
        if name in seen or name not in functions:
            continue
        seen.add(name)
        # the body's statements: annotations (record: StageRecord) are not uses
        for node in (n for stmt in functions[name].body for n in ast.walk(stmt)):
            if isinstance(node, ast.Name):
                if node.id in imported:
                    found.add(imported[node.id])
                elif node.id in functions:
                    todo.append(node.id)
    return found


def test_a_stage_reruns_when_its_body_or_what_the_body_uses_changes() -> None:
    """A stage's body module (flows/bodies/) is a dep of its stage, flows/stages.py (the
    declarations' list, the skip check) of every stage, and so is each tasks/ or flows/
    module the body uses to compute its outputs; otherwise an edit there leaves `dvc repro`
    and the stage's own skip check saying everything is up to date, with stale outputs and
    metrics."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    for name, stage in dvc.items():
        deps = set(stage["deps"])
        needed = _body_modules(name)
        if name != "publish":  # publishing *is* the object store's work
            needed -= PLUMBING
        else:
            needed -= PLUMBING - {"tasks/storage.py", "tasks/archive.py"}
        missing = needed - deps
        assert not missing, f"dvc.yaml stage {name}: add to deps {sorted(missing)}"
