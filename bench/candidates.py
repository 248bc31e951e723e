"""Execution-guided self-consistency and identifiers held to the schema, against greedy
decoding, on a trained model (issue 55, items 1 and 2).

Scores a model folder (default: the demo's `models/finetune_domain`) on a prepared test set
(default: the 200 held-out domain questions of `data/prepared`) with `candidates` 1 (greedy),
4 and 8 (the greedy answer and N-1 sampled at `--temperature`, each run on the question's
database, the largest group of equal results), at each of `--seeds` sampling seeds, each
with the identifiers free and, with `--constrain off on`, held to the question's schema
(moe/sql/constrain.py; `qualified`: only the names after FROM, JOIN and `alias.`, not the bare
words) and, with `--vote plain rows grounded`, the largest group of equal results, results
with rows before empty ones (`+rows`), and a vote only for candidates whose compared values
the database holds and the question names (`+grounded`, the default; moe/sql/consistency.py
`VOTES`). `--dump FILE` writes every answer of every setting (JSONL). Prints execution and
test-suite accuracy, valid SQL, the agreement and the wall time of each, and their ratio to
greedy's. Rounds interleave the settings (1 4 8 1 4 8 ...); times are medians. A setting is
named by its candidates, `+held` when constrained (`+qualified`), then its vote.

Run: `.venv/bin/python bench/candidates.py [--model DIR] [--data DIR] [--set domain_test]`.
JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moe.data.tokenizer import load_tokenizer, specials
from moe.hf.model_dir import load_model_dir
from moe.sql.consistency import VOTES
from moe.sql.evaluate import sql_accuracy
from moe.sql.records import load_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/finetune_domain"))
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--set", default="domain_test", help="a prepared SQL set (its .jsonl)")
    ap.add_argument("--candidates", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-new-tokens", type=int, default=72)
    ap.add_argument("--test-suite", type=int, default=3)
    ap.add_argument("--constrain", nargs="+", choices=["off", "qualified", "on"], default=["off"],
                    help="on: every rule; qualified: names after FROM, JOIN and alias. only")  # fmt: skip
    ap.add_argument("--vote", nargs="+", choices=list(VOTES), default=["grounded"],
                    help="how the candidates vote (candidates > 1): " + "; ".join(f"{k}: {v}" for k, v in VOTES.items()))  # fmt: skip
    ap.add_argument("--dump", type=Path, default=None, help="a JSONL file of every answer")
    ap.add_argument("--limit", type=int, default=0, help="the set's first N questions (0: all)")
    a = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_model_dir(a.model, dtype=torch.float32).eval()
    tok = load_tokenizer(a.data / "tokenizer.json")
    sp = specials(tok, a.data / "tokenizer.json")
    pairs = load_pairs(a.data / "sql" / f"{a.set}.jsonl")[: a.limit or None]
    settings = [
        (n, held, vote)
        for n in a.candidates
        for held in a.constrain
        for vote in (a.vote if n > 1 else ["plain"])  # one candidate: no vote
    ]
    runs: dict[str, list[dict]] = {_name(*s): [] for s in settings}
    for seed in a.seeds:
        for n, held, vote in settings:  # interleaved
            name = _name(n, held, vote)
            if n == 1 and seed != a.seeds[0] and len(runs[name]) >= 2:
                continue  # greedy does not depend on the seed: two timings are enough
            answers: list[dict] = []
            t0 = time.perf_counter()
            got = sql_accuracy(
                model, tok, pairs, a.data / "sql" / "dbs", a.max_new_tokens, sp.eos,
                prefix=sp.prefix, test_suite=a.test_suite, chat=sp.chat, candidates=n,
                temperature=a.temperature, seed=seed, vote=vote,
                constrain=held != "off",
                constrain_bare=held == "on", answers=answers,
            )  # fmt: skip
            wall = time.perf_counter() - t0
            runs[name].append({"seed": seed, "wall_s": wall, **{k: got.get(k, 0.0) for k in (
                "execution_accuracy", "test_suite_accuracy", "valid_sql")},
                "agreement": got["decoding"].get("agreement", 1.0)})  # fmt: skip
            print(f"{name} seed {seed}: {runs[name][-1]}", flush=True)
            if a.dump:
                with open(a.dump, "a") as f:
                    for r in answers:
                        f.write(json.dumps({"setting": name, "seed": seed, **r}) + "\n")
    greedy_s = statistics.median(r["wall_s"] for r in runs["1"]) if "1" in runs else None
    out = {}
    for n, rs in runs.items():
        ex = [r["execution_accuracy"] for r in rs]
        row = {
            "execution_accuracy": round(statistics.mean(ex), 4),
            "execution_sd": round(statistics.stdev(ex), 4) if len(ex) > 1 else 0.0,
            "test_suite_accuracy": round(statistics.mean(r["test_suite_accuracy"] for r in rs), 4),
            "valid_sql": round(statistics.mean(r["valid_sql"] for r in rs), 4),
            "agreement": round(statistics.mean(r["agreement"] for r in rs), 4),
            "wall_s": round(statistics.median(r["wall_s"] for r in rs), 2),
            "seeds": [r["seed"] for r in rs],
        }
        if greedy_s:
            row["time_vs_greedy"] = round(row["wall_s"] / greedy_s, 2)
        out[n] = row
        print(f"{n}: {row}")
    print(json.dumps({"model": str(a.model), "set": a.set, "examples": len(pairs), **out}))


def _name(n: int, held: str, vote: str = "plain") -> str:
    name = {"off": str(n), "on": f"{n}+held", "qualified": f"{n}+qualified"}[held]
    return name + ("" if vote == "plain" else f"+{vote}")


if __name__ == "__main__":
    main()
