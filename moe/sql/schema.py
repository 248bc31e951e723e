"""A database as the SQL stages see it, whatever engine holds it: its tables, columns, keys and
what the rows hold (`Schema`, read by moe/sql/sandbox.py from a sqlite file and by
moe/sql/reflect.py from a server), the one-line text the model reads (`serialize_schema`),
a fingerprint of its structure and size (`fingerprint`), and what running a statement gave
(`Outcome`).

The schema text of a database that is not sqlite starts with its dialect (`[postgresql] `):
the model is told which SQL to write. Sqlite's text has no such mark (the generic sets and
every sqlite domain are read as before).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

CATEGORICAL_MAX = 30  # a text column with at most this many distinct values, each on 2+ rows
# on average, is categorical


@dataclass
class Column:
    name: str
    type: str  # declared type, as written in CREATE TABLE ("" when none)
    pk: bool = False
    references: tuple[str, str] | None = None  # (table, column) of a foreign key
    numeric: bool = False  # what the rows hold: numbers
    values: list[Any] = field(default_factory=list)  # the distinct values, most frequent first
    distinct: int = 0
    lo: float | None = None
    hi: float | None = None
    nulls: int = 0
    # text with few distinct values that repeat across rows (a department, a country)
    categorical: bool = False


@dataclass
class Table:
    name: str
    columns: list[Column]
    rows: int
    estimated: bool = False  # `rows` is the server's estimate (counting took too long)

    def column(self, name: str) -> Column:
        return next(c for c in self.columns if c.name == name)


@dataclass
class Schema:
    tables: list[Table]
    dialect: str = "sqlite"  # SQLAlchemy's name of the engine: sqlite, postgresql
    namespace: str = ""  # the server's schema the tables are in ("" for sqlite)
    # the words the engine reserves, lower case (a table or column named so is quoted); read
    # from the server (PostgreSQL's pg_get_keywords); sqlite's are `ident`'s own list
    keywords: frozenset[str] = frozenset()
    # the functions the engine has, lower case (sqlite's pragma_function_list, PostgreSQL's
    # pg_proc): the identifier constraint offers no other; empty = not read
    functions: frozenset[str] = frozenset()

    def table(self, name: str) -> Table:
        return next(t for t in self.tables if t.name == name)

    @property
    def foreign_keys(self) -> list[tuple[str, str, str, str]]:
        """(child table, child column, parent table, parent column) for every foreign key."""
        return [
            (t.name, c.name, *c.references)
            for t in self.tables
            for c in t.columns
            if c.references is not None
        ]


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# SQLite's keywords (https://sqlite.org/lang_keywords.html): a name that is one is quoted.
_RESERVED = set(
    """abort action add after all alter always analyze and as asc attach autoincrement before
    begin between by cascade case cast check collate column commit conflict constraint create
    cross current current_date current_time current_timestamp database default deferrable
    deferred delete desc detach distinct do drop each else end escape except exclude exclusive
    exists explain fail filter first following for foreign from full generated glob group groups
    having if ignore immediate in index indexed initially inner insert instead intersect into is
    isnull join key last left like limit match materialized natural no not nothing notnull null
    nulls of offset on or order others outer over partition plan pragma preceding primary query
    raise range recursive references regexp reindex release rename replace restrict returning
    right rollback row rows savepoint select set table temp temporary then ties to transaction
    trigger unbounded union unique update using vacuum values view virtual when where window
    with without""".split()
)


def ident(name: str) -> str:
    """`name` as it must be written in SQL: quoted when it is not a plain identifier or is a
    keyword (Spider's databases have columns such as "Home Town" and "order")."""
    if _IDENT.fullmatch(name) and name.lower() not in _RESERVED:
        return name
    return '"' + name.replace('"', '""') + '"'


def _short_type(t: str) -> str:
    u = t.upper()
    if "INT" in u and "INTERVAL" not in u and "POINT" not in u:
        return "int"
    if any(a in u for a in ("REAL", "FLOA", "DOUB", "NUM", "DEC")):
        return "real"
    if any(a in u for a in ("CHAR", "TEXT", "CLOB")):
        return "text"
    if "DATE" in u or "TIME" in u:
        return "date"
    return u.lower() or "any"


@dataclass(frozen=True)
class SchemaStyle:
    """What the serialised schema carries. Shortening drops sample values first, then the
    column types, each only when the longest example does not fit otherwise."""

    values: int = 0  # up to this many sample values of each categorical column
    types: bool = True

    def shorter(self) -> SchemaStyle | None:
        if self.values:
            return SchemaStyle(0, self.types)
        if self.types:
            return SchemaStyle(0, False)
        return None


def dialect_header(dialect: str) -> str:
    """What the schema text of a `dialect` database starts with: '' for sqlite (the
    generic sets' and the embedded default's), `[postgresql] ` for a PostgreSQL server."""
    return "" if dialect in ("", "sqlite") else f"[{dialect}] "


def serialize_schema(schema: Schema, style: SchemaStyle = SchemaStyle()) -> str:
    """Compact, one line a table: `table(col type pk, col type -> parent.col, col text
    [a|b|c], ...)` joined with '; ', after the dialect (`dialect_header`). Keys always; types
    and sample values per `style`."""
    parts = []
    for t in schema.tables:
        cols = []
        for c in t.columns:
            s = c.name
            if style.types:
                s += " " + _short_type(c.type)
            if c.pk:
                s += " pk"
            if c.references:
                s += f" -> {c.references[0]}.{c.references[1]}"
            if style.values and c.categorical:
                s += " [" + "|".join(str(v) for v in c.values[: style.values]) + "]"
            cols.append(s)
        parts.append(f"{t.name}({', '.join(cols)})")
    return dialect_header(schema.dialect) + "; ".join(parts)


def fingerprint(schema: Schema) -> dict[str, Any]:
    """What changes when the database changes shape or size: sha256 over every table's name,
    columns (name, declared type, key, reference) and row count, with the counts per table
    beside it. A count the server only estimated (`Table.estimated`) is left out of the hash
    (it drifts by itself) and written with a `~`."""
    shape = [
        [t.name, [[c.name, c.type, c.pk, c.references] for c in t.columns]]
        + ([] if t.estimated else [t.rows])
        for t in sorted(schema.tables, key=lambda t: t.name)
    ]
    blob = json.dumps([schema.dialect, schema.namespace, shape], default=str).encode()
    return {
        "dialect": schema.dialect,
        "schema": schema.namespace,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "tables": {t.name: f"~{t.rows}" if t.estimated else t.rows for t in schema.tables},
    }


def changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between two `fingerprint`s, one phrase each ('table invoice: 412 rows,
    now 413', 'table refund: new'); [] when they are the same."""
    if before.get("sha256") == now.get("sha256"):
        return []
    old, new = before.get("tables", {}), now.get("tables", {})
    out = [f"table {t}: new" for t in new if t not in old]
    out += [f"table {t}: gone" for t in old if t not in new]
    out += [f"table {t}: {old[t]} rows, now {new[t]}" for t in new if t in old and old[t] != new[t]]
    return out or ["the columns, types or keys of a table"]


# --------------------------------------------------------------------------- execution


@dataclass
class Outcome:
    """What running one statement gave: rows, or why not ('error', 'timeout', 'row_limit',
    'denied')."""

    rows: list[tuple[Any, ...]] | None
    status: str = "ok"
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"
