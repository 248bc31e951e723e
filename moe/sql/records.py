"""Text-to-SQL pair records, read and checked: `SqlPair` (a prepared pair, with the schema
text the model reads; written as JSONL by prepare and read back by `load_pairs`), `Record`
(a pair before its schema text is fixed), reading records from a `{question, sql[, db]}`
JSONL file or a Spider/BIRD folder, and checking each against its database.

Every pair's SQL is executed on its database before any compute (moe/sql/databases.py
`check_records`); what does not run is named by file and line (`settle` refuses or counts
them, per data.on_bad_record).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql.generator import kind_of


@dataclass
class SqlPair:
    """A prepared pair: what the finetune and evaluate stages read (one JSONL line)."""

    question: str
    sql: str
    db: str  # database file name, relative to the dbs folder (a server's: its link, domain.url)
    schema: str  # the schema text given to the model (moe/sql/sandbox.py: serialize_schema)
    kind: str = ""  # filters, ordering, aggregates, grouping, joins (moe/sql/generator.py: kind_of)
    evidence: str = ""  # BIRD's external knowledge, given in the prompt
    weight: float = 1.0  # sampling weight in finetuning (user-written domain pairs > 1)
    origin: str = ""  # "FILE, line N" for a pair read from a file, "generated" otherwise
    pruned: str = ""  # what schema pruning left out of `schema` ("" = the whole schema)
    values: str = ""  # the cell values the question names (moe/sql/values.py), in the prompt

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
        if self.pruned:
            d["pruned"] = self.pruned
        if self.values:
            d["values"] = self.values
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
    values: str = ""  # the cell values the question names (data.sql_question_values)


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
                d.get("pruned", ""),
                d.get("values", ""),
            )
        )
    if not pairs:
        raise InputError(f"{path}: no SQL pairs in the file")
    return pairs


# --------------------------------------------------------------------------- reading


def norm_question(q: str) -> str:
    """A question as overlap between sets is judged: lower case, runs of spaces as one."""
    return " ".join(q.lower().split())


def norm_sql(sql: str) -> str:
    """A query as overlap between sets is judged: lower case, runs of spaces as one."""
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


def settle(bad: list[str], policy: str, what: str) -> None:
    """data.on_bad_record: `error` refuses the whole prepare, naming every bad record on a
    line of its own; `skip` goes on (the caller counts them)."""
    if bad and policy == "error":
        raise InputError(
            f"{len(bad)} bad SQL pair(s) in {what} (set data.on_bad_record: skip to skip and"
            " count them):\n" + "\n".join(f"  {b}" for b in bad)
        )


def drop_trained_pairs(test: list[Record], train: list[Record], bad: list[str]) -> list[Record]:
    """The test records whose question and SQL are not training ones (as `norm_question`
    and `norm_sql` compare them); each other one is added to `bad`."""
    questions = {norm_question(r.question) for r in train}
    queries = {norm_sql(r.sql) for r in train}
    keep = []
    for r in test:
        if norm_question(r.question) in questions:
            bad.append(f"{r.where}: test question is also a training question: {r.question!r}")
        elif norm_sql(r.sql) in queries:
            bad.append(f"{r.where}: test SQL is also a training pair's SQL: {r.sql!r}")
        else:
            keep.append(r)
    return keep
