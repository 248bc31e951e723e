"""Resident memory of one training stage step by step, packed against unpacked: does a long
finetune hold its memory (issue 66: steps 150-180 within 10% of steps 20-40)?

    .venv/bin/python bench/step_memory.py PROJECT --stage finetune_sql \
        --recipe configs/smollm2-135m-sql-cpu.yaml --steps 180 --arms packed unpacked \
        [--set K=V ...]

PROJECT is a pipeline project whose earlier stages have run (a bench/sql_real.py project:
prepared data, model.init an import). Each arm copies PROJECT to PROJECT-ARM (the stage's
outputs are its own, so the two models can be scored afterwards: bench/sql_real.py --rescore)
and runs `moe-pipeline run --stages publish pretrain STAGE` there (--before) with `STAGE.packing` true or false and
`STAGE.max_steps` = --steps. The process's RssAnon (its private resident memory) is read
every 0.5 s; each time the stage's metrics.jsonl gains a row (every log_every steps) the
latest reading is kept against that row's step. Reported per arm: RssAnon at each logged
step, the median over steps 20-40 and over steps 150-180 (scaled to --steps), their ratio, the
peak, the wall time and the stage's last loss. JSON lines, then a table.
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


def run_arm(a: argparse.Namespace, arm: str) -> dict:
    project = a.project.parent / f"{a.project.name}-{arm}{'-' + a.tag if a.tag else ''}"
    if not project.exists():
        shutil.copytree(a.project, project, symlinks=True)
    metrics = project / "models" / a.stage / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    if a.runner == "recipes":  # the stage's training alone: no Prefect, the main thread
        shutil.rmtree(project / "models" / a.stage / "checkpoints", ignore_errors=True)
        cmd = [sys.executable, "-m", "moe.recipes", "finetune", "--stage", a.stage]
        cmd += ["--params", str(a.recipe), "--data", str(project / "data/prepared")]
        cmd += ["--init", str(project / "models/pretrain"), "--out", str(metrics.parent)]
    else:
        cmd = [sys.executable, "-m", "flows.cli", "run", "--params", str(a.recipe)]
        cmd += ["--stages", *a.before, a.stage, "--force"]
    sets = [f"{a.stage}.packing={'true' if arm == 'packed' else 'false'}"]
    sets += [f"{a.stage}.max_steps={a.steps}", *a.sets]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    with open(project / f"step_memory-{arm}.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
        at_step: dict[int, float] = {}
        peak, seen = 0.0, 0
        while p.poll() is None:
            now = anon_mb(p.pid)
            peak = max(peak, now)
            if metrics.is_file():
                rows = [json.loads(r) for r in metrics.read_text().splitlines() if r.strip()]
                for r in rows[seen:]:
                    if "step" in r and "loss" in r:
                        at_step[int(r["step"])] = now
                        last_loss = r["loss"]
                seen = len(rows)
            time.sleep(0.5)
    if p.returncode != 0:
        sys.exit(f"{arm}: {' '.join(cmd)} failed; see {project}/step_memory-{arm}.log")
    scale = a.steps / 180

    def window(lo: int, hi: int) -> float:
        xs = [mb for s, mb in at_step.items() if lo * scale <= s <= hi * scale]
        return statistics.median(xs) if xs else float("nan")

    early, late = window(20, 40), window(150, 180)
    return {
        "arm": arm,
        "project": str(project),
        "early_mb": round(early),
        "late_mb": round(late),
        "late_over_early": round(late / early, 3),
        "peak_mb": round(peak),
        "wall_s": round(time.perf_counter() - t0),
        "last_loss": last_loss,
        "mb_at_step": {s: round(mb) for s, mb in sorted(at_step.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("project", type=Path)
    ap.add_argument("--stage", default="finetune_sql")
    ap.add_argument("--recipe", type=Path, default=ROOT / "configs/smollm2-135m-sql-cpu.yaml")
    ap.add_argument("--steps", type=int, default=180)
    # the stages the measured one needs first (in a prepared project: publish, pretrain skipped)
    ap.add_argument("--before", nargs="*", default=["publish", "pretrain"])
    ap.add_argument("--arms", nargs="+", default=["packed", "unpacked"])
    # run: the pipeline's stage (Prefect, its task thread); recipes: `python -m moe.recipes`
    # on the project's models/pretrain (the same training in the main thread, no Prefect)
    ap.add_argument("--runner", choices=["run", "recipes"], default="run")
    ap.add_argument("--tag", default="", help="the copies are PROJECT-ARM[-TAG]")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()
    a.project, a.recipe = a.project.resolve(), a.recipe.resolve()
    rows = []
    for arm in a.arms:
        row = run_arm(a, arm)
        print(json.dumps(row), flush=True)
        rows.append(row)
    print("\n| arm | RssAnon steps 20-40 | steps 150-180 | ratio | peak | wall | last loss |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['arm']} | {r['early_mb']} MB | {r['late_mb']} MB | {r['late_over_early']} "
            f"| {r['peak_mb']} MB | {r['wall_s']} s | {r['last_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
