"""How long the CLI takes to answer, against a bare interpreter started the same way.

    .venv/bin/python bench/cli_start.py [--rounds 7] [--root CHECKOUT] [--only NAME ...]

(`--root` another checkout, e.g. `git worktree add /tmp/old COMMIT`: its code, this venv.)

Each round runs every command once, in turn (A B C ... A B C: the machine's noise falls on
all alike), in a fresh process from the project root; the first round is a warm-up (the page
cache) and is not counted. Prints, per command, the median wall time, its ratio to a bare
`python -c pass`, and whether the process imported torch (read from `-X importtime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "help": ["-m", "flows.cli", "--help"],
    "params explain finetune_sql.lr": ["-m", "flows.cli", "params", "explain", "finetune_sql.lr"],
    "params check": ["-m", "flows.cli", "params", "check"],
    "plan": ["-m", "flows.cli", "plan"],
    "lineage --help": ["-m", "flows.cli", "lineage", "--help"],
    "stack status": ["-m", "flows.cli", "stack", "status", "--root", "/nonexistent-stack"],
    "model import --help": ["-m", "flows.cli", "model", "import", "--help"],
}


def run_once(args: list[str], env: dict[str, str], root: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, check=False)
    return time.perf_counter() - t0


def imports_torch(args: list[str], env: dict[str, str], root: Path) -> bool:
    r = subprocess.run(
        [sys.executable, "-X", "importtime", *args], cwd=root, env=env, capture_output=True,
        text=True, check=False,
    )  # fmt: skip
    return any(line.split("|")[-1].strip() == "torch" for line in r.stderr.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="counted rounds (after one warm-up)")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose CLI is timed")
    ap.add_argument("--only", nargs="+", default=None, help="these commands (and the bare one)")
    args = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(args.root)}
    commands = {k: v for k, v in COMMANDS.items() if not args.only or k in args.only or "pass" in k}
    times: dict[str, list[float]] = {name: [] for name in commands}
    for r in range(args.rounds + 1):
        for name, cmd in commands.items():
            t = run_once(cmd, env, args.root)
            if r:
                times[name].append(t)
    bare = statistics.median(times["python -c pass"])
    rows = []
    for name, cmd in commands.items():
        med = statistics.median(times[name])
        row = {
            "command": name,
            "median_s": round(med, 3),
            "ratio_vs_bare": round(med / bare, 1),
            "imports_torch": imports_torch(cmd, env, args.root),
        }
        rows.append(row)
        print(
            f"{name:32s} {med:7.3f} s  {med / bare:6.1f}x bare  "
            f"{'torch' if row['imports_torch'] else 'no torch'}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
