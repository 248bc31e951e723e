"""MoE against a dense model with the same active parameters, for the same wall time, on the
prepared default data; and the load balance of auxiliary-loss-free balancing against none.

Four runs, each given the same training-time budget (`train.time_budget_s`: the run stops
when it is used, and the cosine decay follows the time used, so every run ends annealed):
- `moe_balanced`: the default MoE with `moe.balancing: [aux_free, z_loss]`;
- `moe_unbalanced`: the same with no balancing at all;
- `moe_aux_loss`: the same with the Switch auxiliary loss + z-loss instead;
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
from pathlib import Path

import torch

from moe.checkpoint import CheckpointStore
from moe.config import Config, load_config
from moe.data import BatchSampler, TokenStore
from moe.model import MoETransformer
from moe.train import Trainer

BALANCING: dict[str, list] = {
    "moe_balanced": ["aux_free", "z_loss"],
    "moe_aux_loss": ["aux_loss", "z_loss"],
    "moe_unbalanced": [],
}


def _model(cfg: Config, kind: str, vocab: int) -> MoETransformer:
    torch.manual_seed(cfg.train.seed)
    m, e = cfg.model, cfg.moe
    if kind == "dense":
        m = dataclasses.replace(m, moe_every=m.n_layer + 1, dense_hidden=e.top_k * e.expert_hidden)
    else:
        e = dataclasses.replace(e, balancing=BALANCING[kind])
    return MoETransformer(m, e, vocab)


def _trainer(cfg: Config, model: MoETransformer, data: Path, work: Path, budget: float) -> Trainer:
    steps = 1_000_000  # the time budget stops the run and drives the lr decay
    t = dataclasses.replace(
        cfg.train,
        max_steps=steps,
        time_budget_s=budget,
        eval_every=steps,
        checkpoint_every=steps,
        log_every=10,
        early_stop=dataclasses.replace(cfg.train.early_stop, patience=0),
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
        val_batches=BatchSampler(TokenStore(data, "val"), t.batch_size, cfg.model.seq_len, 7),
        eval_every=steps,
        eval_batches=32,
        metrics_path=work / "metrics.jsonl",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="90 s per run instead of 300 s")
    ap.add_argument("--budget-s", type=float, default=0.0)
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    cfg = load_config(a.params)
    budget = a.budget_s or (90.0 if a.quick else 300.0)
    vocab = TokenStore(a.data, "train").vocab_size
    out: dict[str, object] = {"budget_s": budget}
    for kind in ("moe_balanced", "dense", "moe_unbalanced", "moe_aux_loss"):
        model = _model(cfg, kind, vocab)
        with tempfile.TemporaryDirectory() as d:
            tr = _trainer(cfg, model, a.data, Path(d), budget)
            res = tr.fit()
            steps = res.steps
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
