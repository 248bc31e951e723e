"""A domain database on a PostgreSQL server against the same data in a sqlite file (issue 39).

    .venv/bin/python bench/sql_server.py [--repeats 3] [--exec-repeats 7]

Starts the `pgserver` wheel's PostgreSQL on 127.0.0.1 (tests/conftest.py `running_postgres`),
loads Chinook into it with PostgreSQL's types (tests/test_postgres.py `_load_chinook`, the
rows of tests/chinook.py's sqlite file) and measures, interleaved (A B A B) and as medians:

- prepare's SQL sets with Chinook as the domain, from the sqlite path and from the URL (500
  generated training pairs and 200 generated test pairs, every one executed; the generic
  sets cut to 10 pairs, the same for both, so the domain is what differs);
- the per-query cost of the sandbox: the domain pairs' own SQL (generated in each dialect)
  through `ServerDb.run` against a plain read-only connection (psycopg, a session with
  `default_transaction_read_only`, `execute` and `fetchall`), and, for reference, sqlite's
  `ReadOnlyDb` against a plain sqlite connection on the sqlite pairs.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import tasks  # noqa: E402

tasks.offline_defaults()

from moe.data.config import DataConfig  # noqa: E402
from moe.sql.fitting import Limits  # noqa: E402
from moe.sql.records import load_pairs  # noqa: E402
from moe.sql.sets import build_sql_sets  # noqa: E402
from tests import chinook  # noqa: E402
from tests.conftest import _postgres_bin, running_postgres  # noqa: E402
from tests.test_postgres import _load_chinook  # noqa: E402

BIG = 10**6
LIMITS = Limits(  # lengths are not what is measured: every example fits
    lambda texts: [len(t.split()) for t in texts],
    BIG,
    BIG,
    dict.fromkeys(("train", "generic", "train_domain", "domain"), BIG),
    {},
)


def prepare_once(d: DataConfig, out: Path) -> float:
    t = time.perf_counter()
    build_sql_sets(d, out, LIMITS)
    return time.perf_counter() - t


def exec_sandboxed(db, sqls: list[str]) -> float:  # noqa: ANN001 - ReadOnlyDb | ServerDb
    t = time.perf_counter()
    for sql in sqls:
        db.run(sql)
    return time.perf_counter() - t


def exec_plain_pg(con, sqls: list[str]) -> float:  # noqa: ANN001 - a psycopg connection
    import psycopg

    t = time.perf_counter()
    for sql in sqls:
        try:
            con.execute(sql).fetchall()
        except psycopg.Error:
            pass
        con.rollback()
    return time.perf_counter() - t


def exec_plain_sqlite(path: Path, sqls: list[str]) -> float:
    import sqlite3

    t = time.perf_counter()
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    for sql in sqls:
        try:
            con.execute(sql).fetchall()
        except sqlite3.Error:
            pass
    con.close()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--exec-repeats", type=int, default=7)
    args = ap.parse_args()
    import psycopg

    from moe.sql.databases import open_database
    from moe.sql.sandbox import ReadOnlyDb

    work = Path(tempfile.mkdtemp(prefix="sql-server-bench-"))
    lite = chinook.build(work / "chinook.sqlite")
    with running_postgres(_postgres_bin()) as pg:
        pg["psql"]("CREATE DATABASE chinook")
        _load_chinook(pg, lite)
        os.environ["BENCH_PG_PW"] = pg["password"]
        url = f"postgresql+psycopg://owner@127.0.0.1:{pg['port']}/chinook"
        base = DataConfig(sql_generic_pairs=10, sql_generic_test_pairs=2, seed=0,
                          sql_domain_train_pairs=500, sql_domain_test_pairs=200)  # fmt: skip
        arms = {
            "sqlite": dataclasses.replace(base, sql_domain_database=str(lite)),
            "postgresql": dataclasses.replace(
                base, sql_domain_database=url, sql_domain_password="env:BENCH_PG_PW"
            ),
        }
        times: dict[str, list[float]] = {a: [] for a in arms}
        for i in range(args.repeats):
            for arm, d in arms.items():
                times[arm].append(prepare_once(d, work / f"{arm}{i}"))
        pairs = {a: load_pairs(work / f"{a}0" / "domain_train.jsonl") for a in arms}
        pairs = {a: p + load_pairs(work / f"{a}0" / "domain_test.jsonl") for a, p in pairs.items()}
        pg_sql = [p.sql for p in pairs["postgresql"]]
        lite_sql = [p.sql for p in pairs["sqlite"]]
        with (
            open_database(url, 2.0, 10_000, "env:BENCH_PG_PW") as sandboxed,
            psycopg.connect(
                host="127.0.0.1",
                port=pg["port"],
                user="owner",
                password=pg["password"],
                dbname="chinook",
                options="-c default_transaction_read_only=on",
            ) as plain,  # fmt: skip
            ReadOnlyDb(work / "sqlite0" / "dbs" / "domain.sqlite") as lite_ro,
        ):
            exec_sandboxed(sandboxed, pg_sql), exec_plain_pg(plain, pg_sql)  # warm up
            e: dict[str, list[float]] = {k: [] for k in ("pg_sandbox", "pg_plain", "lite_ro", "lite_plain")}  # fmt: skip
            for _ in range(args.exec_repeats):
                e["pg_sandbox"].append(exec_sandboxed(sandboxed, pg_sql))
                e["pg_plain"].append(exec_plain_pg(plain, pg_sql))
                e["lite_ro"].append(exec_sandboxed(lite_ro, lite_sql))
                e["lite_plain"].append(exec_plain_sqlite(lite_ro.path, lite_sql))
            failed = sum(not sandboxed.run(s).ok for s in pg_sql)
    med = {k: statistics.median(v) for k, v in {**times, **e}.items()}
    n_pg, n_lite = len(pg_sql), len(lite_sql)
    out = {
        "prepare_s": {a: round(med[a], 2) for a in arms},
        "prepare_ratio_pg_over_sqlite": round(med["postgresql"] / med["sqlite"], 2),
        "pairs": {a: len(p) for a, p in pairs.items()},
        "pg_sandbox_ms_per_query": round(1000 * med["pg_sandbox"] / n_pg, 3),
        "pg_plain_ms_per_query": round(1000 * med["pg_plain"] / n_pg, 3),
        "pg_overhead_ms_per_query": round(1000 * (med["pg_sandbox"] - med["pg_plain"]) / n_pg, 3),
        "pg_ratio": round(med["pg_sandbox"] / med["pg_plain"], 2),
        "sqlite_ro_ms_per_query": round(1000 * med["lite_ro"] / n_lite, 3),
        "sqlite_plain_ms_per_query": round(1000 * med["lite_plain"] / n_lite, 3),
        "sqlite_ratio": round(med["lite_ro"] / med["lite_plain"], 2),
        "pg_sandbox_failures": failed,
        "repeats": {"prepare": args.repeats, "exec": args.exec_repeats},
    }
    print("| measure | sqlite file | PostgreSQL server |")
    print("|---|---|---|")
    print(f"| prepare's SQL sets, s (median of {args.repeats}) | {out['prepare_s']['sqlite']} |"
          f" {out['prepare_s']['postgresql']} |")  # fmt: skip
    print(f"| per query, sandbox, ms | {out['sqlite_ro_ms_per_query']} | {out['pg_sandbox_ms_per_query']} |")  # fmt: skip
    print(f"| per query, plain read-only connection, ms | {out['sqlite_plain_ms_per_query']} | {out['pg_plain_ms_per_query']} |")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
