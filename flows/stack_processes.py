"""The local stack's processes (flows/stack.py): the state file that records them
(`.stack/stack.json`: pid and start time of each, the ports), the lock its writers take,
their environment, and starting, finding and stopping them with what they started.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

STATE_DIR = ".stack"


class StackError(RuntimeError):
    """Something the user can fix (named in the message)."""


def _state_path(root: Path) -> Path:
    return root / STATE_DIR / "stack.json"


def load_state(root: Path) -> dict[str, Any]:
    path = _state_path(root)
    return json.loads(path.read_text()) if path.is_file() else {"procs": {}}


def save_state(root: Path, state: dict[str, Any]) -> None:
    path = _state_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
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


def free_port(preferred: int | None = None) -> int:
    """`preferred` (the port of the last start, so URLs stay the same) if it is free."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", preferred or 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def live_process(entry: dict[str, Any] | None) -> psutil.Process | None:
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


def spawn(
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
    save_state(root, state)


def wait_http(url: str, entry: dict[str, Any], what: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if live_process(entry) is None:
                raise StackError(f"{what} exited; see {entry['log']}") from None
            if time.time() > deadline:
                raise StackError(
                    f"{what} did not answer {url} in {timeout:.0f} s; see {entry['log']}"
                ) from None
            time.sleep(0.5)


def executable(name: str) -> str:
    exe = Path(sys.executable).with_name(name)
    if not exe.is_file():
        raise StackError(f"{exe} is missing: install the project (make venv) and use its python")
    return str(exe)


# Real cloud credentials are not handed to the stack's processes: its bucket lives on moto.
_DROPPED = ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL")


def base_env(root: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k not in _DROPPED
    }
    env.update(
        PREFECT_HOME=str(root / STATE_DIR / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
    )
    return env


def api_env(root: Path, state: dict[str, Any]) -> dict[str, str]:
    return {**base_env(root), "PREFECT_API_URL": state["api_url"]}


def kill_tree(p: psutil.Process, timeout: float = 30, sig: str = "term") -> None:
    """Stop a process and every process under it (SIGTERM, then SIGKILL after `timeout`)."""
    kill_trees([p], timeout, sig)


def kill_trees(
    roots: list[psutil.Process],
    timeout: float = 30,
    sig: str = "term",
    spare: frozenset[int] = frozenset(),
) -> None:
    """Stop processes and every process under them, all at once (one wait, not one each),
    except the processes whose pid is in `spare` and theirs (a worker the watchdog started
    again is the watchdog's child, and is stopped in its own turn)."""

    def tree(p: psutil.Process) -> list[psutil.Process]:
        try:
            kids = p.children()
        except psutil.NoSuchProcess:
            return []
        return [p, *(q for k in kids if k.pid not in spare for q in tree(k))]

    family = [q for p in roots for q in tree(p)]
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
