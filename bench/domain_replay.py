"""Does the domain stage keep what the SQL stage taught? finetune_domain with a share of each
batch drawn from the generic SQL pairs (`finetune_domain.replay_pairs`, issue 55 item 4)
against without, from the same finetune_sql model, over seeds.

Each arm trains finetune_domain through the recipe the stage runs (moe/recipes/finetune.py)
into a scratch folder, then scores it as the evaluate stage does (moe/recipes/evaluate.py):
the held-out domain questions, and the generic questions on databases trained on ('seen')
and never trained on ('held out'), beside the finetune_sql model's own generic scores.
Arms interleave within a seed (0, 0.25, 0.5, 0, ...). Defaults: the demo's project
(`make demo` first): params.yaml, data/prepared, models/finetune_sql.

Run: `.venv/bin/python bench/domain_replay.py [--shares 0 0.25 0.5] [--seeds 1337 1338 1339]`.
JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from moe.recipes.context import RunContext
from moe.recipes.evaluate import sql_scores, sql_sets
from moe.recipes.finetune import FINETUNES, finetune
from moe.recipes.load import load_params

SETS = ("sql", "generic_seen", "generic_heldout")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--init", type=Path, default=Path("models/finetune_sql"))
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    base = load_params(a.params, a.overrides)
    sets = sql_sets(base, a.data)
    before = _figures(sql_scores(base, a.data, a.init, sets))
    print(f"finetune_sql model: {before}", flush=True)
    runs: dict[float, list[dict]] = {s: [] for s in a.shares}
    pairs = FINETUNES["finetune_domain"][0]
    with tempfile.TemporaryDirectory(prefix="domain-replay-") as tmp:
        for seed in a.seeds:
            for share in a.shares:
                sets_ = [f"finetune_domain.replay_pairs={share}", f"finetune_domain.seed={seed}"]
                params = load_params(a.params, [*a.overrides, *sets_])
                out = Path(tmp) / f"{share}-{seed}"
                t0 = time.perf_counter()
                result = finetune(params, "finetune_domain", a.data, pairs, a.init, out,
                                  RunContext())  # fmt: skip
                train_s = time.perf_counter() - t0
                got = _figures(sql_scores(params, a.data, out, sets))
                runs[share].append({"seed": seed, "train_s": round(train_s, 1),
                                    "train_loss": round(result.train_loss, 4), **got})  # fmt: skip
                print(f"replay_pairs {share} seed {seed}: {runs[share][-1]}", flush=True)
    summary = {"finetune_sql": before}
    for share, rows in runs.items():
        summary[str(share)] = {
            f"{name}_{k}": _mean_sd([r[f"{name}_{k}"] for r in rows])
            for name in SETS
            if f"{name}_execution" in rows[0]
            for k in ("execution", "valid")
        } | {"train_s": statistics.median(r["train_s"] for r in rows)}
        print(f"replay_pairs {share}: {summary[str(share)]}")
    print(json.dumps({"seeds": a.seeds, "runs": {str(k): v for k, v in runs.items()}, **summary}))


def _figures(scores: dict) -> dict[str, float]:
    out = {}
    for name in SETS:
        if name in scores:
            out[f"{name}_execution"] = round(scores[name]["execution_accuracy"], 4)
            out[f"{name}_valid"] = round(scores[name]["valid_sql"], 4)
    return out


def _mean_sd(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.3f} ± {sd:.3f}"


if __name__ == "__main__":
    main()
