"""The candidates' votes compared on the same candidates: a `bench/candidates.py --dump` of a
setting with several candidates holds each question's candidates (the greedy query and the
sampled ones, with the model's log-probabilities); each vote of moe/sql/consistency.py
(`VOTES`: plain, rows, grounded) chooses among the same candidates again, and each choice is
scored as evaluation scores it (moe/sql/evaluate.py's scorer: execution against the gold
query on the question's database). Paired, so the difference between two votes is the votes'
alone, not the sampling's (issue 68: the default vote wins on held-out Spider and Chinook).

    .venv/bin/python bench/revote.py --data PROJECT/data/prepared --set generic_test_heldout \
        --dump DUMP.jsonl [--votes plain grounded]

Prints, per setting and seed of the dump: each vote's execution accuracy, the questions where
two votes differ and which was right. JSON last.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from moe.sql.consistency import VOTES
from moe.sql.evaluate import _Scorer
from moe.sql.records import load_pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--set", default="domain_test")
    ap.add_argument("--dump", type=Path, required=True)
    ap.add_argument("--votes", nargs="+", choices=list(VOTES), default=["plain", "grounded"])
    a = ap.parse_args()
    pairs = {(p.question, p.sql): p for p in load_pairs(a.data / "sql" / f"{a.set}.jsonl")}
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for line in a.dump.read_text().splitlines():
        r = json.loads(line)
        if r.get("candidates"):
            groups[(r["setting"], r["seed"])].append(r)
    scorer = _Scorer(list(pairs.values()), a.data / "sql" / "dbs", 2.0, 10_000, 0)
    out = []
    try:
        for (setting, seed), rows in groups.items():
            right: dict[str, list[bool]] = {v: [] for v in a.votes}
            for r in rows:
                pair = pairs[(r["question"], r["gold"])]
                cands = [(s, float(lp)) for s, lp in r["candidates"]]
                for v in a.votes:
                    sql = scorer.choose(pair, cands, v).sql
                    right[v].append(bool(scorer.score(pair, sql)["execution_match"]))
            base = a.votes[0]
            row = {"setting": setting, "seed": seed, "questions": len(rows)}
            for v in a.votes:
                row[v] = round(sum(right[v]) / len(rows), 4)
                if v != base:  # paired: where the two votes part, who was right
                    both = list(zip(right[v], right[base], strict=True))
                    row[f"{v}_wins"] = sum(x and not b for x, b in both)
                    row[f"{v}_losses"] = sum(b and not x for x, b in both)
            print(row, flush=True)
            out.append(row)
    finally:
        scorer.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
