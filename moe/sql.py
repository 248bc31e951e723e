"""Text-to-SQL pairs over generated sqlite databases, each statement checked by running it.

Finetuning runs in two stages: ~10,000 generic SQL pairs, then ~500 pairs of one target
domain. Generic pairs come from many schemas (themes x instances, each with its own data);
domain pairs from one database that no generic schema shares. Every SQL statement is executed
on sqlite and only pairs that run are kept.
"""

from __future__ import annotations

import json
import random
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from moe.errors import InputError

# A theme: a parent table (name, category, numbers) and a child table that references it.
# (table, plural, category column, its values, number columns with ranges)
_Table = tuple[str, str, str, list[str], list[tuple[str, int, int]]]

GENERIC_THEMES: list[tuple[_Table, _Table]] = [
    (
        (
            "singer",
            "singers",
            "country",
            ["France", "Japan", "Brazil", "Kenya", "Canada"],
            [("age", 18, 70), ("net_worth", 1, 900)],
        ),
        (
            "concert",
            "concerts",
            "venue",
            ["Arena", "Stadium", "Club", "Hall"],
            [("year", 1990, 2024), ("attendance", 100, 90000)],
        ),
    ),
    (
        (
            "author",
            "authors",
            "genre",
            ["poetry", "fiction", "history", "science"],
            [("birth_year", 1900, 2000), ("awards", 0, 12)],
        ),
        (
            "book",
            "books",
            "format",
            ["hardcover", "paperback", "ebook"],
            [("pages", 50, 1200), ("price", 5, 90)],
        ),
    ),
    (
        (
            "team",
            "teams",
            "city",
            ["Lyon", "Osaka", "Lima", "Oslo", "Perth"],
            [("founded", 1880, 2010), ("budget", 1, 500)],
        ),
        (
            "player",
            "players",
            "position",
            ["goalkeeper", "defender", "midfielder", "forward"],
            [("age", 17, 40), ("goals", 0, 300)],
        ),
    ),
    (
        (
            "store",
            "stores",
            "region",
            ["north", "south", "east", "west"],
            [("size", 100, 5000), ("staff", 2, 80)],
        ),
        (
            "sale",
            "sales",
            "category",
            ["food", "toys", "tools", "books"],
            [("amount", 1, 2000), ("quantity", 1, 50)],
        ),
    ),
    (
        (
            "airline",
            "airlines",
            "country",
            ["Chile", "Italy", "India", "Egypt"],
            [("fleet_size", 5, 900), ("founded", 1920, 2015)],
        ),
        (
            "flight",
            "flights",
            "destination",
            ["Rome", "Delhi", "Cairo", "Quito", "Seoul"],
            [("distance", 200, 14000), ("delay", 0, 300)],
        ),
    ),
    (
        (
            "school",
            "schools",
            "district",
            ["A", "B", "C", "D"],
            [("students", 100, 4000), ("founded", 1850, 2020)],
        ),
        (
            "teacher",
            "teachers",
            "subject",
            ["math", "art", "music", "biology"],
            [("salary", 30, 120), ("experience", 0, 40)],
        ),
    ),
    (
        (
            "farm",
            "farms",
            "state",
            ["Iowa", "Texas", "Ohio", "Utah"],
            [("acres", 10, 9000), ("workers", 1, 120)],
        ),
        (
            "crop",
            "crops",
            "kind",
            ["wheat", "corn", "soy", "rice"],
            [("yield", 1, 400), ("harvest_year", 2000, 2024)],
        ),
    ),
    (
        (
            "museum",
            "museums",
            "city",
            ["Paris", "Berlin", "Madrid", "Vienna"],
            [("opened", 1750, 2020), ("visitors", 1000, 900000)],
        ),
        (
            "exhibit",
            "exhibits",
            "theme",
            ["modern", "ancient", "nature", "space"],
            [("pieces", 3, 400), ("duration_days", 7, 365)],
        ),
    ),
    (
        (
            "company",
            "companies",
            "industry",
            ["energy", "retail", "software", "banking"],
            [("employees", 5, 90000), ("revenue", 1, 999)],
        ),
        (
            "product",
            "products",
            "line",
            ["basic", "pro", "premium"],
            [("price", 1, 3000), ("units_sold", 0, 100000)],
        ),
    ),
    (
        (
            "gym",
            "gyms",
            "chain",
            ["FitOne", "CoreLab", "IronBox"],
            [("members", 50, 6000), ("opened", 1990, 2024)],
        ),
        (
            "trainer",
            "trainers",
            "specialty",
            ["yoga", "boxing", "cycling", "weights"],
            [("age", 20, 65), ("sessions", 0, 900)],
        ),
    ),
    (
        (
            "planet",
            "planets",
            "system",
            ["Sol", "Kepler", "Gliese", "Trappist"],
            [("moons", 0, 80), ("radius", 1, 70000)],
        ),
        (
            "probe",
            "probes",
            "agency",
            ["NASA", "ESA", "JAXA", "ISRO"],
            [("launch_year", 1960, 2024), ("mass", 100, 6000)],
        ),
    ),
    (
        (
            "restaurant",
            "restaurants",
            "cuisine",
            ["thai", "mexican", "french", "greek"],
            [("rating", 1, 5), ("seats", 10, 300)],
        ),
        (
            "dish",
            "dishes",
            "course",
            ["starter", "main", "dessert"],
            [("price", 3, 80), ("calories", 50, 1800)],
        ),
    ),
]

DOMAIN_THEME: tuple[_Table, _Table] = (
    (
        "doctor",
        "doctors",
        "department",
        ["cardiology", "oncology", "pediatrics", "neurology", "surgery"],
        [("experience", 1, 40), ("age", 28, 70)],
    ),
    (
        "appointment",
        "appointments",
        "ward",
        ["east", "west", "north", "south", "icu"],
        [("cost", 20, 900), ("duration", 10, 120)],
    ),
)

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "ra",
    "to",
    "ne",
    "su",
    "vi",
    "da",
    "pe",
    "zo",
    "li",
    "mo",
    "ta",
    "re",
]


@dataclass
class SqlPair:
    question: str
    sql: str
    db: str  # database file name, relative to the dbs folder
    schema: str  # compact schema text given to the model

    def to_json(self) -> str:
        return json.dumps(
            {"question": self.question, "sql": self.sql, "db": self.db, "schema": self.schema}
        )


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def build_database(
    path: Path, theme: tuple[_Table, _Table], rng: random.Random, rows: int = 30
) -> str:
    """Create a sqlite database for `theme` with random rows; returns its compact schema."""
    (pt, _, pcat, pvals, pnums), (ct, _, ccat, cvals, cnums) = theme
    path.unlink(missing_ok=True)
    con = sqlite3.connect(path)
    pcols = [
        "id INTEGER PRIMARY KEY",
        "name TEXT",
        f"{pcat} TEXT",
        *(f"{n} INTEGER" for n, _, _ in pnums),
    ]
    ccols = [
        "id INTEGER PRIMARY KEY",
        f"{pt}_id INTEGER REFERENCES {pt}(id)",
        f"{ccat} TEXT",
        *(f"{n} INTEGER" for n, _, _ in cnums),
    ]
    con.execute(f"CREATE TABLE {pt} ({', '.join(pcols)})")
    con.execute(f"CREATE TABLE {ct} ({', '.join(ccols)})")
    for i in range(1, rows + 1):
        con.execute(
            f"INSERT INTO {pt} VALUES ({', '.join('?' * (3 + len(pnums)))})",
            (i, _name(rng), rng.choice(pvals), *(rng.randint(lo, hi) for _, lo, hi in pnums)),
        )
    for i in range(1, 2 * rows + 1):
        con.execute(
            f"INSERT INTO {ct} VALUES ({', '.join('?' * (3 + len(cnums)))})",
            (
                i,
                rng.randint(1, rows),
                rng.choice(cvals),
                *(rng.randint(lo, hi) for _, lo, hi in cnums),
            ),
        )
    con.commit()
    con.close()
    pnames = ", ".join(["id", "name", pcat, *(n for n, _, _ in pnums)])
    cnames = ", ".join(["id", f"{pt}_id", ccat, *(n for n, _, _ in cnums)])
    return f"{pt}({pnames}); {ct}({cnames})"


def _questions(theme: tuple[_Table, _Table], rng: random.Random) -> Iterator[tuple[str, str]]:
    """Endless stream of (question, SQL) over one theme, covering SELECT, WHERE, JOIN,
    GROUP BY, ORDER BY, aggregates and LIMIT."""
    (pt, pp, pcat, pvals, pnums), (ct, cp, ccat, cvals, cnums) = theme
    while True:
        t, plural, cat, vals, nums = rng.choice(
            [(pt, pp, pcat, pvals, pnums), (ct, cp, ccat, cvals, cnums)]
        )
        num, lo, hi = rng.choice(nums)
        v = rng.randint(lo, hi)
        c = rng.choice(vals)
        n = rng.randint(2, 10)
        agg, agg_word = rng.choice(
            [("AVG", "average"), ("MAX", "maximum"), ("MIN", "minimum"), ("SUM", "total")]
        )
        op, op_word = rng.choice(
            [(">", "greater than"), ("<", "less than"), (">=", "at least"), ("<=", "at most")]
        )
        cnum = rng.choice(cnums)[0]
        cval, pval = rng.choice(cvals), rng.choice(pvals)  # drawn once: question and SQL agree
        kind = rng.randrange(12)
        if kind == 0:
            yield f"How many {plural} are there?", f"SELECT COUNT(*) FROM {t}"
        elif kind == 1:
            yield (
                f"How many {plural} have {cat} {c}?",
                f"SELECT COUNT(*) FROM {t} WHERE {cat} = '{c}'",
            )
        elif kind == 2:
            yield (
                f"List the ids of {plural} with {num} {op_word} {v}.",
                f"SELECT id FROM {t} WHERE {num} {op} {v}",
            )
        elif kind == 3:
            yield f"What is the {agg_word} {num} of {plural}?", f"SELECT {agg}({num}) FROM {t}"
        elif kind == 4:
            yield (
                f"What is the {agg_word} {num} of {plural} whose {cat} is {c}?",
                f"SELECT {agg}({num}) FROM {t} WHERE {cat} = '{c}'",
            )
        elif kind == 5:
            yield (
                f"Show the ids of the {n} {plural} with the highest {num}.",
                f"SELECT id FROM {t} ORDER BY {num} DESC LIMIT {n}",
            )
        elif kind == 6:
            yield (
                f"Show the ids of the {n} {plural} with the lowest {num}.",
                f"SELECT id FROM {t} ORDER BY {num} ASC LIMIT {n}",
            )
        elif kind == 7:
            yield (
                f"How many {plural} are there for each {cat}?",
                f"SELECT {cat}, COUNT(*) FROM {t} GROUP BY {cat}",
            )
        elif kind == 8:
            yield (
                f"What is the {agg_word} {num} for each {cat}?",
                f"SELECT {cat}, {agg}({num}) FROM {t} GROUP BY {cat}",
            )
        elif kind == 9:
            yield (
                f"List the names of {pp} that have a {ct} with {ccat} {cval}.",
                f"SELECT DISTINCT T1.name FROM {pt} AS T1 JOIN {ct} AS T2 ON T1.id = T2.{pt}_id WHERE T2.{ccat} = '{cval}'",
            )
        elif kind == 10:
            yield (
                f"How many {cp} does each {pt} have? Show the name and count.",
                f"SELECT T1.name, COUNT(*) FROM {pt} AS T1 JOIN {ct} AS T2 ON T1.id = T2.{pt}_id GROUP BY T1.id",
            )
        else:
            yield (
                f"What is the {agg_word} {cnum} of {cp} for {pp} whose {pcat} is {pval}?",
                f"SELECT {agg}(T2.{cnum}) FROM {pt} AS T1 JOIN {ct} AS T2 ON T1.id = T2.{pt}_id WHERE T1.{pcat} = '{pval}'",
            )


def _valid(con: sqlite3.Connection, sql: str) -> bool:
    try:
        con.execute(sql).fetchall()
        return True
    except sqlite3.Error:
        return False


def _pairs_for(
    db_path: Path,
    schema: str,
    theme: tuple[_Table, _Table],
    rng: random.Random,
    count: int,
    seen: set[tuple[str, str]],
) -> list[SqlPair]:
    out: list[SqlPair] = []
    con = sqlite3.connect(db_path)
    stream = _questions(theme, rng)
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        q, sql = next(stream)
        # The question-SQL pair must be new (no leak across splits) and must run.
        if (db_path.name, sql) in seen or not _valid(con, sql):
            continue
        seen.add((db_path.name, sql))
        out.append(SqlPair(q, sql, db_path.name, schema))
    con.close()
    return out


HELD_OUT_THEMES = 2  # the last generic themes: schemas no training pair uses


def generate_sql_sets(
    out_dir: Path,
    generic: int,
    domain_train: int,
    domain_test: int,
    seed: int,
    generic_test: int = 200,
) -> dict[str, int]:
    """Write under out_dir: generic.jsonl (training), generic_test_seen.jsonl (new questions
    on the databases generic.jsonl trains on), generic_test_heldout.jsonl (questions on the
    HELD_OUT_THEMES schemas, which no training pair uses), domain_train.jsonl,
    domain_test.jsonl, and dbs/*.sqlite. No test question or SQL text is a training one."""
    rng = random.Random(seed)
    dbs = out_dir / "dbs"
    dbs.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[str, str]] = set()
    instances = 3  # each theme appears with three different data sets
    train_themes = GENERIC_THEMES[:-HELD_OUT_THEMES]
    n_dbs = len(train_themes) * instances
    per_db = -(-generic // n_dbs)
    extra = 3 * -(-(generic_test // 2) // n_dbs)  # test candidates per db, before filtering
    generic_pairs: list[SqlPair] = []
    candidates: list[SqlPair] = []
    for ti, theme in enumerate(train_themes):
        for inst in range(instances):
            path = dbs / f"generic_{ti:02d}_{inst}.sqlite"
            schema = build_database(path, theme, rng)
            pairs = _pairs_for(path, schema, theme, rng, per_db + extra, seen)
            generic_pairs += pairs[:per_db]
            candidates += pairs[per_db:]
    rng.shuffle(generic_pairs)
    generic_pairs = generic_pairs[:generic]
    # A test question is new: neither its question nor its SQL appears in training on any
    # database (sibling databases of a theme share the schema, so text could repeat).
    trained = {p.question for p in generic_pairs} | {p.sql for p in generic_pairs}
    rng.shuffle(candidates)
    fresh = [p for p in candidates if p.question not in trained and p.sql not in trained]
    test_seen = _stratified(fresh, generic_test // 2)
    test_heldout: list[SqlPair] = []
    held = GENERIC_THEMES[-HELD_OUT_THEMES:]
    for hi, theme in enumerate(held):
        path = dbs / f"generic_heldout_{hi:02d}.sqlite"
        schema = build_database(path, theme, rng)
        count = -(-(generic_test - len(test_seen)) // len(held))
        test_heldout += _pairs_for(path, schema, theme, rng, count, seen)
    rng.shuffle(test_heldout)
    test_heldout = _stratified(test_heldout, generic_test - len(test_seen))
    domain_path = dbs / "domain.sqlite"
    schema = build_database(domain_path, DOMAIN_THEME, rng, rows=40)
    domain = _pairs_for(domain_path, schema, DOMAIN_THEME, rng, domain_train + domain_test, seen)
    sets = {
        "generic": generic_pairs,
        "generic_test_seen": test_seen,
        "generic_test_heldout": test_heldout,
        "domain_train": domain[:domain_train],
        "domain_test": domain[domain_train:],
    }
    for name, pairs in sets.items():
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for pair in pairs:
                f.write(pair.to_json() + "\n")
    return {name: len(p) for name, p in sets.items()}


TEMPLATES = ("joins", "ordering", "aggregates", "filters")


def _stratified(pairs: list[SqlPair], count: int) -> list[SqlPair]:
    """Up to `count` pairs taken round-robin over the templates, so that a test set is not
    all of the kind with the most distinct questions (numeric filters)."""
    by: dict[str, list[SqlPair]] = {
        t: [p for p in pairs if template_of(p.sql) == t] for t in TEMPLATES
    }
    out: list[SqlPair] = []
    while len(out) < count and any(by.values()):
        for t in TEMPLATES:
            if by[t] and len(out) < count:
                out.append(by[t].pop(0))
    return out


def template_of(sql: str) -> str:
    """The kind of query, for the per-template breakdown: joins (JOIN), ordering (ORDER BY),
    aggregates (COUNT/AVG/MIN/MAX/SUM or GROUP BY), filters (the rest: WHERE or plain)."""
    up = sql.upper()
    if " JOIN " in up:
        return "joins"
    if "ORDER BY" in up:
        return "ordering"
    if "GROUP BY" in up or any(f"{a}(" in up for a in ("COUNT", "AVG", "MIN", "MAX", "SUM")):
        return "aggregates"
    return "filters"


def load_pairs(path: Path) -> list[SqlPair]:
    """Read a JSONL pair set; a bad line or an empty set is an InputError naming the file."""
    if not path.is_file():
        raise InputError(f"{path}: SQL pair file not found; run the prepare stage first")
    pairs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}, line {i}: not valid JSON ({e.msg})") from e
        missing = [k for k in ("question", "sql", "db", "schema") if not isinstance(d.get(k), str)]
        if missing:
            raise InputError(f"{path}, line {i}: missing or non-text field(s) {', '.join(missing)}")
        pairs.append(SqlPair(d["question"], d["sql"], d["db"], d["schema"]))
    if not pairs:
        raise InputError(f"{path}: no SQL pairs in the file")
    return pairs


def sql_runs(db_path: Path, sql: str) -> bool:
    """True when `sql` is one statement that executes on the database (read-only)."""
    if not sql.strip():
        return False
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        con.execute(sql).fetchall()
        return True
    except (sqlite3.Error, sqlite3.Warning):
        return False
    finally:
        con.close()


def execution_match(db_path: Path, predicted: str, gold: str) -> bool:
    """True when `predicted` runs and returns the same rows as `gold` (order-insensitive
    unless gold has ORDER BY)."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        gold_rows = con.execute(gold).fetchall()
        try:
            pred_rows = con.execute(predicted).fetchall()
        except sqlite3.Error:
            return False
    finally:
        con.close()
    if "ORDER BY" in gold.upper():
        return pred_rows == gold_rows
    return sorted(map(repr, pred_rows)) == sorted(map(repr, gold_rows))


def prompt_text(pair: SqlPair) -> str:
    """What the model sees before it writes SQL (the schema keeps it grounded)."""
    return f"-- schema: {pair.schema}\n-- question: {pair.question}\n"


def response_text(pair: SqlPair) -> str:
    return f"{pair.sql}\n"
