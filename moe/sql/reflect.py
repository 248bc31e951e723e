"""A server database's schema read by SQLAlchemy's reflection, and what its rows hold read with
bounded queries: the `Schema` that moe/sql/sandbox.py `inspect_database` reads from a sqlite
file, for a database on a server (moe/sql/server.py).

Tables (and, when asked, views) of one schema (namespace), their columns with the types the
server declares, primary and foreign keys; row counts by `count(*)`, or the server's estimate
when counting takes longer than the statement timeout (a billion-row table is not scanned);
per column the distinct values, nulls and range of at most `sample_rows` rows. Every query
runs on a read-only session with a statement timeout (moe/sql/server.py sets both when the
connection opens) and one that fails or times out leaves its table without statistics
instead of stopping the read.
"""

from __future__ import annotations

import uuid
from decimal import Decimal
from typing import Any

from moe.sql.schema import CATEGORICAL_MAX, Column, Schema, Table

TOP_VALUES = 64  # most frequent values read per column (the generator uses 30)


def _statable(t: Any) -> bool:
    """Whether a column's rows can be counted, grouped and ordered (not JSON, arrays,
    geometry, ...)."""
    import sqlalchemy as sa

    return isinstance(t, (sa.Integer, sa.Numeric, sa.String, sa.Date, sa.DateTime, sa.Uuid))


def _numeric_type(t: Any) -> bool:
    import sqlalchemy as sa

    return isinstance(t, (sa.Integer, sa.Numeric))


def _type_text(t: Any, dialect: Any) -> str:
    """The column's type as the server writes it (`VARCHAR(40)`, `NUMERIC(10, 2)`)."""
    try:
        return str(t.compile(dialect=dialect))
    except Exception:  # noqa: BLE001 - a type SQLAlchemy cannot render: its class name
        return type(t).__name__.upper()


def plain(v: Any) -> Any:
    """A value as the sqlite side would hold it: numbers as int or float, a UUID as text;
    dates stay dates."""
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() and abs(v) < 2**63 else float(v)
    if isinstance(v, uuid.UUID):
        return str(v)
    if isinstance(v, memoryview):
        return bytes(v)
    return v


def _attempt(conn: Any, query: Any) -> list[Any] | None:
    """The rows of `query`, or None when it fails or times out (its transaction is rolled
    back either way: nothing a reflection query does is kept)."""
    import sqlalchemy as sa

    try:
        return list(conn.execute(query).fetchall())
    except sa.exc.DBAPIError:
        return None
    finally:
        conn.rollback()


def _row_count(conn: Any, table: Any, estimate: Any) -> tuple[int, bool]:
    """(rows, estimated): `count(*)`, or the server's own estimate when counting is slower
    than the statement timeout."""
    import sqlalchemy as sa

    got = _attempt(conn, sa.select(sa.func.count()).select_from(table))
    if got is not None:
        return int(got[0][0]), False
    est = _attempt(conn, estimate) if estimate is not None else None
    return (max(int(est[0][0] or 0), 0), True) if est else (0, True)


def _stats(conn: Any, table: Any, cols: list[Column], types: dict[str, Any], n: int) -> None:
    """Distinct values, nulls, range and the most frequent values of each column that has
    comparable values, from at most `n` rows of the table."""
    import sqlalchemy as sa

    names = [c.name for c in cols if _statable(types[c.name])]
    if not names:
        return
    s = sa.select(*[table.c[c] for c in names]).limit(n).subquery("s")
    aggs = []
    for c in names:
        aggs += [sa.func.count(sa.distinct(s.c[c])), sa.func.count() - sa.func.count(s.c[c])]
        aggs += [sa.func.min(s.c[c]), sa.func.max(s.c[c])] if _numeric_type(types[c]) else []
    got = _attempt(conn, sa.select(*aggs))
    if not got:
        return
    row = list(got[0])
    for col in (c for c in cols if c.name in names):
        col.distinct, col.nulls = int(row.pop(0)), int(row.pop(0))
        if _numeric_type(types[col.name]):
            col.lo, col.hi = plain(row.pop(0)), plain(row.pop(0))
        v = s.c[col.name]
        top = _attempt(
            conn,
            sa.select(v, sa.func.count().label("n"))
            .where(v.is_not(None))
            .group_by(v)
            .order_by(sa.desc("n"), v)
            .limit(TOP_VALUES),
        )
        col.values = [plain(x) for x, _ in top or []]
        number = (int, float)
        col.numeric = bool(col.values) and all(
            isinstance(x, number) and not isinstance(x, bool) for x in col.values
        )
        if not col.numeric:
            col.lo = col.hi = None


def _columns(insp: Any, name: str, ns: str, dialect: Any) -> tuple[list[Column], dict[str, Any]]:
    """The table's columns (keys marked) and their SQLAlchemy types by name."""
    raw = insp.get_columns(name, schema=ns)
    pk = set(insp.get_pk_constraint(name, schema=ns).get("constrained_columns") or [])
    refs: dict[str, tuple[str, str]] = {}
    for fk in insp.get_foreign_keys(name, schema=ns):
        if fk.get("referred_schema") not in (None, ns):
            continue  # a table of another schema: not in what the model reads
        for mine, theirs in zip(fk["constrained_columns"], fk["referred_columns"], strict=False):
            refs[mine] = (fk["referred_table"], theirs)
    cols = [
        Column(c["name"], _type_text(c["type"], dialect), c["name"] in pk, refs.get(c["name"]))
        for c in raw
    ]
    return cols, {c["name"]: c["type"] for c in raw}


def reflect_schema(
    conn: Any,
    namespace: str,
    views: bool = False,
    sample_rows: int = 20000,
    stats: bool = True,
    keywords: frozenset[str] = frozenset(),
    functions: frozenset[str] = frozenset(),
) -> Schema:
    """The schema of `namespace` on the server behind `conn` (a SQLAlchemy Connection on a
    read-only, time-limited session): tables (and views with `views`), columns, keys and row
    counts, and with `stats` what the rows hold."""
    import sqlalchemy as sa

    insp = sa.inspect(conn)
    names = insp.get_table_names(schema=namespace)
    if views:
        names += [v for v in insp.get_view_names(schema=namespace) if v not in names]
    pg = conn.dialect.name == "postgresql"
    if pg:  # the tables this role may read: the model is taught no table it cannot query
        may = _attempt(conn, sa.text(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = :ns AND has_table_privilege(c.oid, 'SELECT')"
        ).bindparams(ns=namespace))  # fmt: skip
        readable = {r[0] for r in may} if may is not None else set(names)
        names = [n for n in names if n in readable]
    tables = []
    for name in names:
        cols, types = _columns(insp, name, namespace, conn.dialect)
        table = sa.table(name, *[sa.column(c.name) for c in cols], schema=namespace)
        estimate = (
            sa.text(
                "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(:t)"
            ).bindparams(t=f'"{namespace}"."{name}"')
            if pg
            else None
        )
        rows, estimated = _row_count(conn, table, estimate)
        if stats:
            _stats(conn, table, cols, types, sample_rows)
            for c in cols:
                c.categorical = (
                    not c.numeric
                    and not c.pk
                    and 1 < c.distinct <= CATEGORICAL_MAX
                    and 2 * c.distinct <= min(rows, sample_rows)
                )
        tables.append(Table(name, cols, rows, estimated))
    return Schema(tables, conn.dialect.name, namespace, keywords, functions)


def text_values(
    conn: Any, schema: Schema, per_column: int, sample_rows: int
) -> dict[tuple[str, str], list[str]]:
    """Schema pruning's value index read from the server (moe/sql/pruning.py `ValueIndex`):
    at most `per_column` distinct values of 2 to 60 characters of each text column that is
    not a key, from at most `sample_rows` rows of its table."""
    import sqlalchemy as sa

    out: dict[tuple[str, str], list[str]] = {}
    for t in schema.tables:
        for c in t.columns:
            if c.numeric or c.pk or c.references is not None or not _text_type(c.type):
                continue
            table = sa.table(t.name, sa.column(c.name), schema=schema.namespace)
            s = sa.select(table.c[c.name].label("v")).limit(sample_rows).subquery("s")
            q = sa.select(s.c.v).distinct().where(sa.func.length(s.c.v).between(2, 60))
            q = q.order_by(s.c.v)  # the same values each time the column has more
            got = _attempt(conn, q.limit(per_column))
            if got:
                out[(t.name, c.name)] = [str(v) for (v,) in got]
    return out


def _text_type(declared: str) -> bool:
    u = declared.upper()
    return any(a in u for a in ("CHAR", "TEXT", "CLOB", "STRING", "NAME"))
