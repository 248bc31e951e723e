"""Expert growth from a deliberately skewed start, against the same run without growth.

Skewed start: the default model with 4 experts, top-1 routing, no balancing at all and a
router learning rate 5x the base rate, so a few experts take most tokens. Two runs on the
default data with the same seed and batches: `moe.growth.enabled` on and off.

Reports the load CV and MaxVio of the growth run in the logged window before its first
growth (`cv_before`, `max_vio_before`) and over its last three windows (`cv_after`,
`max_vio_after`), the same figures for the run without growth, the expert counts at the end,
and the validation loss at equal steps (`loss_delta` = with growth - without). Targets: CV
falls, loss_delta <= 0. JSON last.

Run: `.venv/bin/python bench/growth.py [--quick] [--data data/prepared]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

import torch

from moe.checkpoint import CheckpointStore
from moe.config import load_config
from moe.data import BatchSampler, TokenStore
from moe.model import MoETransformer
from moe.train import Trainer


def run(
    cfg, data: Path, steps: int, grow: bool, init: str = "orthogonal"
) -> tuple[dict, list[dict]]:
    growth = dataclasses.replace(
        cfg.moe.growth,
        enabled=grow,
        check_every=10,
        cooldown=max(20, steps // 8),
        max_experts=8,
        ema=0.9,
        ramp_steps=max(10, steps // 15),
        prune_window=max(50, steps // 3),
        init=init,
    )
    mcfg = dataclasses.replace(
        cfg.moe, num_experts=4, top_k=1, balancing=[], router_lr_mult=5.0, growth=growth
    )
    t = dataclasses.replace(
        cfg.train,
        max_steps=steps,
        eval_every=steps,
        checkpoint_every=steps,
        log_every=10,
        early_stop=dataclasses.replace(cfg.train.early_stop, patience=0),
    )
    vocab = TokenStore(data, "train").vocab_size
    torch.manual_seed(t.seed)
    model = MoETransformer(cfg.model, mcfg, vocab)
    with tempfile.TemporaryDirectory() as d:
        tr = Trainer(
            model,
            t,
            BatchSampler(TokenStore(data, "train"), t.batch_size, cfg.model.seq_len, t.seed),
            CheckpointStore(Path(d) / "ckpt", max_retain=1),
            fingerprint="bench",
            schedule="cosine",
            min_lr=t.min_lr,
            router_lr_mult=mcfg.router_lr_mult,
            val_batches=BatchSampler(TokenStore(data, "val"), t.batch_size, cfg.model.seq_len, 7),
            eval_every=steps,
            eval_batches=32,
            metrics_path=Path(d) / "m.jsonl",
        )
        res = tr.fit()
        rows = [json.loads(r) for r in (Path(d) / "m.jsonl").read_text().splitlines()]
    return dataclasses.asdict(res), rows


def _window(rows: list[dict], upto: int | None = None, last: int = 0) -> tuple[float, float]:
    logged = [r for r in rows if "expert_cv" in r and (upto is None or r["step"] <= upto)]
    if last:
        logged = logged[-last:]
    else:
        logged = logged[-1:]
    n = max(1, len(logged))
    return (
        round(sum(r["expert_cv"] for r in logged) / n, 4),
        round(sum(r["expert_max_vio"] for r in logged) / n, 4),
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="150 steps per run instead of 600")
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--init", choices=["orthogonal", "split"], default="orthogonal")
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    cfg = load_config(a.params)
    steps = 150 if a.quick else 600
    with_g, rows_g = run(cfg, a.data, steps, grow=True, init=a.init)
    without, rows_n = run(cfg, a.data, steps, grow=False)
    events = with_g["expert_events"]
    first = min((e["step"] for e in events if e["kind"] == "grow"), default=None)
    cv_before, vio_before = _window(rows_g, upto=first - 1 if first else None)
    cv_after, vio_after = _window(rows_g, last=3)
    cv_plain, vio_plain = _window(rows_n, last=3)
    out = {
        "steps": steps,
        "init": a.init,
        "growth_events": [
            {k: e[k] for k in ("step", "layer", "kind", "experts_after", "trigger")} for e in events
        ],
        "experts_per_layer": with_g["experts_per_layer"],
        "cv_before": cv_before,
        "max_vio_before": vio_before,
        "cv_after": cv_after,
        "max_vio_after": vio_after,
        "cv_without_growth": cv_plain,
        "max_vio_without_growth": vio_plain,
        "val_loss_with": round(with_g["val_loss"], 4),
        "val_loss_without": round(without["val_loss"], 4),
        "loss_delta": round(with_g["val_loss"] - without["val_loss"], 4),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
