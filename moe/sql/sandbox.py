"""A sqlite database as the SQL stages meet it: what it holds, how the model sees it, and a
way to run a statement on it that cannot change, reach beyond or hang on it. (A database on a
server is moe/sql/server.py's; moe/sql/databases.py `open_database` opens either. The schema
model they share, `Schema` and `serialize_schema`, is moe/sql/schema.py's, re-exported here.)

- `open_checked` refuses a file that is missing, not sqlite (or encrypted), or locked, saying
  which, before any work is done on it.
- `inspect_database` reads the schema from the database itself: tables, columns and their
  declared types, primary and foreign keys, row counts, and per column what the rows hold
  (the distinct values of a categorical column, the range of a numeric one).
- `serialize_schema` turns that into the compact text the model reads before a question; the
  same function serves training and evaluation, so the two can never differ.
- `ReadOnlyDb` executes predicted SQL on a read-only connection with `PRAGMA query_only`,
  an authorizer that allows reading and nothing else (no ATTACH, no pragma, no writes, no
  extension loading), a time limit (sqlite's progress handler) and a row limit.
- `same_result` compares two result sets as Spider's and BIRD's evaluators do (a multiset of
  rows, ordered only when the gold query orders, floats within a tolerance) and
  `normalized_sql` rewrites a query through a real SQL parser (sqlglot) for exact match;
  `in_dialect` rewrites a generated query into a server's dialect.
"""

from __future__ import annotations

import itertools
import math
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from moe.errors import InputError
from moe.sql.schema import CATEGORICAL_MAX, Column, Outcome, Schema, Table
from moe.sql.schema import SchemaStyle as SchemaStyle
from moe.sql.schema import ident as ident
from moe.sql.schema import serialize_schema as serialize_schema

SQLITE_HEADER = b"SQLite format 3\x00"

# --------------------------------------------------------------------------- opening


def _ro_uri(path: Path) -> str:
    return f"file:{quote(str(path.resolve()))}?mode=ro"


def open_checked(path: Path, what: str = "database") -> sqlite3.Connection:
    """A read-only connection to `path`, or an InputError saying what is wrong with the file:
    missing, not a sqlite database (an encrypted one has no plain header either), unreadable
    or locked by another process."""
    if not path.is_file():
        raise InputError(f"{what} {path}: file not found")
    with open(path, "rb") as f:
        head = f.read(len(SQLITE_HEADER))
    if head != SQLITE_HEADER:
        raise InputError(
            f"{what} {path}: not a sqlite database (no 'SQLite format 3' header; an encrypted"
            " database, e.g. SQLCipher, looks like this too: export a plain copy)"
        )
    con = sqlite3.connect(_ro_uri(path), uri=True, timeout=0.5)
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()
    except sqlite3.OperationalError as e:
        con.close()
        if "locked" in str(e) or "busy" in str(e):
            raise InputError(
                f"{what} {path}: locked by another process ({e}); close what holds it and retry"
            ) from e
        raise InputError(f"{what} {path}: cannot be read as sqlite ({e})") from e
    except sqlite3.DatabaseError as e:
        con.close()
        raise InputError(f"{what} {path}: damaged or not sqlite ({e})") from e
    return con


def copy_database(src: Path, dst: Path) -> None:
    """A consistent copy of `src` at `dst` through sqlite's backup API (a database in WAL
    mode is copied whole, with what its log holds); the source is only read."""
    con = open_checked(src)
    dst.unlink(missing_ok=True)
    out = sqlite3.connect(dst)
    try:
        con.backup(out)
    finally:
        out.close()
        con.close()


# --------------------------------------------------------------------------- the schema


def _text(b: bytes) -> str:
    return b.decode("utf-8", "replace")  # a database may hold text that is not UTF-8


def inspect_database(con: sqlite3.Connection, sample_rows: int = 20000) -> Schema:
    """The schema of the database behind `con`, read from the database itself. Column
    statistics come from at most `sample_rows` rows of each table. A database that cannot be
    read this way is an InputError saying why."""
    con.text_factory = _text
    try:
        return _inspect(con, sample_rows)
    except sqlite3.Error as e:
        raise InputError(f"cannot read the schema of the database ({e})") from e


def _inspect(con: sqlite3.Connection, sample_rows: int) -> Schema:
    tables: list[Table] = []
    names = [
        r[0]
        for r in con.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            " ORDER BY rowid"
        )
    ]
    for tname in names:
        q = ident(tname)
        info = con.execute(f"PRAGMA table_info({q})").fetchall()
        fks = {r[3]: (r[2], r[4]) for r in con.execute(f"PRAGMA foreign_key_list({q})").fetchall()}
        rows = con.execute(f"SELECT count(*) FROM {q}").fetchone()[0]
        cols = []
        for _, cname, ctype, _, _, pk in info:
            col = Column(cname, ctype or "", pk=bool(pk), references=fks.get(cname))
            if col.references and col.references[1] is None:  # REFERENCES t without a column
                parent_pk = [
                    r[1]
                    for r in con.execute(f"PRAGMA table_info({ident(col.references[0])})")
                    if r[5]
                ]
                col.references = (col.references[0], parent_pk[0] if parent_pk else "rowid")
            _column_stats(con, q, col, sample_rows)
            col.categorical = (
                not col.numeric
                and not col.pk
                and 1 < col.distinct <= CATEGORICAL_MAX
                and 2 * col.distinct <= min(rows, sample_rows)
            )
            cols.append(col)
        tables.append(Table(tname, cols, rows))
    try:  # the functions this sqlite was built with (3.30 and later list them)
        listed = con.execute("SELECT DISTINCT name FROM pragma_function_list")
        functions = frozenset(name.lower() for (name,) in listed)
    except sqlite3.Error:
        functions = frozenset()
    return Schema(tables, functions=functions)


def _column_stats(con: sqlite3.Connection, table: str, col: Column, sample_rows: int) -> None:
    c = ident(col.name)
    sample = f"(SELECT {c} AS v FROM {table} LIMIT {sample_rows})"
    counts = con.execute(
        f"SELECT v, count(*) AS n FROM {sample} WHERE v IS NOT NULL GROUP BY v"
        " ORDER BY n DESC, v LIMIT 64"
    ).fetchall()
    col.distinct = con.execute(
        f"SELECT count(DISTINCT v) FROM {sample} WHERE v IS NOT NULL"
    ).fetchone()[0]
    col.nulls = con.execute(f"SELECT count(*) FROM {sample} WHERE v IS NULL").fetchone()[0]
    values = [v for v, _ in counts]
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    col.numeric = bool(values) and len(numbers) == len(values)  # what the rows hold
    col.values = values
    if col.numeric:
        lo, hi = con.execute(f"SELECT min(v), max(v) FROM {sample}").fetchone()
        col.lo, col.hi = lo, hi


# --------------------------------------------------------------------------- execution


# Actions a statement may take: read tables and columns, call a (non-extension) function,
# run a recursive CTE. Everything else (ATTACH, DETACH, PRAGMA, any write or DDL,
# transactions) is denied before it runs.
_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_ALLOWED.add(getattr(sqlite3, "SQLITE_RECURSIVE", 33))
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}


class ReadOnlyDb:
    """Runs untrusted SQL on a sqlite file without any way to change it, reach another file,
    or run unbounded: read-only open (`mode=ro`) plus `PRAGMA query_only`, extension loading
    off, an authorizer that allows only reads, `time_limit_s` of execution per statement
    (checked by sqlite's progress handler every `tick` VM steps, against `clock`) and at most
    `row_limit` rows fetched."""

    dialect = "sqlite"

    def __init__(
        self,
        path: Path,
        time_limit_s: float = 2.0,
        row_limit: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
        tick: int = 1000,
    ) -> None:
        self.path, self.time_limit_s, self.row_limit, self.clock = (
            path,
            time_limit_s,
            row_limit,
            clock,
        )
        self.con = open_checked(path)
        self.con.text_factory = _text
        self.con.execute("PRAGMA query_only = ON")
        # no value over 10 MB (zeroblob, a string doubled in a recursive CTE): memory stays
        # bounded where the progress handler cannot interrupt one step
        self.con.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, 10_000_000)
        if hasattr(self.con, "enable_load_extension"):
            self.con.enable_load_extension(False)
        self.con.set_authorizer(self._authorize)
        self._deadline = math.inf
        self._timed_out = False
        self.con.set_progress_handler(self._progress, tick)

    def _authorize(self, action: int, arg1: Any, arg2: Any, *_: Any) -> int:
        if action not in _ALLOWED:
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION and str(arg2).lower() in _DENIED_FUNCTIONS:
            return sqlite3.SQLITE_DENY
        return sqlite3.SQLITE_OK

    def _progress(self) -> int:
        if self.clock() > self._deadline:
            self._timed_out = True
            return 1  # non-zero interrupts the statement
        return 0

    def run(self, sql: str) -> Outcome:
        if not sql.strip():
            return Outcome(None, "error", "empty statement")
        self._timed_out = False
        self._deadline = self.clock() + self.time_limit_s
        try:
            cur = self.con.execute(sql)
            rows = cur.fetchmany(self.row_limit + 1)
            cur.close()
        except sqlite3.DatabaseError as e:
            if self._timed_out:
                return Outcome(None, "timeout", f"over {self.time_limit_s:g} s")
            if any(w in str(e) for w in ("not authorized", "authorization", "prohibited")):
                return Outcome(None, "denied", str(e))
            return Outcome(None, "error", str(e))
        except (
            sqlite3.Warning,
            ValueError,
            OverflowError,
            MemoryError,
        ) as e:  # e.g. two statements
            return Outcome(None, "error", f"{type(e).__name__}: {e}")
        finally:
            self._deadline = math.inf
        if len(rows) > self.row_limit:
            return Outcome(None, "row_limit", f"over {self.row_limit} rows")
        return Outcome(rows)

    @property
    def label(self) -> str:
        """How messages name the database: its file name."""
        return self.path.name

    def schema(self) -> Schema:
        """The database's schema (`inspect_database`, on a connection of its own: this one's
        authorizer refuses the pragmas that reading a schema needs)."""
        con = open_checked(self.path)
        try:
            return inspect_database(con)
        finally:
            con.close()

    def close(self) -> None:
        self.con.close()

    def __enter__(self) -> ReadOnlyDb:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------- comparison


def _value_key(v: Any) -> tuple[int, Any]:
    if isinstance(v, bool):
        v = int(v)
    if isinstance(v, (int, float)):
        return (0, round(float(v), 6)) if math.isfinite(v) else (4, repr(v))
    if v is None:
        return (1, "")
    if isinstance(v, bytes):
        return (3, v.hex())
    return (2, str(v))


def _values_equal(a: Any, b: Any, rel: float, abs_: float) -> bool:
    num = (int, float)
    if isinstance(a, num) and isinstance(b, num) and not isinstance(a, str):
        return math.isclose(float(a), float(b), rel_tol=rel, abs_tol=abs_)
    return a == b


def same_result(
    predicted: list[tuple[Any, ...]],
    gold: list[tuple[Any, ...]],
    ordered: bool,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> bool:
    """Spider/BIRD execution match: equal as multisets of rows (as lists when `ordered`),
    numbers equal within a tolerance (1 and 1.0 are the same answer), the columns in any order
    (Spider's rule: `SELECT count(*), name` answers `SELECT name, count(*)`)."""
    if len(predicted) != len(gold):
        return False
    if not gold:
        return True
    width = len(gold[0])
    if any(len(r) != width for r in predicted):
        return False
    for perm in _column_orders(predicted, gold, width):
        moved = (
            [tuple(r[i] for i in perm) for r in predicted]
            if perm != tuple(range(width))
            else predicted
        )
        if _rows_equal(moved, gold, ordered, rel_tol, abs_tol):
            return True
    return False


def _rows_equal(
    predicted: list[tuple[Any, ...]],
    gold: list[tuple[Any, ...]],
    ordered: bool,
    rel_tol: float,
    abs_tol: float,
) -> bool:
    if not ordered:

        def key(row: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(_value_key(v) for v in row)

        predicted, gold = sorted(predicted, key=key), sorted(gold, key=key)
    return all(
        all(_values_equal(a, b, rel_tol, abs_tol) for a, b in zip(p, g, strict=True))
        for p, g in zip(predicted, gold, strict=True)
    )


def _column_orders(
    predicted: list[tuple[Any, ...]], gold: list[tuple[Any, ...]], width: int
) -> Iterator[tuple[int, ...]]:
    """The orders of the predicted columns worth trying: the identity first, then every
    permutation that maps each gold column to a predicted column holding the same values."""
    identity = tuple(range(width))
    yield identity
    if width == 1:
        return
    col = [sorted(_value_key(r[i]) for r in predicted) for i in range(width)]
    gcol = [sorted(_value_key(r[i]) for r in gold) for i in range(width)]
    options = [[j for j in range(width) if col[j] == gcol[i]] for i in range(width)]
    for perm in itertools.product(*options):
        if perm != identity and len(set(perm)) == width:
            yield perm


def sqlglot_dialect(dialect: str) -> str:
    """sqlglot's name for a SQLAlchemy dialect name (postgresql -> postgres)."""
    return {"postgresql": "postgres", "": "sqlite"}.get(dialect, dialect)


def orders(sql: str, dialect: str = "sqlite") -> bool:
    """Whether a query's result order is part of its answer: its outermost ORDER BY (an
    ORDER BY inside a subquery or a string does not order the result)."""
    tree = parse_sql(sql, dialect)
    if tree is None:
        return "ORDER BY" in " ".join(sql.upper().split())
    return tree.args.get("order") is not None


def parse_sql(sql: str, dialect: str = "sqlite") -> Any:
    """sqlglot's tree of `sql` in `dialect`, or None when it does not parse."""
    import sqlglot
    from sqlglot.errors import SqlglotError

    try:
        return sqlglot.parse_one(sql, read=sqlglot_dialect(dialect))
    except (SqlglotError, ValueError, RecursionError):
        return None


def normalized_sql(sql: str, dialect: str = "sqlite") -> str | None:
    """`sql` rewritten by sqlglot (in `dialect`, identifiers and keywords normalised), or
    None when it does not parse: two queries written differently but parsed the same compare
    equal."""
    tree = parse_sql(sql, dialect)
    if tree is None:
        return None
    return tree.sql(dialect=sqlglot_dialect(dialect), normalize=True, pretty=False)


_PLAIN_PG = re.compile(r"[a-z_][a-z0-9_$]*")


def in_dialect(sql: str, schema: Schema) -> str:
    """`sql` (a template's, in sqlite's SQL) as `schema`'s engine must read it: unchanged for
    sqlite; else rewritten by sqlglot, with each table or column name the server would fold
    to lower case or reads as a keyword quoted. A statement sqlglot cannot read is left as
    it is (the caller executes it, and drops it if it fails)."""
    if schema.dialect in ("", "sqlite"):
        return sql
    import sqlglot
    from sqlglot import exp
    from sqlglot.errors import SqlglotError

    names = {t.name for t in schema.tables} | {c.name for t in schema.tables for c in t.columns}
    try:
        tree = sqlglot.parse_one(sql, read="sqlite")
        for node in tree.find_all(exp.Identifier):
            name = node.name
            if name in names and (not _PLAIN_PG.fullmatch(name) or name in schema.keywords):
                node.set("quoted", True)
        return tree.sql(dialect=sqlglot_dialect(schema.dialect))
    except (SqlglotError, ValueError, RecursionError):
        return sql
