"""The local stack: the whole orchestration on one machine, on 127.0.0.1.

`moe-pipeline stack up` starts a Prefect server and a moto S3 server, creates the bucket, one
work pool per entry of `pools.definitions` (process type, infra/pools/process.json), deploys
prefect.yaml (without its image steps), creates the recovery automations (flows/recovery.py),
starts one process worker per pool (flow-run heartbeats on, its health check served) and a
watchdog that starts a dead or unhealthy worker again. Each worker has its own working folder
under `.stack/work/<pool>/` with a copy of the code (what an image per pool would hold), so
stages on different pools share no disk: they exchange outputs through the S3 bucket.
`stack run` starts the pipeline deployment with `dispatch: deployments`; `stack status` shows
what runs; `stack down` stops exactly the processes `up` started (pid and start time recorded
in `.stack/stack.json`), and keeps the database, logs and working folders.

`up` is idempotent: it restarts only what is not running. `up`, `down` and the watchdog
change `.stack/stack.json` under a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

from flows.recovery import install as install_automations
from flows.recovery import remove as remove_automations
from tasks.config import load_config

STATE_DIR = ".stack"
WATCHDOG = "watchdog"
BUCKET = "moe-stack"
# Files a worker's working folder gets: the code and its configuration (not data or outputs).
CODE = ("moe", "tasks", "flows", "params.yaml", "prefect.yaml", "dvc.yaml", "pyproject.toml")


class StackError(RuntimeError):
    """Something the user can fix (named in the message)."""


def _state_path(root: Path) -> Path:
    return root / STATE_DIR / "stack.json"


def load_state(root: Path) -> dict[str, Any]:
    path = _state_path(root)
    return json.loads(path.read_text()) if path.is_file() else {"procs": {}}


def _save(root: Path, state: dict[str, Any]) -> None:
    path = _state_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


def _free_port(preferred: int | None = None) -> int:
    """`preferred` (the port of the last start, so URLs stay the same) if it is free."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred or 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc(entry: dict[str, Any] | None) -> psutil.Process | None:
    """The process an entry recorded, if it still runs (same pid *and* start time: a pid the
    system gave to another process since is not ours)."""
    if not entry:
        return None
    try:
        p = psutil.Process(entry["pid"])
        if abs(p.create_time() - entry["started"]) > 1 or p.status() == psutil.STATUS_ZOMBIE:
            return None
        return p
    except psutil.NoSuchProcess:
        return None


def _spawn(
    root: Path, state: dict[str, Any], name: str, cmd: list[str], env: dict[str, str], cwd: Path
) -> None:
    log = root / STATE_DIR / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    state["procs"][name] = {
        "pid": proc.pid,
        "started": psutil.Process(proc.pid).create_time(),
        "cmd": cmd,
        "log": str(log),
    }
    _save(root, state)


def _wait_http(url: str, entry: dict[str, Any], what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if _proc(entry) is None:
                raise StackError(f"{what} exited; see {entry['log']}") from None
            if time.time() > deadline:
                raise StackError(
                    f"{what} did not answer {url} in {timeout:.0f} s; see {entry['log']}"
                ) from None
            time.sleep(0.5)


def _exe(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    if not exe.is_file():
        raise StackError(f"{exe} is missing: install the project (make venv) and use its python")
    return str(exe)


# Real cloud credentials are not handed to the stack's processes: its bucket lives on moto.
_DROPPED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")


def _base_env(root: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in _DROPPED
    }
    env.update(
        PREFECT_HOME=str(root / STATE_DIR / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
    )
    return env


def _api_env(root: Path, state: dict[str, Any]) -> dict[str, str]:
    return {**_base_env(root), "PREFECT_API_URL": state["api_url"]}


def _s3_env() -> dict[str, str]:
    """Credentials for the stack's moto server (any value works there)."""
    return {
        "AWS_ACCESS_KEY_ID": "stack",
        "AWS_SECRET_ACCESS_KEY": "stack",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def stack_overrides(state: dict[str, Any]) -> list[str]:
    """The params overrides that point the stages at the stack's object store."""
    return [
        "storage.backend=s3",
        f"storage.bucket={state['bucket']}",
        f"storage.endpoint_url={state['s3_endpoint']}",
    ]


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    """One writer of the stack's state at a time: `up`, `down` and the watchdog each read,
    change and save it whole."""
    path = root / STATE_DIR / "stack.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def up(
    root: Path,
    params_file: str | None = None,
    ui: bool = True,
    query_seconds: float = 2.0,
    say: Any = print,
) -> dict[str, Any]:
    """Start (or complete) the stack; returns its state."""
    root = root.resolve()
    with _locked(root):
        return _up(root, params_file, ui, query_seconds, say)


def _up(
    root: Path, params_file: str | None, ui: bool, query_seconds: float, say: Any
) -> dict[str, Any]:
    params_path = Path(params_file).resolve() if params_file else root / "params.yaml"
    cfg = load_config(params_path)
    state = load_state(root)
    state.setdefault("procs", {})
    state["root"] = str(root)
    state["params_file"] = str(params_path)  # what the watchdog reads (pools, heartbeats)

    moved = False  # a server or S3 endpoint on a new port: the workers must follow
    server = state["procs"].get("prefect-server")
    if _proc(server) is None:
        port = _free_port(state.get("api_port"))
        moved |= port != state.get("api_port")
        state.update(api_port=port, api_url=f"http://127.0.0.1:{port}/api")
        env = {
            **_base_env(root),
            "PREFECT_UI_ENABLED": "true" if ui else "false",
            # The UI calls this API URL (by default port 4200, whatever --port says).
            "PREFECT_UI_API_URL": state["api_url"],
        }
        _spawn(
            root,
            state,
            "prefect-server",
            [_exe("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env,
            root,
        )
        say(f"starting the Prefect server on 127.0.0.1:{port}")
    _wait_http(
        f"{state['api_url']}/health", state["procs"]["prefect-server"], "prefect server", 180
    )

    moto = state["procs"].get("moto-s3")
    if _proc(moto) is None:
        port = _free_port(state.get("s3_port"))
        moved |= port != state.get("s3_port")
        state.update(s3_port=port, s3_endpoint=f"http://127.0.0.1:{port}")
        _spawn(
            root,
            state,
            "moto-s3",
            [_exe("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            _base_env(root),
            root,
        )
        say(f"starting the moto S3 server on 127.0.0.1:{port}")
    _wait_http(state["s3_endpoint"], state["procs"]["moto-s3"], "moto S3 server", 60)
    state["bucket"] = BUCKET
    _ensure_bucket(state)
    _save(root, state)

    pools = sorted(cfg.pools.definitions)
    _ensure_pools(root, state, pools)
    workspaces = _sync_workspaces(root, pools)
    # deploy when the server is new or what the deployments are made of changed: prefect.yaml,
    # and params.yaml with the config's declarations (the run form's fields and defaults,
    # the descriptions); a restart of a worker needs none
    made_of = ("prefect.yaml", "params.yaml", "dvc.yaml", "moe/config.py", "tasks/config.py")
    spec = hashlib.sha256(
        b"".join((root / f).read_bytes() for f in made_of if (root / f).is_file())
    ).hexdigest()
    if state.get("deployed") != [spec, state["procs"]["prefect-server"]["started"]]:
        _deploy(root, state, say)
        state["deployed"] = [spec, state["procs"]["prefect-server"]["started"]]
        _save(root, state)
    _point_pipeline_at_stack(state)
    with api_client(state) as client:  # flows/recovery.py: detect and recover lost machines
        for name in install_automations(client, cfg.recovery):
            say(f"automation: {name}")
    for pool in pools:
        name = f"worker-{pool}"
        running = _proc(state["procs"].get(name))
        if running is not None and moved:
            say(f"restarting {name}: the server or S3 moved to a new port")
            kill_tree(running)
        elif running is not None:
            continue
        start_worker(root, state, cfg, pool, workspaces[pool], query_seconds)
        say(f"starting {name} in {workspaces[pool]}")
    if _proc(state["procs"].get(WATCHDOG)) is None:
        _spawn(
            root,
            state,
            WATCHDOG,
            [sys.executable, "-m", "flows.cli", "stack", "watch"],
            {**_base_env(root), "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            root,
        )
        say("starting the watchdog (restarts a worker that dies or fails its health check)")
    _wait_workers(state, pools)
    state["overrides"] = stack_overrides(state)
    _save(root, state)
    say(f"stack up: Prefect API {state['api_url']}, S3 {state['s3_endpoint']}/{state['bucket']}")
    if ui:
        say(f"Prefect UI: http://127.0.0.1:{state['api_port']}")
    return state


def start_worker(
    root: Path,
    state: dict[str, Any],
    cfg: Any,
    pool: str,
    workspace: Path,
    query_seconds: float,
) -> None:
    """One process worker of `pool` in its working folder, with its health check on a port
    of its own (what the watchdog asks) and flow-run heartbeats (what detects a lost run)."""
    name = f"worker-{pool}"
    health = _free_port((state["procs"].get(name) or {}).get("health_port"))
    env = {
        **_api_env(root, state),
        **_s3_env(),
        "MOE_PIPELINE_DIR": str(workspace),
        "PYTHONPATH": str(workspace),
        "MOE_WORKER": name,
        "MOE_CODE_COMMIT": _commit(root),
        "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds),
        "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
        "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
        "PREFECT_WORKER_WEBSERVER_PORT": str(health),
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(cfg.recovery.heartbeat_s),
        "PREFECT_LOGGING_EXTRA_LOGGERS": "moe,tasks,flows",
    }
    cmd = [_exe("prefect"), "worker", "start", "--pool", pool, "--name", name]
    _spawn(root, state, name, [*cmd, "--type", "process", "--with-healthcheck"], env, workspace)
    state["procs"][name].update(health_port=health, pool=pool, query_seconds=query_seconds)
    _save(root, state)


def healthy(entry: dict[str, Any], timeout: float = 5.0) -> bool:
    """The worker's own health check (`--with-healthcheck`): 200 while it polls for work."""
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{entry['health_port']}/health", timeout=timeout
        ) as r:
            return r.status == 200
    except OSError:
        return False


def watch(root: Path, every: float = 2.0, grace: float = 60.0, say: Any = print) -> None:
    """Keep the stack's workers alive, as a cloud pool's infrastructure keeps its machines:
    a worker whose process is gone, or whose health check has failed for `grace` seconds
    (it answers once it polls; a hung one stops answering 200), is started again in its
    working folder. Returns when the stack is taken down (its server entry is gone)."""
    root = root.resolve()
    failing: dict[str, float] = {}
    while True:
        state = load_state(root)
        if _proc(state["procs"].get("prefect-server")) is None:
            return
        try:
            _watch_once(root, state, failing, grace, say)
        except Exception as e:  # noqa: BLE001 - a watchdog that dies watches nothing: say, go on
            say(f"watchdog: {type(e).__name__}: {e}")
        time.sleep(every)


def _watch_once(
    root: Path, state: dict[str, Any], failing: dict[str, float], grace: float, say: Any
) -> None:
    sick = []
    for name, entry in state["procs"].items():
        if not name.startswith("worker-") or "health_port" not in entry:
            continue
        alive = _proc(entry) is not None
        if alive and healthy(entry):
            failing.pop(name, None)
        elif alive:
            first = failing.setdefault(name, time.monotonic())
            if time.monotonic() - first >= grace:
                sick.append(name)
        else:
            sick.append(name)
    if not sick:
        return
    with _locked(root):
        state = load_state(root)  # as `up` or `down` may have left it meanwhile
        if _proc(state["procs"].get("prefect-server")) is None:
            return
        cfg = load_config(state.get("params_file") or root / "params.yaml")
        for name in sick:
            entry = state["procs"].get(name)
            if entry is None or "health_port" not in entry:
                continue
            proc = _proc(entry)
            if proc is not None and healthy(entry):
                continue  # restarted or recovered meanwhile
            if proc is not None:
                say(f"{name} failed its health check for {grace:.0f} s: restarting it")
                # the worker alone: its flow runs live in sessions of their own and go on
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
                    proc.wait(10)
            else:
                say(f"{name} is gone: starting it again")
            failing.pop(name, None)
            pool = entry["pool"]
            start_worker(
                root, state, cfg, pool, root / STATE_DIR / "work" / pool, entry["query_seconds"]
            )


def _commit(root: Path) -> str:
    """The commit the workers' code copies come from (lineage records name it)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


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


def _ensure_bucket(state: dict[str, Any]) -> None:
    s3 = s3_client(state)
    if state["bucket"] not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
        s3.create_bucket(Bucket=state["bucket"])


def api_client(state: dict[str, Any]) -> Any:
    """A Prefect client for the stack's server."""
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(state["api_url"])


def _ensure_pools(root: Path, state: dict[str, Any], pools: list[str]) -> None:
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


def _sync_workspaces(root: Path, pools: list[str]) -> dict[str, Path]:
    """Copy the code into each pool's working folder (refreshed on every `up`; the outputs
    and checkpoints already there are kept)."""
    out = {}
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for pool in pools:
        ws = root / STATE_DIR / "work" / pool
        ws.mkdir(parents=True, exist_ok=True)
        for name in CODE:
            src, dst = root / name, ws / name
            if src.is_dir():
                shutil.copytree(src, dst, ignore=ignore, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copy2(src, dst)
        out[pool] = ws
    return out


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


def _deploy(root: Path, state: dict[str, Any], say: Any) -> None:
    say("deploying prefect.yaml (one deployment per stage, the pipeline and recover)")
    spec = local_deployments(root)
    proc = subprocess.run(
        [_exe("prefect"), "--no-prompt", "deploy", "--all", "--prefect-file", str(spec)],
        cwd=root,
        env=_api_env(root, state),
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise StackError(
            "prefect deploy --all failed (prefect.yaml):\n" + (proc.stdout + proc.stderr)[-3000:]
        )


def _point_pipeline_at_stack(state: dict[str, Any]) -> None:
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


def _wait_workers(state: dict[str, Any], pools: list[str], timeout: float = 180) -> None:
    deadline = time.time() + timeout
    with api_client(state) as client:
        while True:
            missing = []
            for pool in pools:
                names = {
                    w.name
                    for w in client.read_workers_for_work_pool(pool)
                    if w.status.value == "ONLINE"
                }
                if f"worker-{pool}" not in names:
                    missing.append(pool)
                    if _proc(state["procs"].get(f"worker-{pool}")) is None:
                        raise StackError(
                            f"the worker of pool {pool} exited; see "
                            f"{state['procs'][f'worker-{pool}']['log']}"
                        )
            if not missing:
                return
            if time.time() > deadline:
                raise StackError(f"workers of {missing} did not come online in {timeout:.0f} s")
            time.sleep(1)


def status(root: Path) -> dict[str, Any]:
    """What the stack runs: each process (alive or not) and each pool's workers."""
    root = root.resolve()
    state = load_state(root)
    procs = {
        name: {"pid": e["pid"], "running": _proc(e) is not None, "log": e["log"]}
        for name, e in state["procs"].items()
    }
    pools: dict[str, Any] = {}
    if procs.get("prefect-server", {}).get("running"):
        try:
            with api_client(state) as client:
                for wp in client.read_work_pools():
                    pools[wp.name] = {
                        "type": wp.type,
                        "workers": {
                            w.name: w.status.value
                            for w in client.read_workers_for_work_pool(wp.name)
                        },
                    }
        except Exception as e:  # noqa: BLE001 - a status report names the failure
            pools = {"error": str(e)}
    return {
        "api_url": state.get("api_url"),
        "ui_url": state["api_url"].removesuffix("/api") if state.get("api_url") else None,
        "s3_endpoint": state.get("s3_endpoint"),
        "bucket": state.get("bucket"),
        "processes": procs,
        "pools": pools,
    }


def down(root: Path, say: Any = print, timeout: float = 30) -> list[str]:
    """Stop the processes `up` started (the workers together, then S3, then the server),
    each with the processes it started (flow runs); returns their names. Each group gets
    SIGTERM, and SIGKILL for what is left after `timeout` seconds."""
    root = root.resolve()
    with _locked(root):
        return _down(root, say, timeout)


def _down(root: Path, say: Any, timeout: float) -> list[str]:
    state = load_state(root)
    names = list(state["procs"])
    if _proc(state["procs"].get("prefect-server")) is not None:
        try:  # the stopped workers' runs end Crashed: nothing may run them again
            with api_client(state) as client:
                remove_automations(client)
        except Exception as e:  # noqa: BLE001 - stopping goes on; say what was left
            say(f"could not remove the recovery automations: {e}")
    groups = [
        [n for n in names if n == WATCHDOG],  # first: it would start the workers again
        [n for n in names if n.startswith("worker-")],
        [n for n in names if not n.startswith("worker-") and n not in ("prefect-server", WATCHDOG)],
        [n for n in names if n == "prefect-server"],
    ]
    stopped = []
    for group in groups:
        procs = {n: _proc(state["procs"][n]) for n in group}
        kill_trees([p for p in procs.values() if p is not None], timeout)
        for name, p in procs.items():
            if p is not None:
                stopped.append(name)
                say(f"stopped {name} (pid {p.pid})")
            del state["procs"][name]
        _save(root, state)
    return stopped


def kill_tree(p: psutil.Process, timeout: float = 30, sig: str = "term") -> None:
    """Stop a process and every process under it (SIGTERM, then SIGKILL after `timeout`)."""
    kill_trees([p], timeout, sig)


def kill_trees(roots: list[psutil.Process], timeout: float = 30, sig: str = "term") -> None:
    """Stop processes and every process under them, all at once (one wait, not one each)."""
    family: list[psutil.Process] = []
    for p in roots:
        try:
            family += [*p.children(recursive=True), p]
        except psutil.NoSuchProcess:
            pass
    for q in family:
        try:
            q.kill() if sig == "kill" else q.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(family, timeout=timeout)
    for q in alive:
        try:
            q.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=10)


def run(
    root: Path,
    params_file: str | None = None,
    overrides: list[str] | None = None,
    stages: list[str] | None = None,
    handoff: str | None = None,
    say: Any = print,
) -> dict[str, Any]:
    """Start the pipeline deployment on the stack (dispatch: deployments) and wait for it."""
    root = root.resolve()
    state = load_state(root)
    if _proc(state["procs"].get("prefect-server")) is None:
        raise StackError("the stack is not up: run `moe-pipeline stack up` first")
    cfg = load_config(
        params_file or (root / "params.yaml"), [*state["overrides"], *(overrides or [])]
    )
    fr = start_deployment(
        state,
        "pipeline",
        {"params": cfg.to_dict(), "stages": stages, "dispatch": "deployments", "handoff": handoff},
    )
    say(f"pipeline flow run {fr.id} ({fr.name}) started")
    fr = wait_flow_run(state, fr.id, say=lambda s: say(f"pipeline: {s}"))
    return {
        "flow_run_id": str(fr.id),
        "state": fr.state.name,
        "completed": fr.state.is_completed(),
        "message": fr.state.message,
    }


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
