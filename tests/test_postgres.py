"""PostgreSQL as the domain database, on a real server (tests/conftest.py `postgres`: the
binaries of the `pgserver` wheel, on 127.0.0.1, password logins): Chinook loaded with
PostgreSQL's types (numeric prices, timestamps) beside a `shop` schema whose names PostgreSQL
folds or reserves ("Customer", "order"), a read-only role `reader`.

What it holds: predicted SQL that writes, escapes the transaction or runs away is refused
or stopped, as the owner (a superuser) and as the reader; the schema is read by reflection
and equals the sqlite file's; a URL with a password, or of an engine without a sandbox, is
refused; prepare generates pairs in PostgreSQL's SQL and runs every pair on the server,
naming a bad one by line with the server's message; pruning reads values from the server;
a changed database is detected by its fingerprint; the whole pipeline (prepare, both
finetunes, evaluate) and `ask` run against the server, and the password appears in no output.
After each, every table's digest is what it was.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from moe.config import ConfigError
from moe.errors import InputError
from moe.sql.constrain import Names
from moe.sql.databases import open_database
from moe.sql.pruners import pruner_for
from moe.sql.records import load_pairs
from moe.sql.sandbox import SchemaStyle, inspect_database, open_checked, serialize_schema
from moe.sql.schema import fingerprint
from moe.sql.server import ServerDb, ServerLink, parse_url, password
from moe.sql.sets import build_sql_sets
from tests.conftest import ROOT, cli_env, merge, pipeline_cli, tiny_params
from tests.test_sql import _pairs_file, chinook_db, limits, small, tok  # noqa: F401

PG_TYPES = {"INTEGER": "integer", "REAL": "numeric(10,2)", "TEXT": "text"}
DATES = {"invoicedate", "birthdate", "hiredate"}  # text in the sqlite file, timestamps here


def _load_chinook(postgres: dict[str, Any], sqlite_path: Path) -> None:
    """The sqlite Chinook's tables, keys and rows, in PostgreSQL's types."""
    import sqlite3

    import psycopg

    src = sqlite3.connect(sqlite_path)
    tables = [r[0] for r in src.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    with psycopg.connect(host=postgres["host"], port=postgres["port"], user="owner",
                         password=postgres["password"], dbname="chinook") as con:  # fmt: skip
        for t in tables:
            info = src.execute(f"PRAGMA table_info({t})").fetchall()
            fks = {r[3]: r[2] for r in src.execute(f"PRAGMA foreign_key_list({t})")}
            cols = [
                f"{name} {'timestamp' if name in DATES else PG_TYPES[typ]}"
                + (" PRIMARY KEY" if pk else "")
                + (f" REFERENCES {fks[name]}(id)" if name in fks else "")
                for _, name, typ, _, _, pk in info
            ]
            con.execute(f"CREATE TABLE {t} ({', '.join(cols)})")
            names = ", ".join(c[1] for c in info)
            with con.cursor().copy(f"COPY {t} ({names}) FROM STDIN") as copy:
                for row in src.execute(f"SELECT {names} FROM {t}"):
                    copy.write_row(row)
        con.execute("""
            CREATE SCHEMA shop;
            CREATE TABLE shop."Customer" ("Id" integer PRIMARY KEY, "Name" text, "Country" text);
            CREATE TABLE shop."order" (id integer PRIMARY KEY,
                "CustomerId" integer REFERENCES shop."Customer"("Id"), status text,
                total numeric(8,2), placed date);
            INSERT INTO shop."Customer" SELECT g, 'Client ' || g,
                (ARRAY['Canada','France','Japan','Peru'])[1 + g % 4] FROM generate_series(1, 40) g;
            INSERT INTO shop."order" SELECT g, 1 + g % 40,
                (ARRAY['open','paid','shipped'])[1 + g % 3], (g % 17) * 3.25,
                date '2024-01-01' + g % 60 FROM generate_series(1, 160) g;
        """)  # fmt: skip
        con.execute(APP_SCHEMA)
        for table, cols, rows in APP_ROWS:
            marks = ", ".join(["%s"] * len(cols))
            names = ", ".join(f'"{c}"' for c in cols)
            with con.cursor() as c:
                c.executemany(f'INSERT INTO app."{table}" ({names}) VALUES ({marks})', rows)
    src.close()


# A schema as real ones are named: tables and columns that PostgreSQL reserves and sqlite
# does not (user, order, offset, analyse, window), mixed case, in a schema of its own.
APP_SCHEMA = """
    CREATE SCHEMA app;
    CREATE TABLE app."user" (id integer PRIMARY KEY, "Name" text, "offset" integer,
        "window" text);
    CREATE TABLE app.analyse (id integer PRIMARY KEY,
        "userId" integer REFERENCES app."user"(id), "order" integer, "Score" integer,
        "window" text);
"""
APP_ROWS = [
    (
        "user",
        ["id", "Name", "offset", "window"],
        [(i, f"User {i}", (i * 7) % 11, ("day", "week", "month")[i % 3]) for i in range(1, 31)],
    ),
    (
        "analyse",
        ["id", "userId", "order", "Score", "window"],
        [(i, 1 + i % 30, i % 5, (i * 13) % 97, ("day", "week")[i % 2]) for i in range(1, 121)],
    ),
]


def _app_twin(path: Path) -> Path:
    """The `app` schema's tables and rows as a sqlite file (sqlite reserves none of the
    names)."""
    import sqlite3

    con = sqlite3.connect(path)
    con.executescript(
        'CREATE TABLE "user" (id INTEGER PRIMARY KEY, "Name" TEXT, "offset" INTEGER,'
        ' "window" TEXT);'
        ' CREATE TABLE analyse (id INTEGER PRIMARY KEY, "userId" INTEGER REFERENCES'
        ' "user"(id), "order" INTEGER, "Score" INTEGER, "window" TEXT);'
    )
    for table, cols, rows in APP_ROWS:
        names = ", ".join(f'"{c}"' for c in cols)
        marks = ", ".join("?" * len(cols))
        con.executemany(f'INSERT INTO "{table}" ({names}) VALUES ({marks})', rows)
    con.commit()
    con.close()
    return path


@pytest.fixture(scope="module")
def pg(postgres: dict[str, Any], chinook_db: Path) -> dict[str, Any]:  # noqa: F811
    """Chinook (and `shop`) in a database `chinook`, a login role `reader` that may only
    read it; the URLs (no password in them) and the passwords."""
    psql = postgres["psql"]
    psql("CREATE DATABASE chinook")
    _load_chinook(postgres, chinook_db)
    reader_pw = "reader-" + secrets.token_hex(8)
    psql(f"CREATE ROLE reader LOGIN PASSWORD '{reader_pw}'")
    psql("GRANT CONNECT ON DATABASE chinook TO reader")
    psql("GRANT USAGE ON SCHEMA public, shop, app TO reader", "chinook")
    psql("GRANT SELECT ON ALL TABLES IN SCHEMA public, shop, app TO reader", "chinook")
    psql("CREATE TABLE salary (employee_id int, amount int)", "chinook")  # not the reader's
    # granted to PUBLIC by default: with it the reader ends its own other sessions
    psql(
        "REVOKE EXECUTE ON FUNCTION pg_terminate_backend, pg_cancel_backend FROM PUBLIC", "chinook"
    )
    where = f"{postgres['host']}:{postgres['port']}/chinook"
    return {
        "url": f"postgresql+psycopg://reader@{where}",
        "owner_url": f"postgresql+psycopg://owner@{where}",
        "reader_pw": reader_pw,
        "owner_pw": postgres["password"],
        "psql": psql,
        "sqlite": chinook_db,
    }


def digest(pg: dict[str, Any]) -> dict[str, str]:
    """Every table's rows (a hash of all of them, in order) and every role: what must be the
    same after anything the pipeline does."""
    psql = pg["psql"]
    tables = psql(
        "SELECT quote_ident(schemaname) || '.' || quote_ident(tablename) FROM pg_tables"
        " WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1",
        "chinook",
    ).splitlines()
    out = {
        t: psql(
            f"SELECT count(*) || ' ' || md5(coalesce(string_agg(x::text, '|'"
            f" ORDER BY x::text), '')) FROM {t} x",
            "chinook",
        )  # fmt: skip
        for t in tables
    }
    out["roles"] = psql(
        "SELECT string_agg(rolname || rolsuper::text, ',' ORDER BY rolname) FROM pg_roles"
    )
    return out  # fmt: skip


def _db(
    pg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, who: str = "reader", **kw: Any
) -> ServerDb:
    monkeypatch.setenv("PG_TEST_PW", pg["reader_pw"] if who == "reader" else pg["owner_pw"])
    url = pg["url"] if who == "reader" else pg["owner_url"]
    return ServerDb(ServerLink(url, "env:PG_TEST_PW", kw.pop("schema", "")), **kw)  # fmt: skip


# --------------------------------------------------------------------------- the sandbox

HOSTILE = [
    "DROP TABLE track",
    "DELETE FROM track",
    "INSERT INTO genre VALUES (99, 'x')",
    "UPDATE invoice SET total = 0",
    "TRUNCATE invoice_line",
    "CREATE TABLE evil (a int)",
    "COPY track TO PROGRAM 'touch /tmp/moe-pwned'",
    "COPY (SELECT 1) TO '/tmp/moe-pwned'",
    "SET ROLE owner",
    "RESET ROLE",
    "GRANT ALL ON track TO PUBLIC",
    "BEGIN",
    "COMMIT",
    "SELECT 1; DROP TABLE track",
    "SELECT count(*) FROM track; DELETE FROM track",
    "WITH gone AS (DELETE FROM track RETURNING *) SELECT count(*) FROM gone",
    "SELECT * FROM track FOR UPDATE",
    "SELECT set_config('default_transaction_read_only', 'off', false)",
    "SELECT pg_terminate_backend(pg_backend_pid())",
    'SELECT "pg_terminate_backend"(pid) FROM pg_stat_activity',
    'SELECT "pg_advisory_lock"(1)',
    "SELECT pg_catalog.pg_read_file /* the name, a comment, then its arguments */ ('PG_VERSION')",
    "SELECT lo_import('/etc/passwd')",
    "SELECT pg_read_file('/etc/passwd')",
    "  /* a comment */ ALTER TABLE track ADD COLUMN x int",
    "(DELETE FROM track)",
]


@pytest.mark.parametrize("who", ["owner", "reader"])
def test_predicted_sql_cannot_write_escape_or_run_away(
    pg: dict[str, Any], monkeypatch: pytest.MonkeyPatch, who: str
) -> None:
    """Each statement is refused before it runs or by the server, even as a superuser (the
    transaction is read-only whatever the role may do); a runaway query stops at the time
    limit, a huge one at the row limit; the connection works after each."""
    before = digest(pg)
    with _db(pg, monkeypatch, who, time_limit_s=0.5, row_limit=1000) as db:
        for sql in HOSTILE:
            out = db.run(sql)
            assert out.status in ("denied", "error") and out.rows is None, (sql, out)
            assert db.run("SELECT count(*) FROM genre").rows == [(25,)], sql
        assert db.run("SELECT pg_sleep(5)").status == "timeout"
        assert db.run("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n)"
                      " SELECT count(*) FROM n").status == "timeout"  # fmt: skip
        assert db.run("SELECT * FROM track, invoice_line").status == "row_limit"
        assert db.run("SELECT * FROM salary").status == ("denied" if who == "reader" else "ok")
        assert db.run("SHOW transaction_read_only").status == "denied"  # not a query
        assert db.run("SELECT current_setting('transaction_read_only')").rows == [("on",)]
        ok = db.run("SELECT name FROM track WHERE name ILIKE 'stairway%' ORDER BY 1 LIMIT 1")
        assert ok.rows == [("Stairway To Heaven",)]
        # numbers come back as scoring compares them: no Decimal
        assert db.run("SELECT sum(total) FROM invoice").rows == [(2328.6,)]
    assert digest(pg) == before
    assert not Path("/tmp/moe-pwned").exists()


# What the word list refuses first, in forms a word list misses: each must be refused by the
# server itself when the list is off (the login's privileges and the read-only transaction).
PAST_THE_LIST = [
    # set_config on a setting runs, and is undone with the transaction; an advisory lock is
    # taken, and released after the statement (both held below)
    *[sql for sql in HOSTILE if "set_config" not in sql and "advisory" not in sql],
    "SELECT PG_READ_FILE('PG_VERSION')",
    "SeLeCt Pg_Read_File('PG_VERSION')",
    "SELECT pg_catalog.pg_read_file('PG_VERSION')",
    "SELECT \"pg_read_file\"('PG_VERSION')",
    "SELECT /* hi */ pg_read_file -- there\n ('PG_VERSION')",
    "SELECT pg_read_binary_file('PG_VERSION')",
    "SELECT pg_ls_dir('.')",
    "copy track to program 'touch /tmp/moe-pwned'",
    "SELECT lo_import('/etc/hostname')",
    "SELECT lo_export(lo_create(0), '/tmp/moe-pwned')",
    "SELECT set_config('role', 'owner', false)",
    "SELECT set_config('role', 'owner', false), pg_read_file('PG_VERSION')",
    "WITH x AS (UPDATE invoice SET total = 0 RETURNING 1) SELECT count(*) FROM x",
    "WITH x AS (INSERT INTO genre VALUES (99, 'x') RETURNING 1) SELECT * FROM x",
    "SELECT dblink_connect('host=127.0.0.1')",
]


def test_the_server_refuses_what_the_word_list_would_with_the_list_turned_off(
    pg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a login that may only read, with no refusal by words before the server: every
    hostile statement (case, comments, quoted and schema-qualified calls, COPY TO PROGRAM,
    large objects, a role change, writes through a CTE) is refused by the server, nothing on
    it changes and no file is written. The same statements as a superuser would read the
    server's files: that is why prepare refuses such a login."""
    before = digest(pg)
    with _db(pg, monkeypatch, time_limit_s=0.5, word_list=False) as db:
        for sql in PAST_THE_LIST:
            out = db.run(sql)
            assert out.status in ("denied", "error") and out.rows is None, (sql, out)
            assert db.run("SELECT count(*) FROM genre").rows == [(25,)], sql
        assert db.run("SELECT set_config('default_transaction_read_only', 'off', false)").ok
        on = "SELECT current_setting('default_transaction_read_only')"
        assert db.run(on).rows == [("on",)]  # rolled back with its transaction
    assert digest(pg) == before
    assert not Path("/tmp/moe-pwned").exists()
    with _db(pg, monkeypatch, "owner", word_list=False) as owner:
        assert owner.run("SeLeCt Pg_Read_File('PG_VERSION')").ok  # the list was its only guard


def test_a_read_only_session_reaches_no_other_session_whatever_the_text(
    pg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the word list off, as the reader: a session-level advisory lock (which outlives
    a rollback) is released after the statement that took it, so another session takes it at
    once; ending or cancelling the reader's other sessions is refused by the server (EXECUTE
    revoked, as the privilege check asks), and the other session goes on; the session runs
    under statement, lock and idle-in-transaction timeouts."""
    with (
        _db(pg, monkeypatch, time_limit_s=0.5, word_list=False) as db,
        _db(pg, monkeypatch, time_limit_s=0.5, word_list=False) as other,
        _db(pg, monkeypatch, "owner", time_limit_s=0.5, word_list=False) as owner,
    ):
        for sql in ('SELECT "pg_advisory_lock"(1)', "SELECT pg_advisory_lock_shared(2)"):
            assert db.run(sql).ok, sql
        free = "SELECT pg_try_advisory_lock(1), pg_try_advisory_lock(2)"
        assert owner.run(free).rows == [(True, True)]
        others = "FROM pg_stat_activity WHERE usename = 'reader' AND pid <> pg_backend_pid()"
        for fn in ("pg_terminate_backend", "pg_cancel_backend"):
            out = db.run(f'SELECT "{fn}"(pid) {others}')
            assert out.status in ("denied", "error") and "permission denied" in out.message, out
        assert other.run("SELECT count(*) FROM genre").rows == [(25,)]
        limits = db.run(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'),"
            " current_setting('idle_in_transaction_session_timeout')"
        ).rows
        assert limits == [("500ms", "500ms", "1min")], limits


def test_prepare_refuses_a_login_that_may_do_more_than_read(
    pg: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's SQL runs as the login: a superuser, a member of a server-file role, or a
    role that may create in the schema is refused before any compute (an InputError: exit 2),
    each privilege named; the read-only `reader` passes."""
    from tasks.config import Config
    from tasks.databases import preflight

    psql, pw = pg["psql"], "x-" + secrets.token_hex(6)
    psql(f"CREATE ROLE filer LOGIN PASSWORD '{pw}' IN ROLE pg_read_server_files")
    psql(f"CREATE ROLE maker LOGIN PASSWORD '{pw}'")
    psql(f"CREATE ROLE signaler LOGIN PASSWORD '{pw}' IN ROLE pg_signal_backend")
    psql(f"CREATE ROLE ender LOGIN PASSWORD '{pw}'")
    psql(f"CREATE ROLE viewer LOGIN PASSWORD '{pw}'")
    psql("GRANT CONNECT ON DATABASE chinook TO filer, maker, signaler, ender, viewer")
    psql("GRANT USAGE, CREATE ON SCHEMA public TO maker", "chinook")
    psql("GRANT USAGE ON SCHEMA public TO viewer", "chinook")
    psql("GRANT EXECUTE ON FUNCTION pg_terminate_backend TO ender", "chinook")
    psql("CREATE VIEW genre_names AS SELECT id, name FROM genre", "chinook")
    psql("GRANT SELECT, INSERT ON genre_names TO viewer", "chinook")  # auto-updatable
    where = pg["url"].split("@", 1)[1]
    try:
        cases = {
            "owner": (pg["owner_pw"], ["owner: superuser"]),
            "filer": (pw, ["filer: a member of pg_read_server_files"]),
            "maker": (pw, ["maker: CREATE on schema public"]),
            "signaler": (pw, ["signaler: a member of pg_signal_backend"]),
            "ender": (pw, ["ender: may end its other sessions", "REVOKE EXECUTE ON FUNCTION"]),
            "viewer": (pw, ["viewer: may write 1 table(s), view(s)"]),
            "reader": (pg["reader_pw"], []),
        }
        for who, (secret, named) in cases.items():
            monkeypatch.setenv("PG_LOGIN_PW", secret)
            d = dataclasses.replace(
                Config().data,
                sql_domain_database=f"postgresql+psycopg://{who}@{where}",
                sql_domain_password="env:PG_LOGIN_PW",
            )
            if not named:
                preflight(d)
                continue
            with pytest.raises(InputError) as e:
                preflight(d)
            for phrase in named:
                assert phrase in str(e.value), (who, str(e.value))
            assert "may only read" in str(e.value) and secret not in str(e.value)
    finally:
        psql("REVOKE ALL ON SCHEMA public FROM maker, viewer", "chinook")
        psql("REVOKE EXECUTE ON FUNCTION pg_terminate_backend FROM ender", "chinook")
        psql("DROP VIEW genre_names", "chinook")
        psql("REVOKE CONNECT ON DATABASE chinook FROM filer, maker, signaler, ender, viewer")
        for role in ("filer", "maker", "signaler", "ender", "viewer"):
            psql(f"DROP ROLE {role}")


def test_the_schema_is_read_from_the_server(pg: dict[str, Any], monkeypatch) -> None:
    """Reflection gives the sqlite file's tables, columns, keys and row counts (the types the
    server declares; not the table the role may not read), the text the model reads starts
    with the dialect, and the fingerprint is the same on every read."""
    with _db(pg, monkeypatch) as db:
        schema = db.schema()
        assert db.fingerprint() == db.fingerprint() == fingerprint(schema)
        assert db.namespace == "public" and {"user", "order", "select"} <= db.keywords
        assert db.unsafe_privileges() == []  # the role docs/your-data.md asks for
    with _db(pg, monkeypatch, "owner") as owner:
        assert "salary" in {t.name for t in owner.schema().tables}
        assert "owner: superuser" in owner.unsafe_privileges()  # prepare refuses it
    con = open_checked(pg["sqlite"])
    lite = inspect_database(con)
    con.close()
    assert {t.name for t in schema.tables} == {t.name for t in lite.tables}
    for t in lite.tables:
        mine = schema.table(t.name)
        assert mine.rows == t.rows and not mine.estimated
        assert [(c.name, c.pk, c.references) for c in mine.columns] == [
            (c.name, c.pk, c.references) for c in t.columns
        ]
    assert schema.table("track").column("unit_price").type == "NUMERIC(10, 2)"
    country = schema.table("customer").column("country")
    assert country.categorical and country.values[:3] == lite.table("customer").column("country").values[:3]  # fmt: skip
    text = serialize_schema(schema, SchemaStyle(values=3))
    assert text.startswith("[postgresql] artist(id int pk, name text); album(")
    assert "invoicedate date" in text and "country text [USA|Canada|" in text
    # the functions the constraint offers are the engine's own: PostgreSQL's, not sqlite's
    assert {"now", "string_agg", "date_trunc", "lower"} <= schema.functions
    assert "julianday" not in schema.functions and "julianday" in lite.functions
    pg_names, lite_names = Names.of(schema), Names.of(lite)
    assert {"now", "coalesce", "extract", "greatest"} <= pg_names.functions  # syntax kept
    assert "julianday" not in pg_names.functions and "group_concat" not in pg_names.functions
    assert {"julianday", "coalesce", "cast"} <= lite_names.functions
    assert not {"now", "string_agg", "extract", "age"} & lite_names.functions


def test_a_url_must_hold_no_password_and_name_an_engine_with_a_sandbox(monkeypatch) -> None:
    from tasks.config import load_config

    with pytest.raises(InputError, match="holds a password"):
        parse_url("postgresql://reader:hunter2@db.example/shop")
    with pytest.raises(InputError, match="no sandbox for mysql"):
        parse_url("mysql+pymysql://reader@db.example/shop")
    with pytest.raises(InputError, match="psycopg driver"):
        parse_url("postgresql+asyncpg://reader@db.example/shop")
    url = parse_url("postgresql://reader@db.example:5433/shop")
    assert url.drivername == "postgresql+psycopg"
    monkeypatch.delenv("NOT_SET_PW", raising=False)
    with pytest.raises(InputError, match="NOT_SET_PW is not set"):
        password("env:NOT_SET_PW")
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "params.yaml", ["data.sql_domain_database=postgresql://u:hunter2@h/db"])
    assert "hunter2" not in str(e.value) and "must not hold a password" in str(e.value)
    with pytest.raises(ConfigError, match="env:NAME or prefect:BLOCK"):
        load_config(ROOT / "params.yaml", ["data.sql_domain_password=hunter2"])


# --------------------------------------------------------------------------- prepare

MINE = [  # PostgreSQL's own SQL: ILIKE, EXTRACT, casts, FETCH FIRST
    ("How many tracks have love in their name?", "SELECT count(*) FROM track WHERE name ILIKE '%love%'"),
    ("How many invoices were made in 2010?", "SELECT count(*) FROM invoice WHERE EXTRACT(YEAR FROM invoicedate) = 2010"),
    ("What is the total of all invoices, rounded?", "SELECT round(sum(total)) FROM invoice"),
    ("Which three customers come first by last name?", "SELECT lastname FROM customer ORDER BY lastname FETCH FIRST 3 ROWS ONLY"),
    ("How many invoices are from the first half of 2009?", "SELECT count(*) FROM invoice WHERE invoicedate::date < DATE '2009-07-01'"),
    ("How many tracks does each genre have?", "SELECT T1.name, count(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id GROUP BY T1.id"),
]  # fmt: skip


def test_prepare_from_a_url_writes_and_checks_pairs_on_the_server(
    pg: dict[str, Any],
    tmp_path: Path,
    tok,  # noqa: F811
    monkeypatch,
) -> None:
    """The domain pairs of a server database: the user's (in PostgreSQL's SQL) and generated
    ones (sqlite's templates rewritten for PostgreSQL), every one run on the server; the
    schema text names the dialect; the prepared data holds a link without a password."""
    before = digest(pg)
    monkeypatch.setenv("CHINOOK_PW", pg["reader_pw"])
    mine = _pairs_file(tmp_path / "mine.jsonl", MINE[:4])
    test = _pairs_file(tmp_path / "mine_test.jsonl", MINE[4:])
    d = small(sql_domain_database=pg["url"], sql_domain_password="env:CHINOOK_PW",
              sql_domain_pairs=str(mine), sql_domain_test=str(test), sql_domain_train_pairs=60)  # fmt: skip
    got = build_sql_sets(d, tmp_path / "out", limits(tok))
    out = tmp_path / "out"
    train, held = load_pairs(out / "domain_train.jsonl"), load_pairs(out / "domain_test.jsonl")
    assert [p.question for p in held] == [q for q, _ in MINE[4:]] and len(train) == 60
    assert {p.db for p in train + held} == {"domain.url"}
    assert all(p.schema.startswith("[postgresql] artist(") for p in train + held)
    generated = [p for p in train if p.origin == "generated"]
    assert len(generated) == 56
    with _db(pg, monkeypatch, "owner") as owner:
        for p in train + held:
            assert owner.run(p.sql).ok, p.sql
    assert any("DESC NULLS LAST" in p.sql for p in generated)  # sqlite's NULL order, kept
    link = json.loads((out / "dbs" / "domain.url").read_text())
    assert link["url"] == pg["url"] and link["password"] == "env:CHINOOK_PW"
    assert link["fingerprint"] == got.domain and got.domain["tables"]["track"] == 3503
    assert got.summary()["domain_database"]["database"] == pg["url"]
    assert not list((out / "dbs").glob("domain.sqlite"))  # nothing copied off the server
    assert not any(pg["reader_pw"] in f.read_text(errors="replace")
                   for f in out.rglob("*") if f.is_file())  # fmt: skip
    # a pair that does not run is named by line with the server's own message
    bad = _pairs_file(tmp_path / "bad.jsonl", [MINE[0], ("Typo?", "SELECT count(*) FROM tracks")])
    with pytest.raises(InputError) as e:
        build_sql_sets(small(sql_domain_database=pg["url"], sql_domain_password="env:CHINOOK_PW",
                             sql_domain_pairs=str(bad)), tmp_path / "bad", limits(tok))  # fmt: skip
    assert f'bad.jsonl, line 2: the SQL does not run on {pg["url"]} (error: relation "tracks" does not exist)' in str(e.value)  # fmt: skip
    assert digest(pg) == before


def test_generated_sql_quotes_what_postgresql_folds_or_reserves(
    pg: dict[str, Any],
    tmp_path: Path,
    tok,  # noqa: F811
    monkeypatch,
) -> None:
    """A schema (namespace) of its own, with a mixed-case table and a table named by a
    keyword: generated pairs quote them and every one runs."""
    monkeypatch.setenv("CHINOOK_PW", pg["reader_pw"])
    d = small(sql_domain_database=pg["url"], sql_domain_password="env:CHINOOK_PW",
              sql_domain_schema="shop", sql_domain_train_pairs=40, sql_domain_test_pairs=10)  # fmt: skip
    got = build_sql_sets(d, tmp_path / "out", limits(tok))
    pairs = got.sets["domain_train"] + got.sets["domain_test"]
    sqls = " ".join(p.sql for p in pairs)
    assert '"Customer"' in sqls and '"order"' in sqls and '"Country"' in sqls
    assert pairs[0].schema.startswith("[postgresql] Customer(Id int pk, Name text, Country text)")
    assert got.domain["schema"] == "shop" and set(got.domain["tables"]) == {"Customer", "order"}
    with _db(pg, monkeypatch, schema="shop") as db:
        assert all(db.run(p.sql).ok for p in pairs)


def test_pairs_over_names_postgresql_reserves_return_what_the_sqlite_twin_returns(
    pg: dict[str, Any],
    tmp_path: Path,
    tok,  # noqa: F811
    monkeypatch,
) -> None:
    """Tables and columns named `user`, `order`, `offset`, `analyse`, `window` and in mixed
    case, in a schema of their own: every generated pair runs on the server and returns the
    rows the same pair returns on a sqlite twin of the data. Unquoted, `SELECT count(*) FROM
    user` runs cleanly on PostgreSQL and counts the current role: one row, the wrong answer."""
    from moe.sql.sandbox import ReadOnlyDb, same_result

    monkeypatch.setenv("CHINOOK_PW", pg["reader_pw"])
    d = small(sql_domain_database=pg["url"], sql_domain_password="env:CHINOOK_PW",
              sql_domain_schema="app", sql_domain_train_pairs=60, sql_domain_test_pairs=20)  # fmt: skip
    got = build_sql_sets(d, tmp_path / "out", limits(tok))
    pairs = got.sets["domain_train"] + got.sets["domain_test"]
    sqls = " ".join(p.sql for p in pairs)
    assert '"user"' in sqls and '"Name"' in sqls and "analyse" in sqls  # what the test rests on
    assert any(w in sqls for w in ('"offset"', '"window"', '"order"', '"Score"', '"userId"'))
    twin = ReadOnlyDb(_app_twin(tmp_path / "app.sqlite"))
    try:
        with _db(pg, monkeypatch, schema="app") as db:
            assert db.run("SELECT count(*) FROM user").rows == [(1,)]  # the trap
            assert db.run('SELECT count(*) FROM "user"').rows == [(30,)]
            for p in pairs:
                on_server, on_twin = db.run(p.sql), twin.run(p.sql)
                assert on_server.ok and on_twin.ok, (p.sql, on_server, on_twin)
                assert same_result(on_server.rows or [], on_twin.rows or [], ordered=False), p.sql
    finally:
        twin.close()


def test_pruning_reads_values_from_the_server_and_keeps_the_dialect(pg, monkeypatch) -> None:
    with _db(pg, monkeypatch) as db:
        schema = db.schema()
        pruner = pruner_for(schema, db)
        cut = pruner.prune(
            "How many customers live in Brazil?", SchemaStyle(), lambda t: len(t) < 400
        )
        assert ("customer", "country") in pruner.index.hits("customers in Brazil")  # fmt: skip
    assert cut is not None and cut.text.startswith("[postgresql] ") and "customer(" in cut.text


def test_a_database_changed_since_prepare_is_detected(
    pg: dict[str, Any], tmp_path: Path, monkeypatch
) -> None:
    """Evaluation meets the database prepare read, or says what changed and updates the
    fingerprint file (a dep of prepare in dvc.yaml: the next `dvc repro` prepares again)."""
    import tasks.databases as databases

    pg["psql"]("CREATE TABLE drift (id int PRIMARY KEY)", "chinook")
    pg["psql"]("INSERT INTO drift VALUES (1), (2)", "chinook")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OWNER_PW", pg["owner_pw"])
    dbs = tmp_path / "data" / "sql" / "dbs"
    dbs.mkdir(parents=True)
    with open_database(pg["owner_url"], password="env:OWNER_PW") as db:
        ServerLink(pg["owner_url"], "env:OWNER_PW", fingerprint=db.fingerprint()).write(
            dbs / "domain.url"
        )
    try:
        same = databases.check_domain_database(tmp_path / "data", 2.0, 100)
        assert same["changed"] == [] and same["fingerprint_now"] == same["fingerprint_prepared"]
        assert not databases.FINGERPRINT_FILE.exists()
        pg["psql"]("INSERT INTO drift VALUES (3)", "chinook")
        monkeypatch.setattr(databases, "_checked", {})
        moved = databases.check_domain_database(tmp_path / "data", 2.0, 100)
        assert moved["changed"] == ["table drift: 2 rows, now 3"]
        written = json.loads(databases.FINGERPRINT_FILE.read_text())
        assert written["sha256"] == moved["fingerprint_now"] != moved["fingerprint_prepared"]
    finally:
        pg["psql"]("DROP TABLE drift", "chinook")


# --------------------------------------------------------------------------- the pipeline


@pytest.mark.slow
def test_the_pipeline_runs_on_postgres_and_ask_answers_from_it(
    pg: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
    prefect_server: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """prepare (Chinook on the server as the domain, its password in a Prefect Secret
    block), publish, pretrain, both finetunes and evaluate on a tiny config; then `ask --db
    URL` runs the SQL the model writes on the server: a model taught the prompt `ask` builds
    answers with the server's rows. The password is in no output, log or record, and every
    table is as it was."""
    import torch

    from moe.hf.model_dir import load_model_dir, save_model_dir
    from tasks.publish import ask_prompt

    before = digest(pg)
    root = tmp_path_factory.mktemp("pgproject")
    params = merge(yaml.safe_load((ROOT / "params.yaml").read_text()), tiny_params())
    params["data"].update(sql_domain_database=pg["url"], sql_domain_password="prefect:chinook-reader",
                          sql_domain_train_pairs=40, sql_domain_test_pairs=8)  # fmt: skip
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "domain_database.json").write_text('{"database": "generated"}\n')
    env = cli_env(prefect_server)
    save = "import os; from prefect.blocks.system import Secret; Secret(value=os.environ['PW']).save('chinook-reader', overwrite=True)"  # fmt: skip
    subprocess.run(["python", "-c", save], env={**env, "PW": pg["reader_pw"]}, check=True, timeout=120)  # fmt: skip
    r = pipeline_cli(["run"], root, env)
    logs = r.stdout + r.stderr
    assert r.returncode == 0, logs[-4000:]
    lineage = json.loads((root / "data/prepared/lineage.json").read_text())
    assert lineage["domain_database"]["database"] == pg["url"]
    assert json.loads((root / "domain_database.json").read_text()) == lineage["domain_database"]
    metrics = json.loads((root / "reports/metrics.json").read_text())
    check = metrics["finetune_domain"]["domain_database"]
    assert (
        check["changed"] == [] and check["fingerprint_now"] == lineage["domain_database"]["sha256"]
    )
    assert metrics["finetune_domain"]["sql"]["examples"] == 4  # evaluated on the server
    # ask: teach the model the prompt ask builds for one training question, then ask it
    pair = min(load_pairs(root / "data/prepared/sql/domain_train.jsonl"), key=lambda p: len(p.sql))
    monkeypatch.setenv("PW_FOR_ASK", pg["reader_pw"])
    ids = ask_prompt(root / "models/finetune_domain", pair.question, pg["url"],
                     root / "data/prepared", params["evaluate"]["max_new_tokens"],
                     password="env:PW_FOR_ASK")  # fmt: skip
    model = load_model_dir(root / "models/finetune_domain", dtype=torch.float32)
    _teach(model, root / "data/prepared/tokenizer.json", ids, pair.sql)
    save_model_dir(model, root / "asked")
    ask = ["ask", "asked", pair.question, "--db", pg["url"]]
    r = pipeline_cli([*ask, "--set", "data.sql_domain_password=env:PW_FOR_ASK"], root,
                     {**env, "PW_FOR_ASK": pg["reader_pw"]})  # fmt: skip
    logs += r.stdout + r.stderr
    assert r.returncode == 0, logs[-3000:]
    with _db(pg, monkeypatch) as db:
        rows = db.run(pair.sql).rows
    printed = [x for x in r.stdout.splitlines() if not x.startswith("-- schema pruned")]
    shown = [" | ".join(str(v) for v in row) for row in rows[:20]]
    more = f", {len(rows) - 20} not shown" if len(rows) > 20 else ""
    assert rows and printed == [pair.sql, *shown, f"-- {len(rows)} row(s){more}"], r.stdout
    leaked = [str(f) for f in root.rglob("*") if f.is_file() and f.stat().st_size < 50_000_000
              and pg["reader_pw"].encode() in f.read_bytes()]  # fmt: skip
    assert not leaked and pg["reader_pw"] not in logs
    assert digest(pg) == before


def _teach(model: Any, tok_path: Path, prompt: list[int], sql: str) -> None:
    """The model taught to answer `prompt` with `sql` (a few seconds: six finetuning steps do
    not make a SQL writer; tests/test_hf_pipeline.py does the same)."""
    import torch

    from moe.data.tokenizer import load_tokenizer, specials
    from moe.sql.evaluate import stop_ids

    tokenizer = load_tokenizer(tok_path)
    sp = specials(tokenizer, tok_path)
    answer = [*tokenizer.encode(sql + "\n", add_special_tokens=False).ids, sp.eos]  # as SFT
    x = torch.tensor([prompt + answer[:-1]])
    y = torch.tensor([[-100] * (len(prompt) - 1) + answer])
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(600):
        _, loss, _ = model(x, y, logits=False)
        if float(loss.detach()) < 0.01:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    wrote = model.generate_batch([prompt], 64, stop_ids(tokenizer, sp.eos))[0]
    assert tokenizer.decode(wrote).strip() == sql, float(loss.detach())
