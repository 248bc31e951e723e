"""MoE against a dense model with the same active parameters: validation loss at equal
tokens (the literature's comparison: Switch, OLMoE, DeepSeekMoE) and at equal wall time (what
a CPU user pays), over seeds; and the load balance of the balancing methods.

Runs, each on the prepared default data:
- `moe_balanced`: the default MoE with `moe.balancing: [aux_free, z_loss]`;
- `dense`: the same transformer with a dense SwiGLU of width top_k x expert_hidden in every
  block (the MoE's active feed-forward parameters);
- with `--balancing`, also `moe_unbalanced` (no balancing) and `moe_aux_loss` (the Switch
  auxiliary loss + z-loss).

Two comparisons per seed, runs interleaved (MoE, dense, MoE, dense) so the machine's drift
hits both:
- equal tokens: every run trains `--steps` steps of the same batches (cosine to the end);
- equal time: every run trains for `--budget-s` seconds of training time
  (`pretrain.time_budget_s`: the run stops when it is used and the cosine decay follows the time
  used, so each ends annealed); the faster model does more steps.

Reports each run's validation loss (32 batches), steps and wall time, and for the MoE runs
MaxVio (max load / mean load - 1) averaged over the logged windows after the first 20% of
steps; then mean and standard deviation over seeds of the loss differences MoE - dense.
JSON last.

Needs `data/prepared` (`moe-pipeline stage prepare` or `make demo`).
Run: `.venv/bin/python bench/moe_vs_dense.py [--quick] [--seeds 1337 1338 1339] [--balancing]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

import torch

from moe.checkpoint.store import CheckpointStore
from moe.data.tokens import BatchSampler, TokenStore
from moe.model.transformer import MoETransformer
from moe.train.trainer import Trainer
from moe.train.validation import Validation
from tasks.config import Config, load_config

BALANCING: dict[str, list] = {
    "moe_balanced": ["aux_free", "z_loss"],
    "moe_aux_loss": ["aux_loss", "z_loss"],
    "moe_unbalanced": [],
}


def _model(cfg: Config, kind: str, vocab: int) -> MoETransformer:
    torch.manual_seed(cfg.pretrain.seed)
    m, e = cfg.model, cfg.moe
    if kind == "dense":
        m = dataclasses.replace(m, moe_every=m.n_layer + 1, dense_hidden=e.top_k * e.expert_hidden)
    else:
        e = dataclasses.replace(e, balancing=BALANCING[kind])
    return MoETransformer(m, e, vocab)


def _trainer(
    cfg: Config, model: MoETransformer, data: Path, work: Path, steps: int, budget: float
) -> Trainer:
    t = dataclasses.replace(
        cfg.pretrain,
        max_steps=steps,
        time_budget_s=budget,
        eval_every=steps,
        checkpoint_every=steps,
        log_every=10,
        early_stop=dataclasses.replace(cfg.pretrain.early_stop, patience=0),
    )
    return Trainer(
        model,
        t,
        BatchSampler(TokenStore(data, "train"), t.batch_size, cfg.model.seq_len, t.seed),
        CheckpointStore(work / "ckpt", max_retain=1),
        fingerprint="bench",
        schedule="cosine",
        min_lr=t.min_lr,
        router_lr_mult=cfg.moe.router_lr_mult,
        validation=Validation(
            BatchSampler(TokenStore(data, "val"), t.batch_size, cfg.model.seq_len, 7), steps, 32
        ),
        metrics_path=work / "metrics.jsonl",
    )


def one_run(cfg: Config, kind: str, data: Path, steps: int, budget: float) -> dict:
    vocab = TokenStore(data, "train").vocab_size
    model = _model(cfg, kind, vocab)
    with tempfile.TemporaryDirectory() as d:
        res = _trainer(cfg, model, data, Path(d), steps, budget).fit()
        rows = [json.loads(r) for r in (Path(d) / "metrics.jsonl").read_text().splitlines()]
    out = {
        "steps": res.steps,
        "wall_s": round(res.wall_s, 1),
        "active_params": model.num_params(active_only=True),
        "total_params": model.num_params(),
        "val_loss": round(float(res.val_loss), 4),
    }
    if len(model.moe_layers):
        vio = [
            r["expert_max_vio"]
            for r in rows
            if "expert_max_vio" in r and r["step"] > res.steps // 5
        ]
        out["max_vio_after_warmup"] = round(sum(vio) / len(vio), 3) if vio else None
        out["expert_cv"] = round(res.expert_cv, 3)
    return out


def _ms(vals: list[float]) -> str:
    sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return f"{statistics.mean(vals):+.3f} ± {sd:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="300 steps / 90 s per run, not 1000 / 300 s"
    )
    ap.add_argument("--steps", type=int, default=0, help="steps of the equal-tokens runs")
    ap.add_argument("--budget-s", type=float, default=0.0, help="seconds of the equal-time runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--balancing", action="store_true", help="also the unbalanced and aux-loss MoE")
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    base = load_config(a.params)
    steps = a.steps or (300 if a.quick else 1000)
    budget = a.budget_s or (90.0 if a.quick else 300.0)
    kinds = ["moe_balanced", "dense"] + (["moe_unbalanced", "moe_aux_loss"] if a.balancing else [])
    out: dict[str, object] = {"steps": steps, "budget_s": budget, "seeds": a.seeds, "runs": {}}
    runs: dict = out["runs"]  # type: ignore[assignment]
    for seed in a.seeds:
        cfg = dataclasses.replace(base, pretrain=dataclasses.replace(base.pretrain, seed=seed))
        for mode, (n, b) in (("equal_tokens", (steps, 0.0)), ("equal_time", (1_000_000, budget))):
            for kind in kinds:
                r = one_run(cfg, kind, a.data, n, b)
                runs.setdefault(mode, {}).setdefault(kind, {})[seed] = r
                print(f"seed {seed} {mode} {kind}: {r}", flush=True)
    print(f"\n{len(a.seeds)} seeds, mean ± standard deviation")
    print("| comparison | kind | steps | wall s | val loss | MaxVio |")
    print("|---|---|---|---|---|---|")
    for mode, per_kind in runs.items():
        for kind, per_seed in per_kind.items():
            rs = list(per_seed.values())
            vio = [
                r["max_vio_after_warmup"] for r in rs if r.get("max_vio_after_warmup") is not None
            ]
            cells = [
                statistics.mean(r["steps"] for r in rs),
                statistics.mean(r["wall_s"] for r in rs),
            ]
            print(
                f"| {mode} | {kind} | {cells[0]:.0f} | {cells[1]:.0f} | "
                f"{_ms([r['val_loss'] for r in rs])[1:]} | {_ms(vio)[1:] if vio else ''} |"
            )
    for mode in runs:
        deltas = [
            runs[mode]["moe_balanced"][s]["val_loss"] - runs[mode]["dense"][s]["val_loss"]
            for s in a.seeds
        ]
        out[f"loss_moe_minus_dense_{mode}"] = [round(d, 4) for d in deltas]
        print(
            f"MoE - dense val loss, {mode}: {_ms(deltas)} (per seed {[round(d, 3) for d in deltas]})"
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
