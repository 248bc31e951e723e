"""Text-to-SQL pair sets: where the pairs come from, checked by running them, split so that
no test question was trained on, and written for the finetune and evaluate stages.

Finetuning runs in two stages: ~10,000 generic pairs (`data.sql_generic_source`), then ~500
pairs of the target domain (`data.sql_domain_database`). Either comes from:

- the embedded default: databases built from the themes below (a parent table and a child
  that references it, random rows), then questions generated from each database's own
  schema by moe/sql/generator.py, the same generator a user's database gets;
- generic corpora people have: a folder in Spider's layout (`tables.json`,
  `database/<db_id>/<db_id>.sqlite`, pair files such as `train_spider.json` and `dev.json`),
  BIRD's (the same, `*_databases/` folders, `SQL` and `evidence` fields), or a JSONL file of
  `{question, sql, db}` with `db` a sqlite path relative to the file;
- the user's domain: their sqlite file, their own `{question, sql}` pairs (JSONL), and pairs
  generated from that database's schema and rows when they have few or none.

Every pair's SQL is executed on its database before any compute (`check_records`); what does
not run is named by file and line. The schema the model reads is serialised from the
database itself (moe/sql/sandbox.py), once, and stored in each pair: training and evaluation read
the same text.
"""

from __future__ import annotations

import json
import random
import re
import sqlite3
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql.generator import KINDS, QuestionGenerator, kind_of
from moe.sql.sandbox import (
    ReadOnlyDb,
    SchemaStyle,
    copy_database,
    open_checked,
    serialize_schema,
)

# A theme: a parent table and a child table that references it:
# (table, category column, its values, number columns with ranges)
_Table = tuple[str, str, list[str], list[tuple[str, int, int]]]

GENERIC_THEMES: list[tuple[_Table, _Table]] = [
    (
        (
            "singer",
            "country",
            ["France", "Japan", "Brazil", "Kenya", "Canada"],
            [("age", 18, 70), ("net_worth", 1, 900)],
        ),
        (
            "concert",
            "venue",
            ["Arena", "Stadium", "Club", "Hall"],
            [("year", 1990, 2024), ("attendance", 100, 90000)],
        ),
    ),
    (
        (
            "author",
            "genre",
            ["poetry", "fiction", "history", "science"],
            [("birth_year", 1900, 2000), ("awards", 0, 12)],
        ),
        (
            "book",
            "format",
            ["hardcover", "paperback", "ebook"],
            [("pages", 50, 1200), ("price", 5, 90)],
        ),
    ),
    (
        (
            "team",
            "city",
            ["Lyon", "Osaka", "Lima", "Oslo", "Perth"],
            [("founded", 1880, 2010), ("budget", 1, 500)],
        ),
        (
            "player",
            "position",
            ["goalkeeper", "defender", "midfielder", "forward"],
            [("age", 17, 40), ("goals", 0, 300)],
        ),
    ),
    (
        (
            "store",
            "region",
            ["north", "south", "east", "west"],
            [("size", 100, 5000), ("staff", 2, 80)],
        ),
        (
            "sale",
            "category",
            ["food", "toys", "tools", "books"],
            [("amount", 1, 2000), ("quantity", 1, 50)],
        ),
    ),
    (
        (
            "airline",
            "country",
            ["Chile", "Italy", "India", "Egypt"],
            [("fleet_size", 5, 900), ("founded", 1920, 2015)],
        ),
        (
            "flight",
            "destination",
            ["Rome", "Delhi", "Cairo", "Quito", "Seoul"],
            [("distance", 200, 14000), ("delay", 0, 300)],
        ),
    ),
    (
        (
            "school",
            "district",
            ["A", "B", "C", "D"],
            [("students", 100, 4000), ("founded", 1850, 2020)],
        ),
        (
            "teacher",
            "subject",
            ["math", "art", "music", "biology"],
            [("salary", 30, 120), ("experience", 0, 40)],
        ),
    ),
    (
        (
            "farm",
            "state",
            ["Iowa", "Texas", "Ohio", "Utah"],
            [("acres", 10, 9000), ("workers", 1, 120)],
        ),
        (
            "crop",
            "kind",
            ["wheat", "corn", "soy", "rice"],
            [("yield", 1, 400), ("harvest_year", 2000, 2024)],
        ),
    ),
    (
        (
            "museum",
            "city",
            ["Paris", "Berlin", "Madrid", "Vienna"],
            [("opened", 1750, 2020), ("visitors", 1000, 900000)],
        ),
        (
            "exhibit",
            "theme",
            ["modern", "ancient", "nature", "space"],
            [("pieces", 3, 400), ("duration_days", 7, 365)],
        ),
    ),
    (
        (
            "company",
            "industry",
            ["energy", "retail", "software", "banking"],
            [("employees", 5, 90000), ("revenue", 1, 999)],
        ),
        (
            "product",
            "line",
            ["basic", "pro", "premium"],
            [("price", 1, 3000), ("units_sold", 0, 100000)],
        ),
    ),
    (
        (
            "gym",
            "chain",
            ["FitOne", "CoreLab", "IronBox"],
            [("members", 50, 6000), ("opened", 1990, 2024)],
        ),
        (
            "trainer",
            "specialty",
            ["yoga", "boxing", "cycling", "weights"],
            [("age", 20, 65), ("sessions", 0, 900)],
        ),
    ),
    (
        (
            "planet",
            "system",
            ["Sol", "Kepler", "Gliese", "Trappist"],
            [("moons", 0, 80), ("radius", 1, 70000)],
        ),
        (
            "probe",
            "agency",
            ["NASA", "ESA", "JAXA", "ISRO"],
            [("launch_year", 1960, 2024), ("mass", 100, 6000)],
        ),
    ),
    (
        (
            "restaurant",
            "cuisine",
            ["thai", "mexican", "french", "greek"],
            [("rating", 1, 5), ("seats", 10, 300)],
        ),
        (
            "dish",
            "course",
            ["starter", "main", "dessert"],
            [("price", 3, 80), ("calories", 50, 1800)],
        ),
    ),
]

DOMAIN_THEME: tuple[_Table, _Table] = (
    (
        "doctor",
        "department",
        ["cardiology", "oncology", "pediatrics", "neurology", "surgery"],
        [("experience", 1, 40), ("age", 28, 70)],
    ),
    (
        "appointment",
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
    schema: str  # the schema text given to the model (moe/sql/sandbox.py: serialize_schema)
    kind: str = ""  # filters, ordering, aggregates, grouping, joins (moe/sql/generator.py: kind_of)
    evidence: str = ""  # BIRD's external knowledge, given in the prompt
    weight: float = 1.0  # sampling weight in finetuning (user-written domain pairs > 1)
    origin: str = ""  # "FILE, line N" for a pair read from a file, "generated" otherwise

    def __post_init__(self) -> None:
        self.kind = self.kind or kind_of(self.sql)

    def to_json(self) -> str:
        d: dict[str, Any] = {
            "question": self.question,
            "sql": self.sql,
            "db": self.db,
            "schema": self.schema,
            "kind": self.kind,
            "origin": self.origin,
        }
        if self.evidence:
            d["evidence"] = self.evidence
        if self.weight != 1.0:
            d["weight"] = self.weight
        return json.dumps(d)


@dataclass
class Record:
    """A pair before its schema text is fixed: where it came from and which file it runs on."""

    question: str
    sql: str
    db: Path
    where: str  # "FILE, line N" or "generated"
    evidence: str = ""
    split: str = ""  # the pair file's stem (Spider: train_spider, train_others, dev)
    weight: float = 1.0


@dataclass
class SqlSets:
    """What a prepare made: the five sets, what was skipped and why, the schema notes."""

    sets: dict[str, list[SqlPair]]
    skipped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # outside test pairs also in training
    sources: dict[str, str] = field(default_factory=dict)
    longest: dict[str, int] = field(default_factory=dict)  # tokens, per set
    schema_tokens: dict[str, int] = field(default_factory=dict)  # per database

    def summary(self) -> dict[str, Any]:
        return {
            "counts": {k: len(v) for k, v in self.sets.items()},
            "kinds": {
                k: {kind: sum(p.kind == kind for p in v) for kind in KINDS}
                for k, v in self.sets.items()
            },
            "sources": self.sources,
            "skipped_records": len(self.skipped),
            "skipped": self.skipped[:50],
            "schema_notes": self.notes,
            "test_pairs_left_out": len(self.dropped),
            "test_pairs_left_out_why": self.dropped[:20],
            "longest_example_tokens": self.longest,
            "schema_tokens": self.schema_tokens,
        }


@dataclass
class Limits:
    """What an example must fit: `count(text)` gives its tokens; the prompt at most
    `prompt_max` (model.seq_len - evaluate.max_new_tokens), a test answer at most
    `response_max` (evaluate.max_new_tokens), prompt + answer + end token at most
    `total_max[set]` (the finetune stage's max_len). `keys` names them in messages."""

    count: Callable[[list[str]], list[int]]
    prompt_max: int
    response_max: int
    total_max: dict[str, int]
    keys: dict[str, str]


# --------------------------------------------------------------------------- reading


def _norm_q(q: str) -> str:
    return " ".join(q.lower().split())


def _norm_sql(sql: str) -> str:
    return " ".join(sql.lower().split())


def _json_array_lines(text: str) -> Iterable[tuple[int, Any]]:
    """(line, element) for each element of a top-level JSON array, so that a record of a
    Spider pair file can be named by its line."""
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    n = len(text)
    while pos < n:
        while pos < n and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= n or text[pos] == "]":
            return
        obj, end = dec.raw_decode(text, pos)
        yield text.count("\n", 0, pos) + 1, obj
        pos = end


def _record(
    d: Any, where: str, db: Path | None, bad: list[str], split: str = "", weight: float = 1.0
) -> Record | None:
    if not isinstance(d, dict):
        bad.append(f"{where}: not a JSON object")
        return None
    sql = d.get("sql", d.get("query", d.get("SQL")))
    missing = [
        k
        for k, v in (("question", d.get("question")), ("sql", sql))
        if not isinstance(v, str) or not v.strip()
    ]
    if missing:
        bad.append(f"{where}: missing or empty field(s) {', '.join(missing)}")
        return None
    if db is None:
        bad.append(f"{where}: no database named (field db)")
        return None
    ev = d.get("evidence") or ""
    return Record(
        d["question"].strip(), " ".join(sql.split()), db, where, str(ev).strip(), split, weight
    )


def read_jsonl(path: Path, db: Path | None, bad: list[str], weight: float = 1.0) -> list[Record]:
    """`{question, sql[, db][, evidence]}` per line. `db` (relative to the file) names the
    database unless `db` is given (a domain's pairs all run on its one database)."""
    if not path.is_file():
        raise InputError(f"{path}: SQL pairs file not found")
    out = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {i}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(f"{where}: not valid JSON ({e.msg})")
            continue
        target = db
        if target is None and isinstance(d, dict) and isinstance(d.get("db"), str):
            target = (path.parent / d["db"]).resolve()
        r = _record(d, where, target, bad, weight=weight)
        if r:
            out.append(r)
    if not out and not any(str(path) in b for b in bad):
        raise InputError(f"{path}: the SQL pairs file is empty")
    return out


def _corpus_databases(folder: Path) -> dict[str, Path]:
    """db_id -> sqlite file for a Spider/BIRD folder: `database/<id>/<id>.sqlite` (Spider)
    or `*_databases/<id>/<id>.sqlite` (BIRD), at the top or one folder down."""
    out: dict[str, Path] = {}
    for d in sorted([*folder.glob("*database*"), *folder.glob("*/*database*")]):
        if d.is_dir():
            for sub in sorted(d.iterdir()):
                f = sub / f"{sub.name}.sqlite"
                if f.is_file():
                    out.setdefault(sub.name, f)
    return out


def read_corpus_folder(folder: Path, bad: list[str]) -> list[Record]:
    """Every pair of a Spider- or BIRD-layout folder: the `*.json` pair files (a list of
    records with `question`, `query` or `SQL`, `db_id` and, in BIRD, `evidence`), at the top
    or one folder down; `tables.json` files are schema descriptions, which are read from the
    databases themselves instead."""
    dbs = _corpus_databases(folder)
    if not dbs:
        raise InputError(
            f"{folder}: no databases found (Spider: database/<db_id>/<db_id>.sqlite;"
            " BIRD: *_databases/<db_id>/<db_id>.sqlite)"
        )
    files = sorted(
        p
        for p in [*folder.glob("*.json"), *folder.glob("*/*.json")]
        if "tables" not in p.stem and "database" not in str(p.relative_to(folder).parent)
    )
    out: list[Record] = []
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        if not text.lstrip().startswith("["):
            continue  # not a pair file
        try:
            items = list(_json_array_lines(text))
        except (json.JSONDecodeError, ValueError) as e:
            bad.append(f"{f}: not a valid JSON array ({e})")
            continue
        if not items or not isinstance(items[0][1], dict) or "question" not in items[0][1]:
            continue
        for line, d in items:
            where = f"{f}, line {line}"
            db_id = d.get("db_id") if isinstance(d, dict) else None
            db = dbs.get(db_id) if isinstance(db_id, str) else None
            if isinstance(d, dict) and db is None:
                bad.append(f"{where}: database {db_id!r} not found under {folder}")
                continue
            r = _record(d, where, db, bad, split=f.stem)
            if r:
                out.append(r)
    if not out and not bad:
        raise InputError(f"{folder}: no pair files (a JSON list of question/query records)")
    return out


# --------------------------------------------------------------------------- checking


class _Dbs:
    """One checked, read-only connection per database file, opened on first use."""

    def __init__(self, time_limit_s: float, row_limit: int) -> None:
        self.open: dict[Path, ReadOnlyDb | InputError] = {}
        self.time_limit_s, self.row_limit = time_limit_s, row_limit

    def get(self, path: Path) -> ReadOnlyDb:
        if path not in self.open:
            try:
                self.open[path] = ReadOnlyDb(path, self.time_limit_s, self.row_limit)
            except InputError as e:
                self.open[path] = e
        got = self.open[path]
        if isinstance(got, InputError):
            raise got
        return got

    def close(self) -> None:
        for db in self.open.values():
            if isinstance(db, ReadOnlyDb):
                db.close()


def check_records(records: list[Record], dbs: _Dbs, bad: list[str]) -> list[Record]:
    """The records whose SQL runs on their database within the limits; each other one is
    added to `bad`, named by its file and line."""
    good = []
    for r in records:
        try:
            db = dbs.get(r.db)
        except InputError as e:
            bad.append(f"{r.where}: {e}")
            continue
        out = db.run(r.sql)
        if out.ok:
            good.append(r)
        else:
            bad.append(
                f"{r.where}: the SQL does not run on {r.db.name} ({out.status}: {out.message})"
            )
    return good


def settle(bad: list[str], policy: str, what: str) -> None:
    """data.on_bad_record: `error` refuses the whole prepare, naming every bad record on a
    line of its own; `skip` goes on (the caller counts them)."""
    if bad and policy == "error":
        raise InputError(
            f"{len(bad)} bad SQL pair(s) in {what} (set data.on_bad_record: skip to skip and"
            " count them):\n" + "\n".join(f"  {b}" for b in bad)
        )


def _overlap(test: list[Record], train: list[Record], bad: list[str]) -> list[Record]:
    trained = {_norm_q(r.question) for r in train}
    keep = []
    for r in test:
        if _norm_q(r.question) in trained:
            bad.append(f"{r.where}: test question is also a training question: {r.question!r}")
        else:
            keep.append(r)
    return keep


# --------------------------------------------------------------------------- generating


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def build_database(
    path: Path, theme: tuple[_Table, _Table], rng: random.Random, rows: int = 30
) -> None:
    """Create a sqlite database for `theme` with random rows: the embedded default's
    databases, which the generator then reads like any other."""
    (pt, pcat, pvals, pnums), (ct, ccat, cvals, cnums) = theme
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


def generate_records(
    db_path: Path,
    dbs: _Dbs,
    rng: random.Random,
    count: int,
    seen: set[tuple[Path, str]],
) -> list[Record]:
    """Up to `count` new (question, SQL) pairs generated from the database's own schema and
    rows, each executed before it is kept; `seen` holds what any set already has."""
    db = dbs.get(db_path)
    stream = QuestionGenerator(db.schema()).stream(rng)
    out: list[Record] = []
    for _ in range(count * 50):
        if len(out) >= count:
            break
        got = next(stream, None)
        if got is None:
            break
        q, sql = got
        keys = {(db_path, sql), (db_path, _norm_q(q)), (db_path, _norm_sql(sql))}
        if keys & seen or not db.run(sql).ok:
            continue
        seen.update(keys)
        out.append(Record(q, sql, db_path, "generated"))
    return out


def _stratified(records: list[Record], count: int, share: float = 1.0) -> list[Record]:
    """Up to `count` records taken round-robin over the kinds, so that a test set is not
    all of the kind with the most distinct questions; at most `share` of each kind."""
    by: dict[str, list[Record]] = {k: [r for r in records if kind_of(r.sql) == k] for k in KINDS}
    cap = {k: max(1, int(len(v) * share)) if v else 0 for k, v in by.items()}
    out: list[Record] = []
    taken = dict.fromkeys(KINDS, 0)
    while len(out) < count and any(by[k] and taken[k] < cap[k] for k in KINDS):
        for k in KINDS:
            if by[k] and taken[k] < cap[k] and len(out) < count:
                out.append(by[k].pop(0))
                taken[k] += 1
    return out


def _split_pool(pool: list[Record], n_test: int, n_train: int) -> tuple[list[Record], list[Record]]:
    """A stratified test set (every kind, at most half of each kind's pairs) and a training
    set sharing neither a question nor a SQL text with it."""
    test = _stratified(pool, n_test, share=0.5)
    held = {_norm_q(r.question) for r in test} | {r.sql for r in test}
    train = [
        r for r in pool if r not in test and _norm_q(r.question) not in held and r.sql not in held
    ]
    return train[:n_train], test


HELD_OUT_THEMES = 2  # the last generic themes: schemas no training pair uses


def _generated_generic(
    dbs_dir: Path, dbs: _Dbs, rng: random.Random, n_train: int, n_test: int
) -> tuple[list[Record], list[Record], list[Record]]:
    seen: set[tuple[Path, str]] = set()
    instances = 3  # each theme appears with three different data sets
    train_themes = GENERIC_THEMES[:-HELD_OUT_THEMES]
    n_dbs = len(train_themes) * instances
    per_db = -(-n_train // n_dbs)
    extra = 3 * -(-(n_test // 2) // n_dbs)  # test candidates per db, before filtering
    train: list[Record] = []
    candidates: list[Record] = []
    for ti, theme in enumerate(train_themes):
        for inst in range(instances):
            path = dbs_dir / f"generic_{ti:02d}_{inst}.sqlite"
            build_database(path, theme, rng)
            got = generate_records(path, dbs, rng, per_db + extra, seen)
            tr, te = _split_pool(got, extra, per_db)  # every kind among the test candidates
            train += tr
            candidates += te
    rng.shuffle(train)
    train = train[:n_train]
    # A test question is new: neither its question nor its SQL appears in training on any
    # database (sibling databases of a theme share the schema, so text could repeat).
    trained = {_norm_q(r.question) for r in train} | {r.sql for r in train}
    rng.shuffle(candidates)
    fresh = [r for r in candidates if _norm_q(r.question) not in trained and r.sql not in trained]
    test_seen = _stratified(fresh, n_test // 2)
    held: list[Record] = []
    for hi, theme in enumerate(GENERIC_THEMES[-HELD_OUT_THEMES:]):
        path = dbs_dir / f"generic_heldout_{hi:02d}.sqlite"
        build_database(path, theme, rng)
        held += generate_records(path, dbs, rng, 3 * (n_test - len(test_seen)), seen)
    rng.shuffle(held)
    return train, test_seen, _stratified(held, n_test - len(test_seen))


def _source_generic(
    d: Any, dbs: _Dbs, rng: random.Random, bad: list[str], dropped: list[str]
) -> tuple[list[Record], list[Record], list[Record]]:
    """Training and test pairs of a Spider/BIRD folder or a `{question, sql, db}` JSONL file.
    The test pairs are the `data.sql_generic_test_split` file's when the source has one,
    else those of a held-out share of the databases (`data.sql_generic_heldout_dbs`) plus new
    questions on the training databases; test pairs on a training database are 'seen',
    the others 'held out'."""
    src = Path(d.sql_generic_source).expanduser()
    if src.is_dir():
        records = read_corpus_folder(src, bad)
    elif src.is_file():
        records = read_jsonl(src, None, bad)
    else:
        raise InputError(
            f"data.sql_generic_source = {d.sql_generic_source!r}: no such file or folder"
            " (use 'generated', a Spider/BIRD folder or a JSONL file)"
        )
    records = check_records(records, dbs, bad)
    rng.shuffle(records)
    test = [r for r in records if r.split == d.sql_generic_test_split]
    if test:
        train = [r for r in records if r.split != d.sql_generic_test_split]
    else:
        ids = sorted({r.db for r in records})
        rng.shuffle(ids)
        k = 0
        if len(ids) > 1 and d.sql_generic_heldout_dbs > 0:  # one at least, never all
            k = min(max(1, round(len(ids) * d.sql_generic_heldout_dbs)), len(ids) - 1)
        out_dbs = set(ids[:k])
        test = [r for r in records if r.db in out_dbs]
        rest = [r for r in records if r.db not in out_dbs]
        seen_test = _stratified(rest, d.sql_generic_test_pairs // 2, share=0.2)
        held_text = {_norm_q(r.question) for r in seen_test} | {_norm_sql(r.sql) for r in seen_test}
        train = [
            r
            for r in rest
            if r not in seen_test
            and _norm_q(r.question) not in held_text
            and _norm_sql(r.sql) not in held_text
        ]
        test += seen_test
    train = train[: d.sql_generic_pairs]
    # An outside corpus may repeat a question or a query across its splits: such test pairs
    # are left out of the test (counted), since the user cannot be asked to fix Spider.
    trained = {_norm_q(r.question) for r in train} | {_norm_sql(r.sql) for r in train}
    repeats = [r for r in test if _norm_q(r.question) in trained or _norm_sql(r.sql) in trained]
    test = [r for r in test if r not in repeats]
    dropped.extend(
        f"{r.where}: test pair left out: its question or SQL is also a training one"
        for r in repeats
    )
    train_dbs = {r.db for r in train}
    n = d.sql_generic_test_pairs
    seen = _stratified([r for r in test if r.db in train_dbs], n // 2)
    held = _stratified([r for r in test if r.db not in train_dbs], n - len(seen))
    if len(held) < n - len(seen):  # fewer held-out databases than asked: more seen ones
        seen = _stratified([r for r in test if r.db in train_dbs], n - len(held))
    return train, seen, held


def _domain(
    d: Any, dbs_dir: Path, dbs: _Dbs, rng: random.Random, bad: list[str]
) -> tuple[list[Record], list[Record], dict[str, str]]:
    """The domain's training and test pairs on dbs/domain.sqlite: the user's database (a
    copy; the file itself is only read) or the embedded default's, the user's pairs (weighted)
    and pairs generated from the database for the rest of `data.sql_domain_train_pairs`. The
    test set is only ever the user's pairs when there are any."""
    path = dbs_dir / "domain.sqlite"
    src: dict[str, str] = {}
    if d.sql_domain_database:
        user_db = Path(d.sql_domain_database).expanduser()
        open_checked(user_db, "data.sql_domain_database").close()  # says what is wrong
        copy_database(user_db, path)
        src["domain_database"] = str(user_db)
    else:
        build_database(path, DOMAIN_THEME, rng, rows=40)
        src["domain_database"] = "generated"
    user_train: list[Record] = []
    user_test: list[Record] = []
    if d.sql_domain_pairs:
        user_train = read_jsonl(
            Path(d.sql_domain_pairs).expanduser(), path, bad, d.sql_domain_pairs_weight
        )
        src["domain_pairs"] = d.sql_domain_pairs
    held = d.sql_domain_test
    if held and not _is_fraction(held):
        user_test = read_jsonl(Path(held).expanduser(), path, bad)
        src["domain_test"] = held
    user_train = check_records(user_train, dbs, bad)
    user_test = check_records(user_test, dbs, bad)
    settle(bad, d.on_bad_record, "the domain's pairs")  # before they are split
    if held and not _is_fraction(held) and not user_test:
        raise InputError(f"{held}: no usable test pair left (data.sql_domain_test)")
    if user_train and not user_test and _is_fraction(held or "0.3"):
        frac = float(held or "0.3")
        if len(user_train) < 2:
            raise InputError(
                f"{d.sql_domain_pairs}: one usable pair cannot be split into training and test:"
                " write more pairs, or give a test file (data.sql_domain_test)"
            )
        rng.shuffle(user_train)
        cut = min(len(user_train) - 1, max(1, round(len(user_train) * frac)))
        user_test, user_train = user_train[:cut], user_train[cut:]
        src["domain_test"] = f"{frac:g} of the user's pairs"
    for r in user_test:
        r.weight = 1.0
    user_test = _overlap(user_test, user_train, bad)
    seen = {(r.db, r.sql) for r in user_train + user_test}
    seen |= {(r.db, _norm_sql(r.sql)) for r in user_train + user_test}
    seen |= {(r.db, _norm_q(r.question)) for r in user_train + user_test}
    n_gen = max(0, d.sql_domain_train_pairs - len(user_train))
    if user_test:
        generated = generate_records(path, dbs, rng, n_gen, seen)
        test = user_test
    else:
        pool = generate_records(path, dbs, rng, n_gen + 3 * d.sql_domain_test_pairs, seen)
        generated, test = _split_pool(pool, d.sql_domain_test_pairs, n_gen)
    src["domain_generated_pairs"] = str(len(generated))
    return user_train + generated, test, src


def _is_fraction(s: str) -> bool:
    try:
        return 0 < float(s) < 1
    except ValueError:
        return False


# --------------------------------------------------------------------------- schemas


def _prompt(schema: str, r: Record) -> str:
    return prompt_text(SqlPair(r.question, r.sql, "", schema, evidence=r.evidence))


def _fit(
    db: Path,
    schema_of: Callable[[SchemaStyle], str],
    members: list[tuple[str, Record]],
    style: SchemaStyle,
    limits: Limits,
) -> tuple[str, str | None, int, int, set[int]]:
    """The schema text for one database: the fullest `style` under which every example on it
    fits (sample values are dropped first, then column types), a note saying what was left
    out, the longest example kept, the schema's tokens, and the ids of generated records that
    do not fit even then (left out, counted by the caller). A pair of the user's or of an
    outside corpus that does not fit is refused with the numbers."""
    first = style
    while True:
        text = schema_of(style)
        prompts = limits.count([_prompt(text, r) for _, r in members])
        answers = limits.count([r.sql + "\n" for _, r in members])
        over = [
            (p + a + 1, p, a, name, r)
            for (name, r), p, a in zip(members, prompts, answers, strict=True)
            if p > limits.prompt_max
            or p + a + 1 > limits.total_max[name] + 1
            or (name not in ("train", "train_domain") and a > limits.response_max)
        ]
        schema_tokens = limits.count([text])[0]
        nxt = style.shorter()
        if over and nxt is not None:
            style = nxt
            continue
        theirs = [o for o in over if o[4].where != "generated"]
        if theirs:
            total, p, a, name, r = max(theirs, key=lambda t: t[0])
            raise InputError(
                f"{r.where} on {db.name}: the example does not fit the model: prompt {p}"
                f" tokens (the schema alone {schema_tokens}) + SQL {a} tokens + end = {total};"
                f" allowed: {limits.keys[name]} = {limits.total_max[name]} for prompt + SQL,"
                f" {limits.keys['prompt']} = {limits.prompt_max} for the prompt and"
                f" {limits.keys['response']} = {limits.response_max} for a test answer."
                f" Raise model.seq_len and the finetune stages' max_len (to at least {total}),"
                f" or shorten the schema (fewer tables or columns)"
            )
        dropped = {id(o[4]) for o in over}
        longest = max(
            (
                p + a + 1
                for (_, r), p, a in zip(members, prompts, answers, strict=True)
                if id(r) not in dropped
            ),
            default=0,
        )
        left = []
        if first.values and not style.values:
            left.append("sample values")
        if first.types and not style.types:
            left.append("column types")
        notes = []
        if left:
            notes.append(
                f"{' and '.join(left)} left out of the schema so that the examples fit"
                f" (longest example {longest} tokens)"
            )
        if dropped:
            notes.append(
                f"{len(dropped)} generated pair(s) longer than the model's lengths left out"
                f" (longest {max(o[0] for o in over)} tokens; raise model.seq_len and the"
                " finetune stages' max_len to keep them)"
            )
        note = f"{db.name}: {'; '.join(notes)}" if notes else None
        return text, note, longest, schema_tokens, dropped


# --------------------------------------------------------------------------- building


SET_ROLE = {  # which length limit a set's examples must fit
    "generic": "train",
    "generic_test_seen": "generic",
    "generic_test_heldout": "generic",
    "domain_train": "train_domain",
    "domain_test": "domain",
}


def build_sql_sets(d: Any, out_dir: Path, limits: Limits) -> SqlSets:
    """Read, generate, check and split every pair set of `d` (a DataConfig), write them
    under out_dir (`generic.jsonl`, `generic_test_seen.jsonl`, `generic_test_heldout.jsonl`,
    `domain_train.jsonl`, `domain_test.jsonl` and `dbs/*.sqlite`) and say what was skipped.
    No test question is a training one."""
    rng = random.Random(d.seed)
    dbs_dir = out_dir / "dbs"
    dbs_dir.mkdir(parents=True, exist_ok=True)
    dbs = _Dbs(d.sql_time_limit_s, d.sql_row_limit)
    bad: list[str] = []
    result_dropped: list[str] = []
    try:
        if d.sql_generic_source == "generated":
            g = _generated_generic(dbs_dir, dbs, rng, d.sql_generic_pairs, d.sql_generic_test_pairs)
            gsrc = "generated"
        else:
            g = _source_generic(d, dbs, rng, bad, result_dropped)
            gsrc = d.sql_generic_source
        settle(bad, d.on_bad_record, f"data.sql_generic_source ({gsrc})")
        dtrain, dtest, src = _domain(d, dbs_dir, dbs, rng, bad)
        settle(bad, d.on_bad_record, "the domain's pairs")
        if not dtest:
            raise InputError("the domain test set is empty: give data.sql_domain_test pairs")
        if not g[0]:
            raise InputError(f"data.sql_generic_source ({gsrc}): no training pair runs")
        if not dtrain:
            raise InputError(
                "the domain has no training pair: give data.sql_domain_pairs, or a database"
                " with rows the generator can ask about (data.sql_domain_database)"
            )
        raw = {
            "generic": g[0],
            "generic_test_seen": g[1],
            "generic_test_heldout": g[2],
            "domain_train": dtrain,
            "domain_test": dtest,
        }
        result = SqlSets({}, bad, sources={"generic": gsrc, **src}, dropped=result_dropped)
        # the database files a pair names in the prepared folder (copies of outside ones)
        names: dict[Path, str] = {}
        for recs in raw.values():
            for r in recs:
                if r.db not in names:
                    if r.db.parent == dbs_dir:
                        names[r.db] = r.db.name
                    else:
                        stem = re.sub(r"[^A-Za-z0-9_.-]", "_", r.db.stem)
                        name, k = f"generic_{stem}.sqlite", 1
                        while name in names.values():
                            k += 1
                            name = f"generic_{stem}_{k}.sqlite"
                        copy_database(r.db, dbs_dir / name)
                        names[r.db] = name
        texts: dict[Path, str] = {}
        too_long: set[int] = set()  # generated records that do not fit the model
        by_db: dict[Path, list[tuple[str, Record]]] = {}
        for set_name, recs in raw.items():
            for r in recs:
                by_db.setdefault(r.db, []).append((SET_ROLE[set_name], r))
        for db_path, members in by_db.items():
            schema = dbs.get(db_path).schema()
            text, note, longest, stoks, dropped = _fit(
                db_path,
                lambda style, s=schema: serialize_schema(s, style),
                members,
                SchemaStyle(d.sql_schema_values, True),
                limits,
            )
            texts[db_path] = text
            too_long |= dropped
            result.schema_tokens[names[db_path]] = stoks
            if note:
                result.notes.append(note.replace(db_path.name, names[db_path], 1))
        for set_name, recs in raw.items():
            recs = [r for r in recs if id(r) not in too_long]
            if not recs and set_name in ("generic", "domain_train", "domain_test"):
                raise InputError(
                    f"no {set_name} pair fits the model's lengths ({limits.keys['prompt']} ="
                    f" {limits.prompt_max}, {limits.keys['response']} = {limits.response_max},"
                    f" the finetune max_len {max(limits.total_max.values())}): raise"
                    " model.seq_len and the finetune stages' max_len"
                )
            pairs = [
                SqlPair(
                    r.question, r.sql, names[r.db], texts[r.db], "", r.evidence, r.weight, r.where
                )
                for r in recs
            ]
            result.sets[set_name] = pairs
            result.longest[set_name] = max(
                (n + 1 for n in limits.count([prompt_text(p) + response_text(p) for p in pairs])),
                default=0,
            )
    finally:
        dbs.close()
    for name, pairs in result.sets.items():
        if not pairs and name.startswith("generic_test"):
            continue  # e.g. Spider: its dev databases are all held out, none is 'seen'
        with open(out_dir / f"{name}.jsonl", "w") as f:
            for pair in pairs:
                f.write(pair.to_json() + "\n")
    return result


def load_pairs(path: Path) -> list[SqlPair]:
    """Read a prepared JSONL pair set; a bad line or an empty set is an InputError naming
    the file."""
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
        pairs.append(
            SqlPair(
                d["question"],
                d["sql"],
                d["db"],
                d["schema"],
                d.get("kind", ""),
                d.get("evidence", ""),
                float(d.get("weight", 1.0)),
                d.get("origin", ""),
            )
        )
    if not pairs:
        raise InputError(f"{path}: no SQL pairs in the file")
    return pairs


def prompt_text(pair: SqlPair) -> str:
    """What the model sees before it writes SQL (the schema keeps it grounded; BIRD's
    evidence, when a pair has it, comes before the question)."""
    ev = f"-- evidence: {pair.evidence}\n" if pair.evidence else ""
    return f"-- schema: {pair.schema}\n{ev}-- question: {pair.question}\n"


def response_text(pair: SqlPair) -> str:
    return f"{pair.sql}\n"
