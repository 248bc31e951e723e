"""Memory of one `moe-pipeline run` process across two training stages, with and without
handing freed memory back between stages (flows.stages.return_freed_memory).

    .venv/bin/python bench/stage_memory.py PROJECT [--repeats 2] [--set K=V ...]

PROJECT is a pipeline project whose earlier stages have run (a bench/sql_real.py project:
prepared data, an imported model as model.init). Each run is `moe-pipeline run --force
--stages finetune_sql finetune_domain` in a process of its own; "keep" runs it with
return_freed_memory replaced by a function that does nothing, "trim" as the code stands. The
two alternate (keep trim keep trim ...). The process's RssAnon (its private resident memory)
is sampled every 0.2 s. Reported per run: the peak while finetune_sql ran, the memory held
when its lineage record appeared (written just after the hand-back), and the peak in
finetune_domain. Both stages' outputs and checkpoints are deleted and written again: use a
scratch project.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from hf_import import anon_mb  # noqa: E402

CHILD = """
import sys
import flows.stages
if sys.argv[1] == "keep":
    flows.stages.return_freed_memory = lambda: False
from flows.cli import main
sys.exit(main(sys.argv[2:]))
"""


def one(project: Path, side: str, sets: list[str]) -> dict:
    marker = project / "models" / "finetune_sql" / "lineage.json"
    marker.unlink(missing_ok=True)
    for stage in ("finetune_sql", "finetune_domain"):  # or the stage resumes its last step
        shutil.rmtree(project / "models" / stage / "checkpoints", ignore_errors=True)
    cmd = [sys.executable, "-c", CHILD, side, "run", "--force"]
    cmd += ["--stages", "finetune_sql", "finetune_domain"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(project / f"memory-{side}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
        sql_peak = held = domain_peak = 0.0
        while proc.poll() is None:
            gb = anon_mb(proc.pid) / 1024
            if not held:
                if marker.is_file():
                    held = gb
                else:
                    sql_peak = max(sql_peak, gb)
            else:
                domain_peak = max(domain_peak, gb)
            time.sleep(0.2)
    if proc.returncode != 0 or not held:
        sys.exit(f"{side}: {' '.join(cmd)} failed, see {project / f'memory-{side}.log'}")
    return {
        "side": side,
        "finetune_sql_peak_gb": round(sql_peak, 2),
        "held_after_finetune_sql_gb": round(held, 2),
        "finetune_domain_peak_gb": round(domain_peak, 2),
        "wall_s": round(time.perf_counter() - t0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    rows = []
    for _ in range(a.repeats):
        for side in ("keep", "trim"):
            rows.append(one(a.project.resolve(), side, a.sets))
            print(json.dumps(rows[-1]), flush=True)
    print("| side | finetune_sql peak | held after finetune_sql | finetune_domain peak |")
    print("|---|---|---|---|")
    for side in ("keep", "trim"):
        got = [r for r in rows if r["side"] == side]
        cells = [
            f"{statistics.median(r[k] for r in got):.2f} GB"
            for k in ("finetune_sql_peak_gb", "held_after_finetune_sql_gb",
                      "finetune_domain_peak_gb")
        ]  # fmt: skip
        print(f"| {side} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
