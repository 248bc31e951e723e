"""A database on a server, by SQLAlchemy URL (`postgresql+psycopg://reader@host:5432/shop`):
the same three things moe/sql/sandbox.py gives a sqlite file (its schema, a way to run
untrusted SQL that cannot change it, hang on it or flood the client, and a name for messages)
enforced by the server's own means.

- `parse_url` refuses a URL with a password in it (the URL is a param: it lands in params
  dumps, lineage records and logs) and an engine we have no sandbox for; the password comes
  from `data.sql_domain_password` (`env:NAME`, or `prefect:BLOCK`, a Prefect Secret block
  that tasks/ resolves: `PASSWORD_SOURCES`) or the driver's own (PGPASSWORD, ~/.pgpass).
- `ServerLink` is what prepare writes where a sqlite domain's copy would be (`dbs/domain.url`):
  the URL without a password, where the password comes from, the schema and the fingerprint
  at prepare. The prepared data travels to other machines with it; each opens the server.
- `ServerDb` runs one statement per call on a session opened read-only
  (`default_transaction_read_only`, `statement_timeout`, `lock_timeout`,
  `idle_in_transaction_session_timeout`), each in its own transaction that starts
  `SET TRANSACTION READ ONLY` and is always rolled back (and every advisory lock the
  statement took released: a session-level one outlives the rollback), as a
  server-side cursor (`DECLARE ... CURSOR FOR`: PostgreSQL accepts nothing but a query there,
  one statement, no data-modifying WITH) from which at most `row_limit + 1` rows are fetched.
  What is not a query (DROP, INSERT, COPY ... TO PROGRAM, SET ROLE, several statements) and
  functions that act beyond the transaction (`pg_terminate_backend`, `lo_export`,
  `set_config`, `dblink`, ..., quoted or not) are denied before they reach the server: a fast first refusal
  with a clear reason, not the guard (`word_list=False` turns it off, and the tests show the
  server refusing each of them).
- The guard is the login's own privileges: `unsafe_privileges` names what a login may do
  beyond reading its own session (superuser, pg_read_server_files, pg_write_server_files,
  pg_execute_server_program, pg_signal_backend, CREATE on the database or schema, writes to
  tables, views or foreign tables, creating roles or databases, EXECUTE on
  pg_terminate_backend or pg_cancel_backend, which end the role's other sessions), and
  prepare refuses such a login, saying how to take each away. A role SET after login cannot take
  its place: a statement can reset the role to the login's (`set_config('role', ...)`)
  within its own evaluation, so the role that evaluates must be the one that logs in.

Only PostgreSQL (psycopg 3) has a sandbox here: the rules are the engine's own, and another
engine (MySQL, DuckDB) is refused rather than run without them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

from moe.errors import InputError
from moe.sql.reflect import plain, reflect_schema, text_values
from moe.sql.schema import Outcome, Schema, fingerprint

LINK_SUFFIX = ".url"  # dbs/domain.url: a `ServerLink` (JSON), where a copy would be
SANDBOXED = {"postgresql": "psycopg"}  # engines with a sandbox -> the driver it is written for
# Where a password may come from, besides the driver's own: env:NAME here, prefect:BLOCK added
# by tasks/ (moe/ does not import Prefect).
PASSWORD_SOURCES: dict[str, Callable[[str], str]] = {}

# Statements a query may start with; anything else is denied before it reaches the server.
_QUERY_WORDS = {"select", "with", "values", "table"}
# Functions that act beyond a read-only transaction or reach the server's files, other
# sessions or other servers: denied by name (a read-only role should not have them either).
# A name may be quoted ("pg_advisory_lock"(1) calls the same function).
_DENIED_CALL = re.compile(
    r"(?<![\w$])\"?(pg_terminate_backend|pg_cancel_backend|pg_reload_conf|pg_rotate_logfile|pg_promote"
    r"|pg_switch_wal|pg_create_\w+|pg_drop_\w+|pg_read_file|pg_read_binary_file|pg_ls_\w+"
    r"|pg_stat_file|pg_file_\w+|lo_\w+|dblink\w*|set_config|pg_advisory\w*|pg_notify"
    r"|pg_logical_\w+|pg_replication_\w+|query_to_xml\w*|cursor_to_xml\w*)\"?\s*\(",
    re.IGNORECASE,
)
# Roles whose members reach the server's files and programs (PostgreSQL 11+), or signal any
# session but a superuser's.
SERVER_FILE_ROLES = ("pg_read_server_files", "pg_write_server_files", "pg_execute_server_program")
REACHING_ROLES = (*SERVER_FILE_ROLES, "pg_signal_backend")
# Relations a role writes through when granted INSERT, UPDATE, DELETE or TRUNCATE: tables,
# partitioned tables, (auto-updatable) views, foreign tables.
WRITABLE_KINDS = "('r', 'p', 'v', 'f')"
# What a role may signal its own other sessions with (EXECUTE is granted to PUBLIC by default).
SIGNALS = ("pg_terminate_backend", "pg_cancel_backend")
REVOKE_SIGNALS = (
    "REVOKE EXECUTE ON FUNCTION pg_terminate_backend, pg_cancel_backend FROM PUBLIC"
    " (in this database, as a superuser)"
)
_COMMENT = re.compile(r"\s*(--[^\n]*(\n|$)|/\*.*?\*/)", re.DOTALL)
_COMMENTS = re.compile(r"--[^\n]*|/\*.*?\*/", re.DOTALL)


def is_url(target: object) -> bool:
    """Whether a domain database names a server (a URL) rather than a sqlite file."""
    return isinstance(target, str) and "://" in target


def parse_url(text: str, what: str = "data.sql_domain_database") -> Any:
    """The SQLAlchemy URL of `text`, checked: no password in it, an engine with a sandbox
    here, its driver set (postgresql:// means postgresql+psycopg://)."""
    import sqlalchemy as sa

    try:
        url = sa.make_url(text)
    except (sa.exc.ArgumentError, ValueError) as e:
        raise InputError(f"{what}: not a database URL ({e})") from None
    if url.password is not None:
        raise InputError(
            f"{what}: the URL holds a password, and the URL is a param (it lands in params, "
            "lineage records and logs): remove it, and set data.sql_domain_password to "
            "env:NAME (an environment variable) or prefect:BLOCK (a Prefect Secret block)"
        )
    backend, driver = url.get_backend_name(), url.get_driver_name()
    if backend not in SANDBOXED:
        raise InputError(
            f"{what}: no sandbox for {backend} databases here (predicted SQL must run read-only,"
            " time- and row-limited, by the engine's own means): use PostgreSQL"
            " (postgresql+psycopg://user@host/db) or a sqlite file"
        )
    if "+" in url.drivername and driver != SANDBOXED[backend]:
        raise InputError(f"{what}: use the {SANDBOXED[backend]} driver ({backend}+psycopg://)")
    return url.set(drivername=f"{backend}+{SANDBOXED[backend]}")


def shown(url: Any) -> str:
    """The URL as messages and records show it (never with a password)."""
    return url.render_as_string(hide_password=True)


def password(source: str) -> str | None:
    """The password `data.sql_domain_password` names: None for '' (the driver finds its own:
    PGPASSWORD, ~/.pgpass, a service file, or a login without one)."""
    if not source:
        return None
    kind, _, name = source.partition(":")
    if kind == "env":
        if name not in os.environ:
            raise InputError(f"data.sql_domain_password = {source}: {name} is not set")
        return os.environ[name]
    if kind in PASSWORD_SOURCES:
        return PASSWORD_SOURCES[kind](name)
    raise InputError(
        f"data.sql_domain_password = {source!r}: use env:NAME or prefect:BLOCK"
        + ("" if kind != "prefect" else " (prefect: is read where tasks/ runs)")
    )


@dataclass
class ServerLink:
    """What prepare writes where a sqlite domain's copy goes: which server database, never
    its password."""

    url: str  # without a password
    password: str = ""  # where it comes from: '', env:NAME, prefect:BLOCK
    schema: str = ""  # the namespace to read ('' = the session's current schema)
    views: bool = False
    fingerprint: dict[str, Any] | None = None  # `fingerprint` at prepare

    def write(self, path: Path) -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        tmp.replace(path)

    @classmethod
    def read(cls, path: Path) -> ServerLink:
        try:
            return cls(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise InputError(f"{path}: not a server database link ({e})") from None


def _first_word(sql: str) -> str:
    """The statement's first word, after comments and opening parentheses."""
    s = sql
    while True:
        m = _COMMENT.match(s)
        if not m:
            break
        s = s[m.end() :]
    s = s.lstrip(" \t\r\n(")
    m = re.match(r"[A-Za-z_]+", s)
    return m.group(0).lower() if m else ""


class ServerDb:
    """Runs untrusted SQL on a PostgreSQL database (module docstring): read-only session and
    transaction, `time_limit_s` per statement (`statement_timeout`), at most `row_limit`
    rows fetched from a server-side cursor. The same interface as sandbox.py's `ReadOnlyDb`
    (`run`, `schema`, `row_limit`, `close`), so the generator, pruning and scoring use
    either."""

    def __init__(
        self,
        link: ServerLink,
        time_limit_s: float = 2.0,
        row_limit: int = 10_000,
        word_list: bool = True,
    ):
        """`word_list=False`: no refusal by words before the server (the tests' proof that
        the server and the login's privileges refuse on their own)."""
        import sqlalchemy as sa

        self.link, self.time_limit_s, self.row_limit = link, time_limit_s, row_limit
        self.word_list = word_list
        url = parse_url(link.url)
        self.label = shown(url)
        self.dialect = url.get_backend_name()
        secret = password(link.password)
        self._ms = max(1, int(time_limit_s * 1000))
        self.engine = sa.create_engine(
            url.set(password=secret) if secret is not None else url,
            poolclass=sa.pool.NullPool,
            hide_parameters=True,
            connect_args={"connect_timeout": max(2, int(time_limit_s) + 1)},
        )
        sa.event.listen(self.engine, "connect", self._session)
        try:
            self._con = self.engine.raw_connection()
        except sa.exc.DBAPIError as e:
            raise InputError(f"{self.label}: cannot connect ({_message(e.orig)})") from None
        self.pg = self._con.driver_connection  # psycopg's own connection
        self.namespace = link.schema or self._scalar("SELECT current_schema()") or "public"
        self.keywords = frozenset(
            w for (w,) in self._rows("SELECT word FROM pg_get_keywords() WHERE catcode <> 'U'")
        )
        # the functions a query on this role's search path can call (the constraint offers
        # no other: moe/sql/constrain.py)
        visible = "SELECT DISTINCT lower(proname) FROM pg_proc WHERE pg_function_is_visible(oid)"
        self.functions = frozenset(f for (f,) in self._rows(visible))
        self._schema: Schema | None = None

    # ------------------------------------------------------------------ the session

    def _session(self, dbapi_con: Any, _record: Any) -> None:
        """Every connection of the engine (ours, reflection's) starts read-only and bounded:
        a statement that slips past `run` still cannot write, wait on a lock or run long."""
        with dbapi_con.cursor() as c:
            c.execute(
                "SET default_transaction_read_only = on;"
                f" SET statement_timeout = {self._ms}; SET lock_timeout = {self._ms};"
                f" SET idle_in_transaction_session_timeout = {max(10 * self._ms, 60000)};"
                " SET application_name = 'moe-pipeline'"
            )
            if self.link.schema:
                c.execute(
                    "SELECT set_config('search_path', %s, false)", (_quote(self.link.schema),)
                )
        dbapi_con.commit()

    def _rows(self, sql: str) -> list[tuple[Any, ...]]:
        try:
            with self.pg.cursor() as c:
                c.execute(sql)
                return c.fetchall()
        finally:
            self.pg.rollback()

    def _scalar(self, sql: str) -> Any:
        rows = self._rows(sql)
        return rows[0][0] if rows else None

    # ------------------------------------------------------------------ running

    def run(self, sql: str) -> Outcome:
        import psycopg

        text = sql.strip()
        if not text:
            return Outcome(None, "error", "empty statement")
        first = _first_word(text)
        if self.word_list and first not in _QUERY_WORDS:
            return Outcome(
                None, "denied", f"only a query may run, not {first.upper() or repr(text[:20])}"
            )
        call = None
        if self.word_list:  # in the text, and with its comments out (name /* */ (...))
            call = _DENIED_CALL.search(text) or _DENIED_CALL.search(_COMMENTS.sub(" ", text))
        if call:
            return Outcome(None, "denied", f"{call.group(1)}() is not allowed")
        cur = None
        try:
            with self.pg.cursor() as c:  # the transaction's first statements
                c.execute(
                    f"SET TRANSACTION READ ONLY; SET LOCAL statement_timeout = {self._ms};"
                    f" SET LOCAL lock_timeout = {self._ms}"
                )
            # DECLARE ... CURSOR FOR: one query, by the extended protocol (one statement)
            cur = self.pg.cursor(name="moe_sandbox")
            cur.execute(text)
            rows = cur.fetchmany(self.row_limit + 1)
        except psycopg.errors.QueryCanceled:
            return Outcome(None, "timeout", f"over {self.time_limit_s:g} s")
        except psycopg.Error as e:
            return Outcome(None, _status(e), _message(e))
        finally:
            try:
                self.pg.rollback()  # nothing a statement did is kept, whatever it was
                if cur is not None:
                    cur.close()
                # ...nor a session-level advisory lock, which outlives the rollback
                with self.pg.cursor() as c:
                    c.execute("SELECT pg_advisory_unlock_all()")
                self.pg.rollback()
            except psycopg.Error:
                pass  # a lost connection: this statement's error says so, and the next's
        if len(rows) > self.row_limit:
            return Outcome(None, "row_limit", f"over {self.row_limit} rows")
        return Outcome([tuple(_value(v) for v in r) for r in rows])

    # ------------------------------------------------------------------ reading

    def schema(self) -> Schema:
        """The database's schema by reflection (moe/sql/reflect.py), read once."""
        if self._schema is None:
            self._schema = self._reflect(stats=True)
        return self._schema

    def fingerprint(self) -> dict[str, Any]:
        """The schema-and-row-count fingerprint of the database as it is now (no statistics
        read: names, types, keys and counts)."""
        return fingerprint(self._reflect(stats=False))

    def text_values(self, per_column: int, sample_rows: int) -> dict[tuple[str, str], list[str]]:
        """Text values for schema pruning's value index (moe/sql/reflect.py `text_values`)."""
        with self.engine.connect() as conn:
            return text_values(conn, self.schema(), per_column, sample_rows)

    def _reflect(self, stats: bool) -> Schema:
        import sqlalchemy as sa

        try:
            with self.engine.connect() as conn:
                return reflect_schema(
                    conn,
                    self.namespace,
                    self.link.views,
                    stats=stats,
                    keywords=self.keywords,
                    functions=self.functions,
                )
        except sa.exc.DBAPIError as e:
            raise InputError(f"{self.label}: cannot read the schema ({_message(e.orig)})") from None

    def unsafe_privileges(self) -> list[str]:
        """What the login (and the role it acts as, where another) may do beyond reading its
        own session, one phrase each; [] for a role fit to run predicted SQL: no superuser,
        no member of the server-file roles or pg_signal_backend, no CREATE on the database
        or schema, no write to a table, view or foreign table of the schema, no CREATEROLE
        or CREATEDB, and no EXECUTE on pg_terminate_backend or pg_cancel_backend (with it a
        statement ends or cancels the role's other sessions)."""
        ns = _literal(self.namespace)
        roles = ", ".join(f"pg_has_role(r.oid, '{x}', 'MEMBER')" for x in REACHING_ROLES)
        signals = ", ".join(f"'{f}'" for f in SIGNALS)
        rows = self._rows(
            "SELECT r.rolname, r.rolsuper, r.rolcreaterole, r.rolcreatedb, "
            + roles
            + ", has_database_privilege(r.oid, current_database(), 'CREATE')"
            + f", has_schema_privilege(r.oid, {ns}, 'CREATE')"
            + ", (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            + f" WHERE c.relkind IN {WRITABLE_KINDS} AND n.nspname = {ns}"
            + " AND has_table_privilege(r.oid, c.oid, 'INSERT, UPDATE, DELETE, TRUNCATE'))"
            + ", (SELECT count(*) FROM pg_proc p WHERE p.pronamespace = 'pg_catalog'::regnamespace"
            + f" AND p.proname IN ({signals}) AND has_function_privilege(r.oid, p.oid, 'EXECUTE'))"
            + " FROM pg_roles r WHERE r.rolname IN (session_user, current_user) ORDER BY 1"
        )
        out: list[str] = []
        for name, superuser, createrole, createdb, *rest in rows:
            n = len(REACHING_ROLES)
            member, (db_create, schema_create, tables, signal) = rest[:n], rest[n:]
            held = ["superuser"] * superuser
            held += [f"a member of {x}" for x, m in zip(REACHING_ROLES, member, strict=True) if m]
            held += ["CREATE on the database"] * db_create
            held += [f"CREATE on schema {self.namespace}"] * schema_create
            held += [f"may write {tables} table(s), view(s) or foreign table(s)"] * (tables > 0)
            held += ["CREATEROLE"] * createrole + ["CREATEDB"] * createdb
            if signal and not superuser:
                held += [f"may end its other sessions ({', '.join(SIGNALS)}): {REVOKE_SIGNALS}"]
            out += [f"{name}: {h}" for h in held]
        return out

    def close(self) -> None:
        self._con.close()
        self.engine.dispose()

    def __enter__(self) -> ServerDb:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _value(v: Any) -> Any:
    """A result value as scoring compares them: numbers as int or float (3 and 3.0 agree
    within a tolerance), bytes as bytes."""
    return plain(v) if isinstance(v, (Decimal, memoryview)) else v


def _message(e: Any) -> str:
    """The server's message (its first line)."""
    diag = getattr(e, "diag", None)
    primary = getattr(diag, "message_primary", None) if diag is not None else None
    if primary:
        return str(primary)
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _status(e: Any) -> str:
    """'denied' for what a read-only transaction or the role's privileges refused, else
    'error'."""
    state = getattr(e, "sqlstate", "") or ""
    text = str(e).lower()
    if state in ("25006", "42501") or "data-modifying" in text or "read-only" in text:
        return "denied"
    return "error"
