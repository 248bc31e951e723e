"""How often the local stack's server refuses a run submitted from the UI, by how often its
workers poll.

The stack's Prefect server keeps its state in SQLite. A write that meets another's lock is
refused with 503 (the server's SQLite lock rule); Prefect's Python clients retry it, the UI
does not: the user reads "Something went wrong" and submits again. Each worker's poll for
scheduled runs writes too (the pools' and queues' last poll), so the workers' polling
interval (`flows.stack.up(query_seconds=)`, PREFECT_WORKER_QUERY_SECONDS) sets how busy the
lock is. This starts a stack per setting (a copy of the project with the tests' tiny params),
keeps the CPU busy as a test run or a stage beside it does (`--load` processes), and sends
the request the UI's run form sends (POST /deployments/{id}/create_flow_run, a run
scheduled years ahead so no worker picks it up), without retries, counting refusals. The
settings alternate (A B A B ...).

Run: `.venv/bin/python bench/stack_submit.py [--query 2 5] [--heartbeat 30] [--rounds 2]
[--posts 60] [--load 2]` (`--heartbeat`: the workers' PREFECT_WORKER_HEARTBEAT_SECONDS).
JSON last.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flows import stack  # noqa: E402
from tests.conftest import stack_copy  # noqa: E402

LATER = "2036-01-01T00:00:00Z"


def _project() -> Path:
    """A committed copy of the project's code with the tests' tiny params."""
    return stack_copy(Path(tempfile.mkdtemp(prefix="stack-submit-")))


def _burn(stop: Any) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def one(query: float, heartbeat: int, posts: int, load: int) -> dict[str, Any]:
    """A stack polling every `query` seconds, its workers beating every `heartbeat`; `posts`
    submits under `load` busy processes."""
    root = _project()
    stack.WORKER_HEARTBEAT_S = heartbeat
    spawn = multiprocessing.get_context("spawn")  # not forks of a process Prefect's client ran in
    stop = spawn.Event()
    burners = [spawn.Process(target=_burn, args=(stop,)) for _ in range(load)]
    codes, seconds = [], []
    try:
        state = stack.up(root, ui=True, query_seconds=query, say=lambda m: None)
        api = state["api_url"]
        dep = httpx.get(f"{api}/deployments/name/pipeline/pipeline").json()
        for b in burners:
            b.start()
        time.sleep(15)  # the workers' first polls and the server's start-up writes pass
        body = {"state": {"type": "SCHEDULED", "state_details": {"scheduled_time": LATER}}}
        for _ in range(posts):
            t0 = time.monotonic()
            r = httpx.post(f"{api}/deployments/{dep['id']}/create_flow_run", json=body, timeout=150)
            seconds.append(time.monotonic() - t0)
            codes.append(r.status_code)
            time.sleep(0.5)
    finally:
        stop.set()
        for b in burners:
            if b.pid is not None:
                b.join()
        stack.down(root, say=lambda m: None)
        shutil.rmtree(root, ignore_errors=True)
    return {
        "query_s": query,
        "heartbeat_s": heartbeat,
        "refused": sum(c != 201 for c in codes),
        "posts": posts,
        "codes": sorted(set(codes)),
        "median_s": round(statistics.median(seconds), 3),
        "max_s": round(max(seconds), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--query", type=float, nargs="+", default=[2.0, 5.0])
    ap.add_argument("--heartbeat", type=int, nargs="+", default=[stack.WORKER_HEARTBEAT_S])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--posts", type=int, default=60)
    ap.add_argument("--load", type=int, default=2, help="busy processes beside the stack")
    args = ap.parse_args()
    runs = []
    for r in range(args.rounds):
        for q in args.query:
            for hb in args.heartbeat:
                runs.append({"round": r, **one(q, hb, args.posts, args.load)})
                print(json.dumps(runs[-1]), flush=True)
    summary = {
        f"poll {q} s, beat {hb} s": {
            "refused": sum(
                x["refused"] for x in runs if (x["query_s"], x["heartbeat_s"]) == (q, hb)
            ),
            "posts": sum(x["posts"] for x in runs if (x["query_s"], x["heartbeat_s"]) == (q, hb)),
        }
        for q in args.query
        for hb in args.heartbeat
    }
    print(json.dumps({"load": args.load, "refused": summary, "runs": runs}))


if __name__ == "__main__":
    main()
