"""Test-suite accuracy (Zhong, Yu and Klein, 2020, "Semantic Evaluation for Text-to-SQL with
Distilled Test Suites"): a predicted query is right only if it returns the gold query's
result on the database *and* on several differently filled copies of it. On one fill a wrong
query often returns the right rows by chance (both empty, a filter that happens to keep
everything); a copy whose rows differ tells them apart.

`build_suite` writes `copies` databases beside each other with the original's schema (its own
CREATE statements: types, keys, constraints) and rows drawn column by column from the
original's values, mixed with values near the gold queries' literals (a gold `x > 100` meets
rows holding 99, 100 and 101; a gold `name = 'Canada'` meets 'Canada'), keys kept unique and
foreign keys pointing at rows that exist. Seeded: the same database and gold queries give the
same copies.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moe.sql.sandbox import ident, open_checked

# Rows per table in a copy: at most the original's and at most this many (a copy is for
# telling queries apart, not for size).
MAX_ROWS = 400
LITERAL_SHARE = 0.25  # of the values of a column that a gold literal can fill


def literals(sqls: Iterable[str]) -> tuple[list[str], list[float]]:
    """The string and number literals of `sqls` (by sqlglot's parse; a query that does not
    parse gives none)."""
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    texts: set[str] = set()
    nums: set[float] = set()
    for sql in sqls:
        try:
            tree = sqlglot.parse_one(sql, read="sqlite")
        except (SqlglotError, ValueError, RecursionError):
            continue
        for lit in tree.find_all(exp.Literal):
            if lit.is_string:
                texts.add(lit.this.strip("%"))
            else:
                try:
                    nums.add(float(lit.this))
                except ValueError:
                    pass
    return sorted(texts), sorted(nums)


def _tables(con: sqlite3.Connection) -> list[tuple[str, str]]:
    return con.execute(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        " AND sql IS NOT NULL ORDER BY rowid"
    ).fetchall()


def _fk_order(con: sqlite3.Connection, names: list[str]) -> list[str]:
    """Parents before children (a cycle is broken where it closes)."""
    parents = {
        n: {r[2] for r in con.execute(f"PRAGMA foreign_key_list({ident(n)})")} - {n} for n in names
    }
    done: list[str] = []
    seen: set[str] = set()

    def visit(n: str, path: set[str]) -> None:
        if n in seen or n in path or n not in parents:
            return
        for p in sorted(parents[n]):
            visit(p, path | {n})
        seen.add(n)
        done.append(n)

    for n in names:
        visit(n, set())
    return done


def _near(v: float, is_int: bool, rng: random.Random) -> float:
    step = 1 if is_int else max(abs(v) * 0.01, 0.01)
    out = v + rng.choice((-step, 0, 0, step))
    return int(out) if is_int else out


def _fill_copy(
    src: sqlite3.Connection,
    dst: sqlite3.Connection,
    rng: random.Random,
    texts: list[str],
    nums: list[float],
) -> None:
    tables = dict(_tables(src))
    for name in _fk_order(src, list(tables)):
        dst.execute(tables[name])
    keys: dict[tuple[str, str], list[Any]] = {}  # a parent's key values in this copy
    for name in _fk_order(src, list(tables)):
        q = ident(name)
        info = src.execute(f"PRAGMA table_info({q})").fetchall()
        fks = {r[3]: (r[2], r[4]) for r in src.execute(f"PRAGMA foreign_key_list({q})")}
        original = src.execute(f"SELECT count(*) FROM {q}").fetchone()[0]
        if not original:
            continue
        n = rng.randint(max(1, min(original, MAX_ROWS) // 2), min(original, MAX_ROWS))
        columns: list[list[Any]] = []
        for _, cname, ctype, _, _, pk in info:
            pool = [
                r[0] for r in src.execute(f"SELECT {ident(cname)} FROM {q} LIMIT {MAX_ROWS * 5}")
            ]
            if cname in fks and keys.get(fks[cname]):
                vals = [rng.choice(keys[fks[cname]]) for _ in range(n)]
            elif pk and all(isinstance(v, int) for v in pool):
                vals = rng.sample(range(1, max(n, max(pool, default=0)) * 2 + 1), n)
            else:
                vals = _column_values(pool, n, rng, texts, nums, (ctype or "").upper())
            columns.append(vals)
        rows = list(zip(*columns, strict=True))
        marks = ", ".join("?" * len(info))
        dst.executemany(f"INSERT OR IGNORE INTO {q} VALUES ({marks})", rows)
        for _, cname, *_ in info:
            keys[(name, cname)] = [r[0] for r in dst.execute(f"SELECT {ident(cname)} FROM {q}")]
    dst.commit()


def _column_values(
    pool: list[Any], n: int, rng: random.Random, texts: list[str], nums: list[float], ctype: str
) -> list[Any]:
    """`n` values for a column: drawn from the original's (with replacement, so counts and
    duplicates change), a share of them near the gold queries' literals of the column's
    kind."""
    numeric = [v for v in pool if isinstance(v, (int, float)) and not isinstance(v, bool)]
    strings = [v for v in pool if isinstance(v, str)]
    is_int = bool(numeric) and all(isinstance(v, int) for v in numeric)
    out = []
    for _ in range(n):
        r = rng.random()
        if numeric and len(numeric) >= len(strings) and nums and r < LITERAL_SHARE:
            out.append(_near(rng.choice(nums), is_int, rng))
        elif strings and len(strings) > len(numeric) and texts and r < LITERAL_SHARE:
            out.append(rng.choice(texts))
        elif pool:
            out.append(rng.choice(pool))
        else:
            out.append(None)
    return out


def build_suite(
    db: Path, out_dir: Path, gold: Iterable[str], copies: int, seed: int = 0
) -> list[Path]:
    """`copies` differently filled copies of `db` in `out_dir` (`<stem>.suite<k>.sqlite`),
    filled as the module says; existing ones are rebuilt. Returns their paths."""
    texts, nums = literals(gold)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = open_checked(db)
    paths = []
    try:
        for k in range(copies):
            path = out_dir / f"{db.stem}.suite{k}.sqlite"
            part = path.with_suffix(".part")
            part.unlink(missing_ok=True)
            dst = sqlite3.connect(part)
            try:
                _fill_copy(src, dst, random.Random(f"{db.name}/{seed}/{k}"), texts, nums)
            finally:
                dst.close()
            part.replace(path)
            paths.append(path)
    finally:
        src.close()
    return paths
