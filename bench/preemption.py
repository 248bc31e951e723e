"""Training on machines that vanish: goodput and cost of three checkpoint policies.

Measures, on this machine and in this run, what the default model's checkpoints cost: the
stall a save puts on the training loop (`checkpoint_stall_s`, background writes), the time to
restore the newest checkpoint, and the time of one training step (medians over repeats). Then
simulates a training run of `--work-hours` of compute on a pool whose machines are
interrupted at exponential inter-arrival times with mean `--mtbi-hours`, `--runs` times per
policy (the same interruption times for every policy, run by run):

- `none`: no checkpoint until the end; an interruption restarts from step 0;
- `fixed`: every `pretrain.checkpoint_every` steps of params.yaml (the stage's own setting);
- `auto`: `checkpoint.every: auto`, Young/Daly from the measured stall and the MTBI
  (moe/train/resilience.py, the function the trainer calls).

After an interruption a run loses the work since its last checkpoint, waits `--down-s` with
no machine (the heartbeat automation marks the run Crashed, the recovery starts a new run),
pays `--restart-s` of process start and the restore time, and goes on. The recovery gives up
as the product's recovery does (`recovery.max_stalled` consecutive attempts that saved no new
checkpoint, or `recovery.max_attempts` in all): such a run needs a human. The measured stall
and restore are scaled by `--state-scale` (1 = the default model; a 7B model's state is
~5000x larger) to show where the rule matters.

Reports, per policy: median and 10-90% range of goodput (training compute / wall time) and of
cost at the pool's spot price, against the on-demand cost of an uninterrupted run; the
interval auto chose and its inputs. JSON last with `goodput_auto`, `goodput_fixed`,
`recovered_without_human` (fraction of auto runs that finished without a human).

Run: `.venv/bin/python bench/preemption.py [--quick] [--mtbi-hours 2] [--work-hours 8]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moe.checkpoint.store import CheckpointStore
from moe.model.transformer import MoETransformer
from moe.train.resilience import choose_interval, daly_interval_s
from moe.train.trainer import Trainer
from tasks.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


class RandomBatches:
    """Token batches of the default shape (what a step costs does not depend on the text)."""

    def __init__(self, batch: int, seq: int, vocab: int) -> None:
        self.batch, self.seq, self.vocab = batch, seq, vocab

    def batch_at(self, step: int, micro: int = 0) -> tuple:
        g = torch.Generator().manual_seed(step * 7919 + micro)
        x = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=g)
        return x[:, :-1], x[:, 1:], None


def _trainer(cfg: Config, folder: Path, max_steps: int, log_fn: Any) -> Trainer:
    """The default model and trainer on random batches, saving every 5 steps to `folder`."""
    torch.manual_seed(0)
    t, ck = cfg.pretrain, cfg.checkpoint
    model = MoETransformer(cfg.model, cfg.moe, cfg.tokenizer.vocab_size)
    tc = dataclasses.replace(t, max_steps=max_steps, checkpoint_every=5, device="cpu")
    store = CheckpointStore(
        folder,
        max_retain=2,
        hot_codec=ck.hot_codec,
        hot_level=ck.hot_level,
        background=ck.background,
    )
    batches = RandomBatches(t.batch_size, cfg.model.seq_len, cfg.tokenizer.vocab_size)
    return Trainer(model, tc, batches, store, fingerprint="bench", schedule="cosine", log_fn=log_fn)


def measure(cfg: Config, steps: int, repeats: int) -> dict[str, float]:
    """Median save stall, restore time and step time of the default model on this CPU."""
    stalls: list[float] = []
    restores: list[float] = []
    step_s: list[float] = []

    def log_fn(row: dict[str, Any]) -> None:
        if "checkpoint_stall_s" in row and row["step"] > 5:  # the first save warms up
            stalls.append(row["checkpoint_stall_s"])

    for r in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            first = _trainer(cfg, Path(tmp), steps, log_fn)
            res = first.fit()
            first.store.close()
            step_s.append(res.wall_s / res.steps)
            second = _trainer(cfg, Path(tmp), steps + 1, log_fn)
            t0 = time.perf_counter()
            second._try_resume()
            restores.append(time.perf_counter() - t0)
            second.store.close()
        print(f"measure {r + 1}/{repeats}: step {step_s[-1]:.3f} s, restore {restores[-1]:.3f} s")
    return {
        "save_stall_s": statistics.median(stalls),
        "restore_s": statistics.median(restores),
        "step_s": statistics.median(step_s),
    }


def simulate(
    work_s: float,
    interval_s: float,
    save_s: float,
    restore_s: float,
    down_s: float,
    restart_s: float,
    failures: list[float],
    max_stalled: int,
    max_attempts: int,
) -> dict[str, float]:
    """One run: `failures` are the machine lifetimes (seconds from each start) in order."""
    done = saved = wall = billed = 0.0
    attempts, stalled, lives = 1, 0, iter(failures)
    life = next(lives)
    alive = 0.0  # time since this machine started training
    while done < work_s:
        seg = min(interval_s, work_s - done)
        need = seg + save_s
        if alive + need <= life:  # the segment and its save complete
            alive += need
            wall += need
            billed += need
            done += seg
            saved = done
            stalled = 0
            continue
        # interrupted inside the segment: the machine's time to here is paid, the work lost
        ran = life - alive
        wall += ran + down_s + restart_s + (restore_s if saved else 0.0)
        billed += ran + restart_s + (restore_s if saved else 0.0)
        done = saved
        stalled += 1
        attempts += 1
        if stalled > max_stalled or attempts > max_attempts:
            return {"wall_s": wall, "billed_s": billed, "finished": False, "attempts": attempts}
        alive, life = 0.0, next(lives)
    return {"wall_s": wall, "billed_s": billed, "finished": True, "attempts": attempts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer measurements and runs")
    ap.add_argument("--work-hours", type=float, default=8.0)
    ap.add_argument("--mtbi-hours", type=float, default=2.0)
    ap.add_argument("--down-s", type=float, default=90.0, help="detection + rescheduling")
    ap.add_argument("--restart-s", type=float, default=60.0, help="process start, data, model")
    ap.add_argument("--state-scale", type=float, default=1.0)
    ap.add_argument("--fixed-every", type=int, default=0, help="steps (0 = params.yaml's)")
    ap.add_argument("--runs", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = load_config(ROOT / "params.yaml")
    cpus = torch.get_num_threads()
    m = measure(cfg, steps=12 if args.quick else 25, repeats=2 if args.quick else 5)
    save_s, restore_s = m["save_stall_s"] * args.state_scale, m["restore_s"] * args.state_scale
    step_s = m["step_s"]
    work_s, mtbi_s = args.work_hours * 3600, args.mtbi_hours * 3600
    fixed_steps = args.fixed_every or cfg.pretrain.checkpoint_every
    auto = choose_interval(
        save_s, step_s, mtbi_s, fixed_steps, max_steps=10**12, restore_s=restore_s
    )
    intervals = {"none": work_s, "fixed": fixed_steps * step_s, "auto": auto.steps * step_s}
    rec = cfg.recovery
    pool = cfg.pools.definitions[cfg.pools.stages["pretrain"]]
    runs = 100 if args.quick else args.runs
    rng = random.Random(args.seed)
    out: dict[str, dict[str, list]] = {k: {"goodput": [], "cost": [], "ok": []} for k in intervals}
    for _ in range(runs):
        failures = [rng.expovariate(1 / mtbi_s) for _ in range(10_000)]
        for name, iv in intervals.items():
            r = simulate(
                work_s,
                iv,
                save_s,
                restore_s,
                args.down_s,
                args.restart_s,
                failures,
                rec.max_stalled,
                rec.max_attempts,
            )
            out[name]["ok"].append(r["finished"])
            if r["finished"]:
                out[name]["goodput"].append(work_s / r["wall_s"])
                out[name]["cost"].append(r["billed_s"] / 3600 * pool.spot_price_per_hour)

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else math.nan

    on_demand = (work_s + save_s * (work_s / intervals["fixed"])) / 3600 * pool.price_per_hour
    print(
        f"\nmeasured (default model, {cpus} threads): save stall {m['save_stall_s'] * 1e3:.1f} ms, "
        f"restore {m['restore_s'] * 1e3:.1f} ms, step {step_s * 1e3:.1f} ms; "
        f"state scale x{args.state_scale:g}"
    )
    print(
        f"run: {args.work_hours:g} h of compute, interruptions every {args.mtbi_hours:g} h on "
        f"average, {args.down_s:g} s down + {args.restart_s:g} s restart each; {runs} runs"
    )
    print(
        f"auto: every {auto.steps} steps = {intervals['auto']:.0f} s (Young/Daly tau "
        f"{daly_interval_s(save_s, mtbi_s):.0f} s); fixed: every {fixed_steps} steps = "
        f"{intervals['fixed']:.1f} s"
    )
    print(f"{'policy':8} {'finished':>9} {'goodput p50':>12} {'p10-p90':>14} {'cost p50':>10}")
    result: dict[str, Any] = {}
    for name, o in out.items():
        fin = sum(o["ok"]) / len(o["ok"])
        g50, c50 = statistics.median(o["goodput"] or [math.nan]), q(o["cost"], 0.5)
        print(
            f"{name:8} {fin:9.2%} {g50:12.3f} {q(o['goodput'], 0.1):6.3f}-{q(o['goodput'], 0.9):6.3f}"
            f" {c50:10.2f}"
        )
        # null where no run of the policy finished (JSON has no NaN)
        result[f"goodput_{name}"] = None if math.isnan(g50) else round(g50, 4)
        result[f"cost_{name}"] = None if math.isnan(c50) else round(c50, 3)
        result[f"finished_{name}"] = round(fin, 4)
    print(f"on-demand, uninterrupted, fixed interval: cost {on_demand:.2f}")
    result.update(
        recovered_without_human=result["finished_auto"],
        cost_on_demand=round(on_demand, 3),
        auto_every_steps=auto.steps,
        measured=m,
        state_scale=args.state_scale,
        mtbi_hours=args.mtbi_hours,
        work_hours=args.work_hours,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
