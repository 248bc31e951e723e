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
change `.stack/stack.json` under a file lock. The processes and that record of them are
flows/stack_processes.py's; what the servers hold (bucket, pools, deployments),
flows/stack_server.py's.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from flows.recovery import install as install_automations
from flows.recovery import remove as remove_automations
from flows.stack_processes import (
    STATE_DIR,
    StackError,
    api_env,
    base_env,
    executable,
    free_port,
    kill_tree,
    kill_trees,
    live_process,
    load_state,
    locked,
    save_state,
    spawn,
    wait_http,
)
from flows.stack_server import (
    api_client,
    deploy_if_changed,
    ensure_bucket,
    ensure_pools,
    point_pipeline_at_stack,
    stack_overrides,
    start_deployment,
    wait_flow_run,
)
from tasks.config import load_config

WATCHDOG = "watchdog"
# How often a worker tells the server it lives (Prefect's default). Each beat is a write to
# the server's SQLite, like each poll (`up`'s query_seconds); the watchdog asks the worker's
# own health port instead, so a faster beat buys nothing here.
WORKER_HEARTBEAT_S = 30
BUCKET = "moe-stack"
# Files a worker's working folder gets: the code and its configuration (not data or outputs).
CODE = ("moe", "tasks", "flows", "params.yaml", "prefect.yaml", "dvc.yaml", "pyproject.toml")


def up(
    root: Path,
    params_file: str | None = None,
    ui: bool = True,
    query_seconds: float = 5.0,
    say: Any = print,
) -> dict[str, Any]:
    """Start (or complete) the stack; returns its state. `query_seconds`: how often each
    worker asks the server for runs. Each ask writes to the server's SQLite, and a write that
    meets another's lock is refused: beside a busy CPU the UI's run form was refused 11% of
    the time at 1 s, 6.5% at 2 s and 1% at 5 s (bench/stack_submit.py). A stage starts at
    most that much later."""
    root = root.resolve()
    with locked(root):
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

    moved = _start_server(root, state, ui, say)  # on a new port: the workers must follow
    moved |= _start_s3(root, state, say)
    pools = sorted(cfg.pools.definitions)
    ensure_pools(root, state, pools)
    workspaces = _sync_workspaces(root, pools)
    deploy_if_changed(root, state, say)
    point_pipeline_at_stack(state)
    with api_client(state) as client:  # flows/recovery.py: detect and recover lost machines
        for name in install_automations(client, cfg.recovery):
            say(f"automation: {name}")
    for pool in pools:
        name = f"worker-{pool}"
        running = live_process(state["procs"].get(name))
        if running is not None and moved:
            say(f"restarting {name}: the server or S3 moved to a new port")
            kill_tree(running)
        elif running is not None:
            continue
        start_worker(root, state, cfg, pool, workspaces[pool], query_seconds)
        say(f"starting {name} in {workspaces[pool]}")
    if live_process(state["procs"].get(WATCHDOG)) is None:
        spawn(
            root,
            state,
            WATCHDOG,
            [sys.executable, "-m", "flows.cli", "stack", "watch"],
            {**base_env(root), "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
            root,
        )
        say("starting the watchdog (restarts a worker that dies or fails its health check)")
    _wait_workers(state, pools)
    state["overrides"] = stack_overrides(state)
    save_state(root, state)
    say(f"stack up: Prefect API {state['api_url']}, S3 {state['s3_endpoint']}/{state['bucket']}")
    if ui:
        say(f"Prefect UI: http://127.0.0.1:{state['api_port']}")
    return state


def _start_server(root: Path, state: dict[str, Any], ui: bool, say: Any) -> bool:
    """The Prefect server, unless it runs, and its answer; whether it moved to a new port."""
    moved = False
    server = state["procs"].get("prefect-server")
    if live_process(server) is None:
        port = free_port(state.get("api_port"))
        moved = port != state.get("api_port")
        state.update(api_port=port, api_url=f"http://127.0.0.1:{port}/api")
        env = {
            **base_env(root),
            "PREFECT_UI_ENABLED": "true" if ui else "false",
            # The UI calls this API URL (by default port 4200, whatever --port says).
            "PREFECT_UI_API_URL": state["api_url"],
            # A write refused while another holds SQLite's lock answers 503: Prefect's
            # clients retry it, the UI shows "Something went wrong". The log says which.
            "PREFECT_SERVER_LOG_RETRYABLE_ERRORS": "true",
        }
        spawn(
            root,
            state,
            "prefect-server",
            [executable("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env,
            root,
        )
        say(f"starting the Prefect server on 127.0.0.1:{port}")
    wait_http(f"{state['api_url']}/health", state["procs"]["prefect-server"], "prefect server", 180)
    return moved


def _start_s3(root: Path, state: dict[str, Any], say: Any) -> bool:
    """The moto S3 server, unless it runs, and the bucket on it; whether it moved to a new
    port."""
    moved = False
    moto = state["procs"].get("moto-s3")
    if live_process(moto) is None:
        port = free_port(state.get("s3_port"))
        moved = port != state.get("s3_port")
        state.update(s3_port=port, s3_endpoint=f"http://127.0.0.1:{port}")
        spawn(
            root,
            state,
            "moto-s3",
            [executable("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
            base_env(root),
            root,
        )
        say(f"starting the moto S3 server on 127.0.0.1:{port}")
    wait_http(state["s3_endpoint"], state["procs"]["moto-s3"], "moto S3 server", 60)
    state["bucket"] = BUCKET
    ensure_bucket(state)
    save_state(root, state)
    return moved


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
    health = free_port((state["procs"].get(name) or {}).get("health_port"))
    env = {
        **api_env(root, state),
        **_s3_env(),
        "MOE_PIPELINE_DIR": str(workspace),
        "PYTHONPATH": str(workspace),
        "MOE_WORKER": name,
        "MOE_CODE_COMMIT": _commit(root),
        "PREFECT_WORKER_QUERY_SECONDS": str(query_seconds),
        "PREFECT_WORKER_HEARTBEAT_SECONDS": str(WORKER_HEARTBEAT_S),
        "PREFECT_WORKER_WEBSERVER_HOST": "127.0.0.1",
        "PREFECT_WORKER_WEBSERVER_PORT": str(health),
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(cfg.recovery.heartbeat_s),
        "PREFECT_LOGGING_EXTRA_LOGGERS": "moe,tasks,flows",
    }
    cmd = [executable("prefect"), "worker", "start", "--pool", pool, "--name", name]
    spawn(root, state, name, [*cmd, "--type", "process", "--with-healthcheck"], env, workspace)
    state["procs"][name].update(health_port=health, pool=pool, query_seconds=query_seconds)
    save_state(root, state)


def _commit(root: Path) -> str:
    """The commit the workers' code copies come from (lineage records name it)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def _s3_env() -> dict[str, str]:
    """Credentials for the stack's moto server (any value works there)."""
    return {
        "AWS_ACCESS_KEY_ID": "stack",
        "AWS_SECRET_ACCESS_KEY": "stack",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


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
        if live_process(state["procs"].get("prefect-server")) is None:
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
        alive = live_process(entry) is not None
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
    with locked(root):
        state = load_state(root)  # as `up` or `down` may have left it meanwhile
        if live_process(state["procs"].get("prefect-server")) is None:
            return
        cfg = load_config(state.get("params_file") or root / "params.yaml")
        for name in sick:
            entry = state["procs"].get(name)
            if entry is None or "health_port" not in entry:
                continue
            proc = live_process(entry)
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
                    if live_process(state["procs"].get(f"worker-{pool}")) is None:
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
        name: {"pid": e["pid"], "running": live_process(e) is not None, "log": e["log"]}
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
    with locked(root):
        return _down(root, say, timeout)


def _down(root: Path, say: Any, timeout: float) -> list[str]:
    state = load_state(root)
    names = list(state["procs"])
    if live_process(state["procs"].get("prefect-server")) is not None:
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
        procs = {n: live_process(state["procs"][n]) for n in group}
        # each recorded process is stopped in its group's turn, not as another's child
        others = {
            p.pid for n in names if n not in group and (p := live_process(state["procs"].get(n)))
        }
        kill_trees([p for p in procs.values() if p is not None], timeout, spare=frozenset(others))
        for name, p in procs.items():
            if p is not None:
                stopped.append(name)
                say(f"stopped {name} (pid {p.pid})")
            del state["procs"][name]
        save_state(root, state)
    return stopped


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
    if live_process(state["procs"].get("prefect-server")) is None:
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
