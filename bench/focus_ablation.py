"""Ablation: focus-token weighting (seed 000 §7.2) on against off, on the two finetuning stages.

Run after `make demo` (it needs data/prepared and models/pretrain):
    .venv/bin/python bench/focus_ablation.py [--set KEY=VALUE ...]
Both arms start from the same pretrained model and see the same batches; only
`focus_weight` differs (1.0 = off). Prints a JSON object last.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import tasks  # noqa: F401 - offline defaults
from moe.config import load_config
from tasks.evaluation import evaluate_perplexity, evaluate_sql
from tasks.training import finetune_model


def run_arm(overrides: list[str], data_dir: Path, pretrain: Path, work: Path) -> dict:
    cfg = load_config(None, overrides)
    sql_dir, domain_dir = work / "finetune_sql", work / "finetune_domain"
    t0 = time.perf_counter()
    finetune_model.fn(
        cfg, "finetune_sql", data_dir, "generic.jsonl", pretrain, sql_dir, lambda r: None
    )
    finetune_model.fn(
        cfg, "finetune_domain", data_dir, "domain_train.jsonl", sql_dir, domain_dir, lambda r: None
    )
    out = {"seconds": round(time.perf_counter() - t0, 1)}
    for name, d in (("finetune_sql", sql_dir), ("finetune_domain", domain_dir)):
        sql = evaluate_sql.fn(cfg, data_dir, d)
        out[name] = {
            "valid_sql": sql["valid_sql"],
            "execution_accuracy": sql["execution_accuracy"],
            "exact_match": sql["exact_match"],
            "val_perplexity": round(evaluate_perplexity.fn(cfg, data_dir, d)["perplexity"], 2),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--pretrain", type=Path, default=Path("models/pretrain"))
    a = ap.parse_args()
    cfg = load_config(None, a.overrides)
    work = Path(tempfile.mkdtemp(prefix="focus-ablation-"))
    try:
        on = run_arm(a.overrides, a.data, a.pretrain, work / "on")
        off_overrides = [
            *a.overrides,
            "finetune_sql.focus_weight=1.0",
            "finetune_domain.focus_weight=1.0",
        ]
        off = run_arm(off_overrides, a.data, a.pretrain, work / "off")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "focus_weight": {
            "finetune_sql": cfg.finetune_sql.focus_weight,
            "finetune_domain": cfg.finetune_domain.focus_weight,
        },
        "focus_tokens": cfg.finetune_sql.focus_tokens,
        "held_out_examples": cfg.evaluate.max_examples,
        "on": on,
        "off": off,
        "execution_accuracy_delta": round(
            on["finetune_domain"]["execution_accuracy"]
            - off["finetune_domain"]["execution_accuracy"],
            4,
        ),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
