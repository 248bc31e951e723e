"""Expert growth from a deliberately skewed start, against the same run without growth, over
seeds, for each growth variant.

Skewed start: the default model with 4 experts, top-1 routing and a router learning rate 5x
the base rate, so a few experts take most tokens. Variants (`--variants`, each
`INIT+BALANCING`):
- `orthogonal+none`, `split+none`: no balancing at all; the new expert starts orthogonal to
  the others (the rule the growth design specifies) or as the hottest expert plus a 10% orthogonal component;
- `orthogonal+aux_free`, `split+aux_free`: auxiliary-loss-free balancing on, so a new
  expert gets traffic through its routing bias rather than through its combine weight.
Each variant runs with `moe.growth.enabled` on, and once off with the same balancing (the
baseline), on the same seed and batches.

Reports the load CV and MaxVio of the growth run in the logged window before its first
growth (`cv_before`, both layers), over its last three windows (`cv_after`), the same for
the baseline; per layer that grew, its own CV in the window that triggered its growth, at
the end, and at the end without growth (`per_layer`);
the expert counts at the end, and the validation loss at equal steps (`loss_delta` = with
growth - without); then mean and standard deviation over seeds per variant. Targets: CV after
< CV before, loss_delta <= 0. JSON last.

Run: `.venv/bin/python bench/growth.py [--quick] [--seeds 1337 1338 1339] [--variants ...]`.
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
from tasks.config import load_config


def run(
    cfg, data: Path, steps: int, grow: bool, init: str, balancing: list[str], seed: int
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
        cfg.moe,
        num_experts=4,
        top_k=1,
        renormalize=False,  # Switch's top-1: the probability weighs, so the gate learns
        balancing=balancing,
        router_lr_mult=5.0,
        growth=growth,
    )
    t = dataclasses.replace(
        cfg.pretrain,
        seed=seed,
        max_steps=steps,
        eval_every=steps,
        checkpoint_every=steps,
        log_every=10,
        early_stop=dataclasses.replace(cfg.pretrain.early_stop, patience=0),
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
            validation=Validation(
                BatchSampler(TokenStore(data, "val"), t.batch_size, cfg.model.seq_len, 7), steps, 32
            ),
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


def _layer_cv(share: list[float]) -> float:
    t = torch.tensor(share, dtype=torch.float64)
    return float(t.std(unbiased=False) / t.mean().clamp_min(1e-12))


def _per_layer(rows: list[dict], rows_plain: list[dict], events: list[dict]) -> dict:
    """For each layer that grew: its load CV in the window that triggered its first growth,
    over its last three windows, and over the same windows of the run without growth."""
    logged = [r for r in rows if "expert_share" in r]
    plain = [r for r in rows_plain if "expert_share" in r][-3:]
    out = {"cv_trigger": [], "cv_end": [], "cv_end_without": []}
    for layer in sorted({e["layer"] for e in events if e["kind"] == "grow"}):
        first = min(e["step"] for e in events if e["kind"] == "grow" and e["layer"] == layer)
        at = [r for r in logged if r["step"] == first]
        if not at:
            continue
        out["cv_trigger"].append(_layer_cv(at[0]["expert_share"][layer]))
        out["cv_end"].append(
            statistics.mean(_layer_cv(r["expert_share"][layer]) for r in logged[-3:])
        )
        out["cv_end_without"].append(
            statistics.mean(_layer_cv(r["expert_share"][layer]) for r in plain)
        )
    return {k: [round(x, 4) for x in v] for k, v in out.items()}


def measure(cfg, data: Path, steps: int, variant: str, seed: int) -> dict:
    init, bal = variant.split("+")
    balancing = [] if bal == "none" else [bal]
    with_g, rows_g = run(cfg, data, steps, True, init, balancing, seed)
    without, rows_n = run(cfg, data, steps, False, init, balancing, seed)
    events = with_g["expert_events"]
    first = min((e["step"] for e in events if e["kind"] == "grow"), default=None)
    cv_before, vio_before = _window(rows_g, upto=first - 1 if first else None)
    cv_after, vio_after = _window(rows_g, last=3)
    cv_plain, vio_plain = _window(rows_n, last=3)
    return {
        "growth_events": [
            {k: e[k] for k in ("step", "layer", "kind", "experts_after", "trigger")} for e in events
        ],
        "grows": sum(e["kind"] == "grow" for e in events),
        "prunes": sum(e["kind"] == "prune" for e in events),
        "experts_per_layer": with_g["experts_per_layer"],
        "cv_before": cv_before,
        "max_vio_before": vio_before,
        "cv_after": cv_after,
        "max_vio_after": vio_after,
        "cv_without_growth": cv_plain,
        "max_vio_without_growth": vio_plain,
        "per_layer": _per_layer(rows_g, rows_n, events),
        "val_loss_with": round(with_g["val_loss"], 4),
        "val_loss_without": round(without["val_loss"], 4),
        "loss_delta": round(with_g["val_loss"] - without["val_loss"], 4),
    }


VARIANTS = ("orthogonal+none", "split+none", "orthogonal+aux_free", "split+aux_free")


def _ms(vals: list[float], fmt: str = ".3f") -> str:
    sd = statistics.stdev(vals) if len(vals) > 1 else float("nan")
    return f"{format(statistics.mean(vals), fmt)} ± {format(sd, fmt)}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="150 steps per run instead of 600")
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    cfg = load_config(a.params)
    steps = 150 if a.quick else 600
    res: dict[str, dict[int, dict]] = {v: {} for v in a.variants}
    for seed in a.seeds:
        for v in a.variants:  # variants interleaved within each seed
            res[v][seed] = r = measure(cfg, a.data, steps, v, seed)
            print(
                f"seed {seed} {v}: CV before {r['cv_before']:.3f} after {r['cv_after']:.3f}"
                f" without growth {r['cv_without_growth']:.3f}; loss delta {r['loss_delta']:+.3f};"
                f" experts {r['experts_per_layer']} ({r['grows']} grows, {r['prunes']} prunes)",
                flush=True,
            )
    print(f"\n{steps} steps, {len(a.seeds)} seeds: mean ± standard deviation")
    print(
        "| variant | CV before growth | CV after (last 3 windows) | CV without growth"
        " | loss with - without | experts at end |"
    )
    print("|---|---|---|---|---|---|")
    for v, per_seed in res.items():
        rs = list(per_seed.values())
        print(
            f"| {v} | {_ms([r['cv_before'] for r in rs])} | {_ms([r['cv_after'] for r in rs])}"
            f" | {_ms([r['cv_without_growth'] for r in rs])}"
            f" | {_ms([r['loss_delta'] for r in rs], '+.3f')}"
            f" | {[r['experts_per_layer'] for r in rs]} |"
        )
    print(
        "\nPer grown layer (every seed's grown layers pooled): its load CV in the window that"
        " triggered its first growth, over its last three windows, and over the same windows"
        " without growth"
    )
    print(
        "| variant | layers | CV at the trigger | CV at the end | the same layers without growth |"
    )
    print("|---|---|---|---|---|")
    for v, per_seed in res.items():
        pl = [r["per_layer"] for r in per_seed.values()]
        trig = [x for p in pl for x in p["cv_trigger"]]
        if not trig:
            print(f"| {v} | 0 | - | - | - |")
            continue
        end = [x for p in pl for x in p["cv_end"]]
        plain = [x for p in pl for x in p["cv_end_without"]]
        print(f"| {v} | {len(trig)} | {_ms(trig)} | {_ms(end)} | {_ms(plain)} |")
    print(json.dumps({"steps": steps, "seeds": a.seeds, "results": res}))


if __name__ == "__main__":
    main()
