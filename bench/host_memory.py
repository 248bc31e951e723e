"""Host memory of a CPU training step over many steps, by how freed memory is handed back:
the SQL stage's resident memory grew ~60 MB a step (bench/RESULTS.md, sixth session).

    .venv/bin/python bench/host_memory.py MODEL_DIR [--steps 12] [--rounds 2] [--arms ...]

MODEL_DIR is a model directory `load_model_dir` reads (a bench/sql_real.py project's
models/finetune_sql, SmolLM2-135M). Each arm runs in a process of its own, the arms taking
turns (A B C A B C ...); every process trains the same steps: `--rows` rows of random tokens
as wide as the SQL stage's batches (200 to 640, a new width each step, drawn from one seed),
loss on the second half, bf16 autocast, AdamW. Arms:

- `glibc`: the C library as it comes;
- `trim`: `flows.stages.return_freed_memory()` (what `moe-pipeline run` calls between
  stages: a collection, then glibc's `malloc_trim(0)`) after each step; `trimN` after every
  N-th step;
- `mmap`: glibc with a fixed mmap threshold of 1 MiB (`MALLOC_MMAP_THRESHOLD_`; `mmapN`: N
  MiB), so every large tensor is its own mapping, unmapped when freed;
- `arenaN`: glibc with at most N arenas (`MALLOC_ARENA_MAX`);
- `jemalloc`: jemalloc preloaded (`LD_PRELOAD`; skipped where the library is absent);
  `jemalloc+keep` with its decay off (`MALLOC_CONF`: freed pages stay for reuse);
- `onednnN`: oneDNN's primitive cache held to N primitives (`ONEDNN_PRIMITIVE_CACHE_CAPACITY`,
  1024 by default): a bf16 matmul's primitive is made per shape, and the widths change;
- `lruN`: PyTorch's own cache of oneDNN computations (ideep's, `LRU_CACHE_CAPACITY`, 1024);
- `packed`: every step one shape, `--packed-rows` rows of 640 tokens (packed finetuning:
  bench/packing.py found 3 packed rows and 1 replay row a step); `packed+varyloss`: the same
  shape, but each row's prompt (no loss) 100-400 tokens long, drawn each step, so the
  positions through the output head (`loss_rows`) are a new count each step, as in the stage;
  `bucketN`: those positions rounded up to a multiple of N (moe/model/transformer.py
  `LOSS_ROW_BUCKET`, 64; `bucket1`: as they come).

Arms combine with `+` (`mmap+onednn0`).

Per step: the peak resident size during the step (`/proc/self/clear_refs` resets it before
the step) and the step's time. Reported per arm: the largest step peak in the first and the
second half of the steps (growth shows as the second above the first), the resident size
after the last step and its growth a step from the third step on (what stays: with a trim,
read where the step trimmed), and the median step time over the steps after the first two,
with its ratio to `glibc`'s.
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
JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(
    model_dir: str, steps: int, rows: int, trim_every: int, fixed: int = 0, vary_loss: bool = False
) -> None:
    import numpy as np
    import torch

    import moe.model.transformer as T
    from moe.hf.model_dir import load_model_dir

    T.LOSS_ROW_BUCKET = int(os.environ.get("BENCH_LOSS_ROW_BUCKET", T.LOSS_ROW_BUCKET))

    torch.manual_seed(0)
    model = load_model_dir(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    rng = np.random.default_rng(0)
    vocab = model.vocab_size
    for step in range(steps):
        width = int(rng.integers(200, 641))
        width = fixed or width  # packed finetuning: every step max_len wide
        x = torch.randint(0, vocab, (rows, width))
        y = x.clone()
        # the loss on each row's second half; `vary_loss`: after a prompt of 100-400 tokens a
        # row, drawn each step, so the positions through the output head vary (packed rows do)
        for r in range(rows):
            y[r, : int(rng.integers(100, 401)) if vary_loss else width // 2] = -100
        loss_rows = torch.from_numpy(np.flatnonzero(y.numpy().reshape(-1) != -100))
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            w = torch.ones_like(y, dtype=torch.float32)
            _, loss, aux = model(x, y, w, logits=False, loss_rows=loss_rows)
        (loss + aux.balance_loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if trim_every and (step + 1) % trim_every == 0:
            from flows.stages import return_freed_memory  # Prefect's import: only where used

            return_freed_memory()
        dt = time.perf_counter() - t0
        row = {"step": step, "width": width, "s": dt, "peak": _vm("VmHWM"), "rss": _vm("VmRSS")}
        print(json.dumps(row), flush=True)


def run_arm(arm: str, a: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    every, rows, fixed, vary = 0, a.rows, 0, False
    for part in arm.split("+"):  # glibc, trim[N], mmap[N], arenaN, jemalloc, keep, onednnN, lruN; +
        if part.startswith("mmap"):
            env["MALLOC_MMAP_THRESHOLD_"] = str(int(part[4:] or 1) << 20)
        elif part.startswith("arena"):
            env["MALLOC_ARENA_MAX"] = part[5:]
        elif part == "keep":  # jemalloc keeps what is freed (no decay back to the system)
            env["MALLOC_CONF"] = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
        elif part == "jemalloc":
            env["LD_PRELOAD"] = str(JEMALLOC)
        elif part.startswith("trim"):
            every = int(part[4:] or 1)
        elif part.startswith("onednn"):
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = part[6:]
        elif part.startswith("lru"):
            env["LRU_CACHE_CAPACITY"] = part[3:]
        elif part == "packed":  # one shape a step: the packed rows of the SQL stage
            rows, fixed = a.packed_rows, 640
        elif part == "varyloss":  # ...and the loss positions a new count each step
            vary = True
        elif part.startswith("bucket"):  # the output head's rows a multiple of N (1: as they come)
            env["BENCH_LOSS_ROW_BUCKET"] = part[6:]
    cmd = [sys.executable, __file__, a.model, "--worker", "--steps", str(a.steps)]
    cmd += ["--rows", str(rows), "--trim-every", str(every), "--fixed", str(fixed)]
    cmd += ["--vary-loss"] * vary
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"arm {arm} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rows", type=int, default=10)  # 8 pairs + 2 replay rows, the bench's
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=["glibc", "trim", "mmap", "jemalloc"])
    ap.add_argument("--packed-rows", type=int, default=4)  # 3 packed + 1 replay (bench/packing.py)
    ap.add_argument("--fixed", type=int, default=0)  # worker: every step this wide
    ap.add_argument("--vary-loss", action="store_true")  # worker: the loss positions vary
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--trim-every", type=int, default=0)
    ap.add_argument("--trim", dest="trim_every", action="store_const", const=1)  # = every 1
    a = ap.parse_args()
    if a.worker:
        worker(a.model, a.steps, a.rows, a.trim_every, a.fixed, a.vary_loss)
        return
    arms = [x for x in a.arms if "jemalloc" not in x or JEMALLOC.exists()]
    runs: dict[str, list[list[dict]]] = {arm: [] for arm in arms}
    for r in range(a.rounds):
        for arm in arms:
            runs[arm].append(run_arm(arm, a))
            last = runs[arm][-1]
            print(f"round {r} {arm}: peak {max(s['peak'] for s in last) / 2**30:.2f} GiB,"
                  f" median step {statistics.median(s['s'] for s in last[2:]):.1f} s",
                  flush=True)  # fmt: skip
    half = a.steps // 2
    gib = 2**30
    report = {}
    for arm, rs in runs.items():
        report[arm] = {
            "peak_first_half_gib": round(max(s["peak"] for r in rs for s in r[:half]) / gib, 2),
            "peak_second_half_gib": round(max(s["peak"] for r in rs for s in r[half:]) / gib, 2),
            "rss_after_last_step_gib": round(max(r[-1]["rss"] for r in rs) / gib, 2),
            "median_step_s": round(statistics.median(s["s"] for r in rs for s in r[2:]), 2),
            # what stays after a step, step 2 to the last (trim arms: read after a trim)
            "rss_growth_mb_per_step": round(
                statistics.median((r[-1]["rss"] - r[2]["rss"]) / (len(r) - 3) for r in rs) / 2**20,
                1,
            ),
        }
    base = report.get("glibc", {}).get("median_step_s")
    for row in report.values():
        if base:
            row["step_time_ratio"] = round(row["median_step_s"] / base, 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
