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
two votes differ and which was right; the same over the questions whose gold query returns
rows (`..._gold_rows`): where it returns none, any query that returns none scores as right,
and a vote that refuses a value the database does not hold loses there (Spider's rebuilt
flight_2 holds none of the airlines its questions name). JSON last.

`--spelling schema` first gives every candidate the schema's spelling of its names, as held
decoding now writes them (moe/sql/spelling.py), and counts the candidates it changed and
those whose rows then differ from the rows the candidate returned as written (a dump from
before that change shows what it moves: nothing but the text, it should read 0).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from moe.sql.consistency import VOTES
from moe.sql.evaluate import _Scorer
from moe.sql.records import load_pairs
from moe.sql.spelling import in_schema_spelling


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--set", default="domain_test")
    ap.add_argument("--dump", type=Path, required=True)
    ap.add_argument("--votes", nargs="+", choices=list(VOTES), default=["plain", "grounded"])
    ap.add_argument("--spelling", choices=["as-written", "schema"], default="as-written")
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
            rows_kept: list[bool] = []  # the gold query returns rows
            spelled = {"respelled": 0, "rows_moved": 0}
            for r in rows:
                pair = pairs[(r["question"], r["gold"])]
                gold = scorer.db(pair).run(pair.sql)
                rows_kept.append(gold.ok and bool(gold.rows))
                cands = [(s, float(lp)) for s, lp in r["candidates"]]
                if a.spelling == "schema":
                    cands = _respelled(scorer, pair, cands, spelled)
                for v in a.votes:
                    sql = scorer.choose(pair, cands, v).sql
                    right[v].append(bool(scorer.score(pair, sql)["execution_match"]))
            row = {"setting": setting, "seed": seed, "questions": len(rows)}
            row |= spelled if a.spelling == "schema" else {}
            row |= _compare(right, a.votes, [True] * len(rows), "")
            row["questions_gold_rows"] = sum(rows_kept)
            row |= _compare(right, a.votes, rows_kept, "_gold_rows")
            print(row, flush=True)
            out.append(row)
    finally:
        scorer.close()
    print(json.dumps(out))


def _respelled(scorer: _Scorer, pair, cands: list, counts: dict[str, int]) -> list:
    """`cands` in the schema's spelling, counting those it changed and those whose rows
    (or error) it changed."""
    out, names = [], scorer.names(pair)
    for sql, lp in cands:
        new = in_schema_spelling(sql, names)
        if new != sql:
            counts["respelled"] += 1
            was, now = scorer.db(pair).run(sql), scorer.db(pair).run(new)
            counts["rows_moved"] += (was.ok, was.rows) != (now.ok, now.rows)
        out.append((new, lp))
    return out


def _compare(right: dict[str, list[bool]], votes: list[str], keep: list[bool], tag: str) -> dict:
    """Each vote's accuracy over the questions `keep` says, and, paired against the first
    vote, the questions where they part and which one was right."""
    kept = {v: [x for x, k in zip(right[v], keep, strict=True) if k] for v in votes}
    n, base, row = max(1, sum(keep)), votes[0], {}
    for v in votes:
        row[f"{v}{tag}"] = round(sum(kept[v]) / n, 4)
        if v != base:
            both = list(zip(kept[v], kept[base], strict=True))
            row[f"{v}_wins{tag}"] = sum(x and not b for x, b in both)
            row[f"{v}_losses{tag}"] = sum(b and not x for x, b in both)
    return row


if __name__ == "__main__":
    main()
