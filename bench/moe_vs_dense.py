"""MoE against a dense model with the same active parameters, for the same wall time, on the
prepared default data; and the load balance of auxiliary-loss-free balancing against none.

Three runs, each given the same wall-time budget (steps = budget / its own measured step time,
so every run completes its cosine schedule):
- `moe_balanced`: the default MoE with `moe.balancing: [aux_free, z_loss]`;
- `moe_unbalanced`: the same with no balancing at all;
- `dense`: the same transformer with a dense SwiGLU of width top_k x expert_hidden in every
  block (the MoE's active feed-forward parameters).

Reports each run's validation loss and, for the MoE runs, MaxVio (max load / mean load - 1)
averaged over the logged windows after the first 20% of steps (warm-up). Targets: MoE loss below dense;
MaxVio <= 0.2 balanced and >= 1 unbalanced. JSON last.

Needs `data/prepared` (`moe-pipeline stage prepare` or `make demo`).
Run: `.venv/bin/python bench/moe_vs_dense.py [--quick] [--data data/prepared]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import torch

from moe.checkpoint import CheckpointStore
from moe.config import Config, load_config
from moe.data import BatchSampler, TokenStore
from moe.model import MoETransformer
from moe.train import Trainer


def _model(cfg: Config, kind: str, vocab: int) -> MoETransformer:
    torch.manual_seed(cfg.train.seed)
    m, e = cfg.model, cfg.moe
    if kind == "dense":
        m = dataclasses.replace(m, moe_every=m.n_layer + 1, dense_hidden=e.top_k * e.expert_hidden)
    elif kind == "moe_unbalanced":
        e = dataclasses.replace(e, balancing=[])
    else:
        e = dataclasses.replace(e, balancing=["aux_free", "z_loss"])
    return MoETransformer(m, e, vocab)


def _trainer(cfg: Config, model: MoETransformer, data: Path, work: Path, steps: int) -> Trainer:
    t = dataclasses.replace(
        cfg.train,
        max_steps=steps,
        warmup_steps=max(1, steps // 10),
        eval_every=steps,
        checkpoint_every=steps,
        log_every=max(1, steps // 20),
        early_stop=dataclasses.replace(cfg.train.early_stop, patience=0),
    )
    return Trainer(
        model,
        t,
        BatchSampler(TokenStore(data, "train"), t.batch_size, cfg.model.seq_len, t.seed),
        CheckpointStore(work / "ckpt", keep_last=1),
        fingerprint="bench",
        schedule="cosine",
        min_lr=t.min_lr,
        router_lr_mult=cfg.moe.router_lr_mult,
        val_batches=BatchSampler(TokenStore(data, "val"), t.batch_size, cfg.model.seq_len, 7),
        eval_every=steps,
        eval_batches=32,
        metrics_path=work / "metrics.jsonl",
    )


def _step_time(cfg: Config, kind: str, data: Path, vocab: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        tr = _trainer(cfg, _model(cfg, kind, vocab), data, Path(d), 1000)
        tr.stop_after = 3
        tr.fit()  # warm-up
        tr.stop_after, t0, s0 = 6, time.perf_counter(), tr.step
        tr.fit()
        return (time.perf_counter() - t0) / max(1, tr.step - s0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="45 s per run instead of 180 s")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    cfg = load_config(a.params)
    budget = a.budget_s or (45.0 if a.quick else 180.0)
    vocab = TokenStore(a.data, "train").vocab_size
    out: dict[str, object] = {"budget_s": budget}
    for kind in ("moe_balanced", "dense", "moe_unbalanced"):
        dt = _step_time(cfg, kind, a.data, vocab)
        steps = max(10, int(budget / dt))
        model = _model(cfg, kind, vocab)
        with tempfile.TemporaryDirectory() as d:
            tr = _trainer(cfg, model, a.data, Path(d), steps)
            res = tr.fit()
            rows = [json.loads(r) for r in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        after_warmup = [
            r["expert_max_vio"] for r in rows if "expert_max_vio" in r and r["step"] > steps // 5
        ]
        out[kind] = {
            "steps": steps,
            "wall_s": round(res.wall_s, 1),
            "active_params": model.num_params(active_only=True),
            "total_params": model.num_params(),
            "val_loss": round(float(res.val_loss), 4),
        }
        if len(model.moe_layers):
            out[kind]["max_vio_after_warmup"] = (  # type: ignore[index]
                round(sum(after_warmup) / len(after_warmup), 3) if after_warmup else None
            )
            out[kind]["expert_cv"] = round(res.expert_cv, 3)  # type: ignore[index]
        print(f"{kind}: {out[kind]}", flush=True)
    out["loss_moe_minus_dense"] = round(
        out["moe_balanced"]["val_loss"] - out["dense"]["val_loss"],  # type: ignore[index]
        4,
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
