"""What the local stack's servers hold (flows/stack.py): the S3 bucket on moto; on the
Prefect server, the work pools, the deployments of prefect.yaml and their run forms'
defaults; a client for each, and flow runs of the deployments.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from flows.stack_processes import STATE_DIR, StackError, api_env, executable, save_state
from tasks.config import load_config


def stack_overrides(state: dict[str, Any]) -> list[str]:
    """The params overrides that point the stages at the stack's object store."""
    return [
        "storage.backend=s3",
        f"storage.bucket={state['bucket']}",
        f"storage.endpoint_url={state['s3_endpoint']}",
    ]


def s3_client(state: dict[str, Any]) -> Any:
    """A boto3 S3 client for the stack's moto server."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=state["s3_endpoint"],
        region_name="us-east-1",
        aws_access_key_id="stack",
        aws_secret_access_key="stack",
    )


def ensure_bucket(state: dict[str, Any]) -> None:
    s3 = s3_client(state)
    if state["bucket"] not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=state["bucket"])


def api_client(state: dict[str, Any]) -> Any:
    """A Prefect client for the stack's server."""
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(state["api_url"])


def ensure_pools(root: Path, state: dict[str, Any], pools: list[str]) -> None:
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectAlreadyExists

    template = json.loads((root / "infra" / "pools" / "process.json").read_text())
    with api_client(state) as client:
        for pool in pools:
            try:
                client.create_work_pool(
                    WorkPoolCreate(name=pool, type="process", base_job_template=template)
                )
            except ObjectAlreadyExists:
                client.update_work_pool(pool, WorkPoolUpdate(base_job_template=template))


def local_deployments(root: Path) -> Path:
    """prefect.yaml as the stack deploys it: without the image build and push steps and the
    image job variables (its process workers run the code copied into their folders)."""
    import yaml

    spec = yaml.safe_load((root / "prefect.yaml").read_text())
    spec.pop("build", None)
    spec.pop("push", None)
    for d in spec["deployments"]:
        jv = d.get("job_variables") or {}
        jv.pop("image", None)
        if jv:
            d["job_variables"] = jv
        else:
            d.pop("job_variables", None)
    out = root / STATE_DIR / "prefect.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    return out


def deploy_if_changed(root: Path, state: dict[str, Any], say: Any) -> None:
    """Deploy when the server is new or what the deployments are made of changed:
    prefect.yaml, and params.yaml with the config's declarations (the run form's fields and
    defaults, the descriptions); a restart of a worker needs none."""
    made_of = ["prefect.yaml", "params.yaml", "dvc.yaml", "moe/config.py", "tasks/config.py"]
    made_of += sorted(str(p.relative_to(root)) for p in root.glob("moe/*/config.py"))
    spec = hashlib.sha256(
        b"".join((root / f).read_bytes() for f in made_of if (root / f).is_file())
    ).hexdigest()
    if state.get("deployed") != [spec, state["procs"]["prefect-server"]["started"]]:
        _deploy(root, state, say)
        state["deployed"] = [spec, state["procs"]["prefect-server"]["started"]]
        save_state(root, state)


def _deploy(root: Path, state: dict[str, Any], say: Any) -> None:
    say("deploying prefect.yaml (one deployment per stage, the pipeline and recover)")
    spec = local_deployments(root)
    proc = subprocess.run(
        [executable("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(spec)],
        cwd=root,
        env=api_env(root, state),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise StackError(
            "prefect deploy --all failed (prefect.yaml):\n" + (proc.stdout + proc.stderr)[-3000:]
        )


def point_pipeline_at_stack(state: dict[str, Any]) -> None:
    """The deployments' default parameters: the run form opens filled in with the stack's
    configuration (every stage, `params` as params.yaml resolves), and the pipeline's use the
    stack's bucket and dispatch to the stage deployments, so that a run started from the UI
    (or its schedule) works as `stack run` does."""
    from flows.deployments import set_form_defaults

    resolved = load_config(state["params_file"], stack_overrides(state))  # storage: s3
    with api_client(state) as client:
        set_form_defaults(
            client,
            resolved,
            pipeline={"dispatch": "deployments", "overrides": stack_overrides(state)},
        )


def start_deployment(state: dict[str, Any], name: str, parameters: dict[str, Any]) -> Any:
    """A flow run of deployment `<name>/<name>` on the stack (returned at once)."""
    with api_client(state) as client:
        dep = client.read_deployment_by_name(f"{name}/{name}")
        return client.create_flow_run_from_deployment(dep.id, parameters=parameters)


def wait_flow_run(
    state: dict[str, Any], flow_run_id: Any, timeout: float | None = None, say: Any = None
) -> Any:
    """The flow run once it is in a final state; `say` hears each new state name."""
    deadline = None if timeout is None else time.time() + timeout
    last = None
    with api_client(state) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            if fr.state and fr.state.name != last:
                last = fr.state.name
                if say:
                    say(last)
            if fr.state and fr.state.is_final():
                return fr
            if deadline is not None and time.time() > deadline:
                raise StackError(f"flow run {flow_run_id} is still {last} after {timeout:.0f} s")
            time.sleep(1)
