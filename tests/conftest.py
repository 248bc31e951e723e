"""Shared fixtures. Servers a test needs (moto S3) are started here on 127.0.0.1 and stopped."""

from __future__ import annotations

import contextlib
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

import pytest

# Offline hygiene for every test, set before collection imports Prefect, botocore or W&B
# (they read these when imported or first used) and restored when the session ends.
OFFLINE_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "DVC_NO_ANALYTICS": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "WANDB_MODE": "disabled",
}
# One OpenMP thread per process (PyTorch's intra-op pool), in the tests and every child they
# start (CLI, dvc, stack workers and their flow runs), unless the caller chose a number: two
# test files run at once on 2 cores, and a second thread per process there only spins against
# the other file's (an evaluate stage of the tiny pipeline: 31-41 s with 2 threads, 1.6 s with
# 1, under that load). The models here are too small to gain from a second thread; runs
# compared bit for bit all run in this same setting. Set before collection imports torch.
THREAD_ENV = {"OMP_NUM_THREADS": "1"}
_SAVED_ENV: dict[str, str | None] = {}


def pytest_configure(config: pytest.Config) -> None:
    _SAVED_ENV.update({k: os.environ.get(k) for k in (*OFFLINE_ENV, *THREAD_ENV)})
    os.environ.update(OFFLINE_ENV)
    for k, v in THREAD_ENV.items():
        os.environ.setdefault(k, v)


# The files that take minutes, longest first: with two workers (pytest-xdist, --dist
# loadfile) the longest never starts last, so the wall time nears half the CPU time
# (durations of the last full run: tests/README.md). The order within them, and of the rest,
# stays pytest-randomly's.
LONGEST_FIRST = (
    "test_stack.py",
    "test_e2e.py",
    "test_distributed.py",
    "test_hf_pipeline.py",
    "test_multinode.py",
    "test_large_corpus.py",
    "test_retry_resume.py",
    "test_events.py",
    "test_postgres.py",
)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Any:
    """After pytest-randomly's shuffle (an inner wrapper), the longest files move to the front."""
    result = yield
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    return result


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """The random order's seed, also under -q (which hides pytest-randomly's header line):
    a failure that depends on the order is replayed with `pytest -p randomly --randomly-seed=N`."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None:
        terminalreporter.write_line(f"test order: --randomly-seed={seed}")


def pytest_unconfigure(config: pytest.Config) -> None:
    for k, v in _SAVED_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


ROOT = Path(__file__).resolve().parents[1]


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line a child writes to its stdout pipe (stripped); fails the test, naming the
    child's exit status, when none comes within `timeout` seconds instead of blocking. A
    reader thread per child feeds a queue, so lines that arrive together are not lost in
    the pipe's buffer."""
    import queue
    import threading

    lines = getattr(proc, "_lines", None)
    if lines is None:
        lines = proc._lines = queue.Queue()  # type: ignore[attr-defined]

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
    try:
        return lines.get(timeout=timeout).strip()
    except queue.Empty:
        pytest.fail(f"no line from the child within {timeout} s (exit status {proc.poll()})")


def cli_env(
    prefect_server: dict[str, str] | None, code: Path = ROOT, **extra: str
) -> dict[str, str]:
    """The environment of a `moe-pipeline` subprocess in a test: the test's Prefect server,
    the venv's tools (dvc, prefect) first on PATH, the modules of `code` importable."""
    return {
        **os.environ,
        **(prefect_server or {}),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(code),
        **extra,
    }


def pipeline_cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 900
) -> subprocess.CompletedProcess:
    """`moe-pipeline ARGS` (python -m flows.cli) in `cwd`, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env if env is not None else cli_env(None),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A real S3 API (moto's server mode) on 127.0.0.1; yields its endpoint URL."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def merge(base: dict, over: dict) -> dict:
    """`over` layered into `base` (nested mappings merged, other values replaced)."""
    for k, v in over.items():
        base[k] = merge(base.get(k, {}), v) if isinstance(v, dict) else v
    return base


def tiny_params() -> dict:
    """A configuration small enough to run the whole pipeline in about a minute on 2 cores."""
    return {
        "data": {
            "max_bytes": 600_000,
            "val_fraction": 0.1,
            "sql_generic_pairs": 400,
            "sql_domain_train_pairs": 60,
            "sql_domain_test_pairs": 20,
        },
        "tokenizer": {"vocab_size": 512},
        "model": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 288, "dense_hidden": 128},
        "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 64},
        "pretrain": {
            "max_steps": 12,
            "batch_size": 8,
            "checkpoint_every": 6,
            "eval_every": 6,
            "eval_batches": 2,
            "log_every": 4,
            "warmup_steps": 2,
            "device": "cpu",  # the tests compare bit-exact CPU runs, GPU host or not
        },
        "finetune_sql": {
            "max_steps": 6,
            "batch_size": 8,
            "checkpoint_every": 3,
            "log_every": 3,
            "max_len": 288,
            "device": "cpu",
        },
        "finetune_domain": {
            "max_steps": 6,
            "batch_size": 8,
            "checkpoint_every": 3,
            "log_every": 3,
            "max_len": 288,
            "device": "cpu",
        },
        "evaluate": {"max_examples": 4, "max_new_tokens": 100, "val_batches": 2, "device": "cpu"},
        "wandb": {"mode": "disabled"},
    }


def stack_copy(root: Path, **params: dict) -> Path:
    """A copy of the project's code for a local stack in `root` (flows/stack.py CODE and
    infra), with params.yaml at tiny_params() plus `params` (section -> values), committed to
    git as the stack's workers expect."""
    import yaml

    from flows.stack import CODE

    for name in (*CODE, "infra"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, root / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, root / name)
    merged = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), tiny_params())
    (root / "params.yaml").write_text(yaml.safe_dump(merge(merged, params), sort_keys=False))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(root)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "stack copy"]):
        subprocess.run([*git, *args], check=True)
    return root


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real `prefect server` on 127.0.0.1 with its own database and its UI (told its API's
    URL, as infra/with-prefect-server.sh and `stack up` do); yields the env to reach it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",
    }
    env.pop("PREFECT_API_URL", None)
    exe = Path(sys.executable).with_name("prefect")
    log = open(home / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(exe), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    api = f"http://127.0.0.1:{port}/api"
    deadline = time.time() + 120
    while True:
        try:
            urllib.request.urlopen(f"{api}/health", timeout=2)
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(
                    f"prefect server did not start; see {home / 'server.log'}"
                ) from None
            time.sleep(0.5)
    yield {"PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_UI_URL": api[: -len("/api")]}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",
    "--window-size=1400,1000",
]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's headless Chromium (`make test` installs it where it can). Missing under CI is
    a failure, not a skip: CI must show the UI works; on a laptop without it, a skip says why."""
    import shutil

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (apt-get install chromium): the UI is untested")
        pytest.skip("chromium is not installed here (apt-get install chromium)")
    return exe


def browse(chromium: str, url: str, tmp: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (headless Chromium); optionally a screenshot."""
    what = [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    r = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp}", *what, url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


def ui_settings(ui_url: str) -> dict:
    """What the Prefect UI served at `ui_url` will call (its /ui-settings)."""
    import json

    with urllib.request.urlopen(f"{ui_url}/ui-settings", timeout=10) as resp:
        return json.loads(resp.read())


def _postgres_bin() -> Path | None:
    """The PostgreSQL binaries the `pgserver` wheel ships (a dev dependency: pip brings the
    server, so CI needs no apt), found without importing pgserver (whose own launcher adds a
    system user when run as root and listens on a socket only)."""
    import importlib.util

    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"
    return found if (found / "postgres").is_file() else None


@contextlib.contextmanager
def running_postgres(bin_dir: Path) -> Iterator[dict[str, Any]]:
    """A real PostgreSQL server on 127.0.0.1 (a free port), password logins only (scram),
    stopped and its folder removed afterwards. As root the server runs as `nobody`
    (PostgreSQL refuses root). Yields where it is, its superuser `owner` and that one's
    password, and `psql` (a function running SQL as the owner on a database)."""
    import secrets
    import shutil
    import tempfile

    as_root = os.geteuid() == 0
    user = "nobody" if as_root else None
    home = Path(tempfile.mkdtemp(prefix="moe-pg-"))  # /tmp: `nobody` reaches it
    password = "owner-" + secrets.token_hex(8)
    (home / "pw").write_text(password + "\n")
    if as_root:
        shutil.chown(home, "nobody")
        shutil.chown(home / "pw", "nobody")
        # a copy `nobody` can reach wherever the checkout lives (a 0700 home folder, say), in
        # the wheel's layout: the binaries find libpq at $ORIGIN/../../../pgserver.libs
        site = bin_dir.parents[2]
        shutil.copytree(bin_dir.parent, home / "pkg" / "pgserver" / "pginstall",
                        ignore=shutil.ignore_patterns("include"))  # fmt: skip
        if (site / "pgserver.libs").is_dir():
            shutil.copytree(site / "pgserver.libs", home / "pkg" / "pgserver.libs")
        bin_dir = home / "pkg" / "pgserver" / "pginstall" / "bin"
    port = free_port()
    run = dict(user=user, check=True, capture_output=True, text=True, timeout=120)
    try:
        subprocess.run(
            [str(bin_dir / "initdb"), "-D", str(home / "data"), "-U", "owner", "-E", "UTF8",
             "--locale=C", f"--pwfile={home / 'pw'}", "--auth=scram-sha-256"],
            **run,
        )  # fmt: skip
        (home / "pw").unlink()
        opts = f"-h 127.0.0.1 -p {port} -k {home} -c fsync=off -c synchronous_commit=off"
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(home / "data"), "-w", "-t", "60",
             "-l", str(home / "server.log"), "-o", opts, "start"],
            **run,
        )  # fmt: skip

        def psql(sql: str, db: str = "postgres") -> str:
            import psycopg

            with psycopg.connect(
                host="127.0.0.1", port=port, user="owner", password=password, dbname=db,
                autocommit=True,
            ) as con:  # fmt: skip
                cur = con.execute(sql)
                if cur.description is None:
                    return ""
                return "\n".join("|".join(map(str, r)) for r in cur.fetchall())

        yield {"host": "127.0.0.1", "port": port, "owner": "owner", "password": password,
               "psql": psql, "log": home / "server.log"}  # fmt: skip
    finally:
        if (home / "data" / "postmaster.pid").exists():
            subprocess.run(
                [str(bin_dir / "pg_ctl"), "-D", str(home / "data"), "-m", "fast", "-w", "stop"],
                user=user, capture_output=True, timeout=60,
            )  # fmt: skip
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[dict[str, Any]]:
    """`running_postgres` on the binaries of the `pgserver` wheel (a dev dependency), for the
    session. Missing under CI is a failure, elsewhere a skip that says why."""
    bin_dir = _postgres_bin()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail("pgserver is not installed (make venv): PostgreSQL is untested")
        pytest.skip("pgserver (a PostgreSQL server wheel) is not installed here (make venv)")
    with running_postgres(bin_dir) as server:
        yield server
