"""Identifiers held to the schema while decoding (moe/sql/constrain.py, issue 55 item 2): after
FROM or JOIN only the prompt's tables, after `alias.` only that table's columns, quoted names
as the dialect writes them; and a model with random weights, held so, names only what the
schema has, where the same model unheld names nothing of it."""

from __future__ import annotations

import dataclasses
import re
import sqlite3
from pathlib import Path

import pytest
import torch

from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.sql.constrain import FUNCTIONS, End, IdentifierConstraint, Names, Pieces
from moe.sql.records import SqlPair
from moe.sql.sandbox import ReadOnlyDb, inspect_database
from tests.test_sql import tok  # noqa: F401 (a fixture: a real BPE trained on SQL)


@pytest.fixture
def concerts(tmp_path: Path) -> Path:
    path = tmp_path / "concerts.sqlite"
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, age INTEGER);"
        'CREATE TABLE "order" (id INTEGER PRIMARY KEY, "Home Town" TEXT);'
        "CREATE TABLE stadium (id INTEGER PRIMARY KEY, capacity INTEGER);"
        "INSERT INTO singer VALUES (1, 'Ann', 31), (2, 'Bo', 25);"
        "INSERT INTO stadium VALUES (1, 500);"
    )
    con.commit()
    con.close()
    return path


def _names(path: Path, shown: str = "") -> Names:
    con = sqlite3.connect(path)
    try:
        return Names.of(inspect_database(con), shown)
    finally:
        con.close()


def _texts(tok, ids: set[int]) -> set[str]:  # noqa: F811
    return {tok.decode([i]) for i in ids}


def test_after_from_only_the_schemas_tables_and_after_a_dot_only_that_tables_columns(
    tok,  # noqa: F811
    concerts: Path,
) -> None:
    names = _names(concerts)
    assert names.tables == ["singer", '"order"', "stadium"]  # "order" is a keyword: quoted
    assert names.columns["order"] == ["id", '"Home Town"']
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    after_from = _texts(tok, held.allowed("SELECT name FROM", names)[0])
    # a space, or a space with the start of a table's name, or a subquery's parenthesis
    assert after_from and all(
        t.strip() == "" or any(f.startswith(t.strip().lower()) for f in names.tables + ["("])
        for t in after_from
    )
    assert " singer" in after_from or " s" in after_from
    assert not any(t.strip().startswith("item") for t in after_from)
    partial = _texts(tok, held.allowed("SELECT name FROM sing", names)[0])
    assert partial and all("singer"[4:].startswith(t.lower()) for t in partial)
    # complete: nothing continues it but the end of the name (a space, a comma, the end token)
    assert held.allowed("SELECT name FROM singer", names) == (set(), True)
    aliased = "SELECT T1.name FROM singer AS T1 JOIN stadium AS T2 ON T2."
    cols = _texts(tok, held.allowed(aliased, names)[0])
    assert cols and all(any(c.startswith(t.lower()) for c in ("id", "capacity", "*")) for t in cols)
    # before FROM a qualifier is an alias to come: a column of any table (the old rule: free)
    loose = IdentifierConstraint(tok, Pieces(tok, bare=False), [names])
    assert loose.allowed("SELECT T9.", names) == (set(), False)
    ahead = _texts(tok, held.allowed("SELECT T9.", names)[0])
    assert ahead and all(any(c.startswith(t.lower()) for c in names.columns["singer"] +
                             names.columns["stadium"] + ['"home town"', "*"]) for t in ahead)  # fmt: skip
    assert held.allowed("SELECT * FROM singer WHERE T9.", names) == (set(), False)  # unbound
    assert loose.allowed("SELECT name, age", names) == (set(), False)  # no table position
    # a column, complete, but no dot (sqlite has no age(): no parenthesis either)
    assert held.allowed("SELECT name, age", names) == (set(), End.NO_DOT)
    quoted = _texts(tok, held.allowed('SELECT * FROM "order" AS o WHERE o.', names)[0])
    assert quoted and all('"home town"'.startswith(t.lower()) or "id".startswith(t.lower())
                          or t == "*" for t in quoted)  # fmt: skip


def test_a_pruned_prompt_allows_only_the_tables_it_shows(concerts: Path) -> None:
    names = _names(concerts, "singer(singer_id int pk, name text, age int)")
    assert names.tables == ["singer"] and list(names.columns) == ["singer"]
    pg = _names(concerts, "[postgresql] stadium(id int pk, capacity int)")
    assert pg.tables == ["stadium"]


def test_a_random_model_held_to_the_schema_names_only_its_tables(
    tmp_path: Path,
    concerts: Path,
    tok,  # noqa: F811
) -> None:
    """The same random model, the same prompts: held, every name after FROM is one of the
    schema's tables; unheld it writes none (a random model knows no schema). Scored by
    sql_accuracy with the knob, which says so in its report."""
    from moe.sql.evaluate import sql_accuracy

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=200, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        tok.get_vocab_size(),
    ).eval()
    shown = "singer(singer_id int pk, name text, age int); stadium(id int pk, capacity int)"
    prompt = [tok.encode(f"-- schema: {shown}\n-- question: q\nSELECT name FROM").ids]
    names = [_names(concerts, shown)]
    # the answer's start is in the prompt here: the constraint reads it as written
    held = IdentifierConstraint(tok, Pieces(tok), names, written=["SELECT name FROM"])
    with torch.no_grad():
        free = model.generate_batch(prompt, 12)[0]
        out = model.generate_batch(prompt, 12, adjust=held)[0]
    text = tok.decode(out)
    first = re.match(r"\s*(\w+)(\W|$)", text)  # the whole name, and what ends it
    assert first and first.group(1).lower() in ("singer", "stadium"), text
    assert not re.match(r"\s*(singer|stadium)\b", tok.decode(free), re.IGNORECASE)
    assert held.steps >= 2  # the name was held over more than one token
    pairs = [SqlPair("q", "SELECT name FROM singer", concerts.name, shown)]
    report = sql_accuracy(model, tok, pairs, tmp_path, 8, 0, test_suite=0, constrain=True)
    assert report["decoding"]["identifiers"] == "held to each question's schema"
    off = sql_accuracy(model, tok, pairs, tmp_path, 8, 0, test_suite=0)
    assert "identifiers" not in off["decoding"]
    ReadOnlyDb(concerts).close()


def test_what_is_not_a_table_position_stays_free_and_aliases_bind_per_query_part(
    tok,  # noqa: F811
    concerts: Path,
) -> None:
    """FROM inside a string, inside a quoted name, as a function's argument or in IS
    DISTINCT FROM is no table position; an alias is bound within the query part being
    written (Spider reuses T1 after INTERSECT), through a JOIN whose first table has none;
    a model whose embedding has more rows than its tokenizer (an import's padding) is held
    without a shape error."""
    names = _names(concerts)
    table_rule = IdentifierConstraint(tok, Pieces(tok, bare=False), [names])
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    free = (set(), False)
    for text in (
        "SELECT name FROM singer WHERE name = 'Escape from",
        'SELECT T1."valid from',
        "SELECT EXTRACT(YEAR FROM",
        "SELECT name FROM singer WHERE age IS DISTINCT FROM",
    ):
        assert table_rule.allowed(text, names) == free, text  # no table here
        assert not held.allowed(text, names)[0], text  # nor a word to hold
    assert held.allowed("SELECT name FROM singer WHERE age IN (SELECT age FROM", names)[0]
    text = "SELECT T1.name FROM singer AS T1 INTERSECT SELECT T1.id FROM stadium AS T1 WHERE T1."
    cols = _texts(tok, held.allowed(text, names)[0])
    assert cols and all(any(c.startswith(t.lower()) for c in ("id", "capacity", "*")) for t in cols)
    joined = "SELECT * FROM singer JOIN stadium AS T2 ON T2."
    assert _texts(tok, held.allowed(joined, names)[0]) == cols
    # an alias bound in a closed subquery is not this part's (Spider reuses T1 in one)
    nested = "SELECT T1.name FROM singer AS T1 WHERE T1.age > (SELECT avg(T1.capacity) FROM"
    nested += " stadium AS T1) AND T1."
    assert _texts(tok, held.allowed(nested, names)[0]) == _texts(
        tok, held.allowed("SELECT T1.name FROM singer AS T1 WHERE T1.", names)[0]
    )
    # bound to two tables in one part: ambiguous, free
    both = "SELECT * FROM singer AS T1 JOIN stadium AS T1 WHERE T1."
    assert held.allowed(both, names) == free
    wide = torch.zeros(1, tok.get_vocab_size() + 8)  # 8 rows past the tokenizer's
    prompt = tok.encode("SELECT name FROM singer").ids
    held(wide, [prompt])  # a complete name: it may end here
    assert torch.isinf(wide[0, -8:]).all() and not torch.isinf(wide[0]).all()


def _word_or_literal(t: str, words: set[str]) -> bool:
    """A piece that starts no word (a number, a quote, an operator, spaces), or the start of
    one of `words`."""
    w = t.lstrip(" ").lower()
    return not w or not (w[0].isalpha() or w[0] == "_") or any(x.startswith(w) for x in words)


def test_a_bare_word_after_from_is_a_column_a_table_an_alias_or_sql(
    tok,  # noqa: F811
    concerts: Path,
) -> None:
    """Once the query part has its FROM, a bare word where an operand starts (after WHERE,
    AND, BY, an operator, a parenthesis) is one of the schema's columns or tables, an alias of
    the query or an SQL word; a literal may start there too. Before FROM, inside a string or a
    subquery not yet at its FROM, and with `Pieces(bare=False)`, words stay free."""
    from moe.sql.constrain import ALIASES_TO_COME, SQL_WORDS

    names = _names(concerts)
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    columns = {"singer_id", "name", "age", "id", "capacity", "singer", "stadium", "t1", "n"}
    words = columns | set(SQL_WORDS)
    for text in (
        "SELECT name FROM singer WHERE",
        "SELECT name FROM singer WHERE ",
        "SELECT T1.name FROM singer AS T1 WHERE T1.age > 3 AND",
        "SELECT count(*) AS n FROM singer GROUP BY name ORDER BY",
        "SELECT name FROM singer WHERE age = (",
        "SELECT name FROM singer WHERE age >",
    ):
        got = _texts(tok, held.allowed(text, names)[0])
        assert got and all(_word_or_literal(t, words) for t in got), (text, got)
        assert {" 3", "'"} & got or {"3", "'"} & got, text  # a literal may start here
        starts = {t.strip().lower() for t in got}
        assert any("name".startswith(x) and x for x in starts), (text, starts)
        assert not {"it", "im"} & starts, text  # pieces that start no name here
    # after the select's alias n and the table alias T1: both are names
    # the select's alias qz and the table alias T1 are names after FROM
    after_q = _texts(
        tok, held.allowed("SELECT count(*) AS qz FROM singer AS T1 ORDER BY q", names)[0]
    )
    assert "z" in after_q and "1" in _texts(tok, held.allowed(
        "SELECT count(*) AS qz FROM singer AS T1 ORDER BY T", names)[0])  # fmt: skip
    assert "z" not in _texts(tok, held.allowed("SELECT count(*) FROM singer ORDER BY q", names)[0])
    no_as = "SELECT name, count(*) qz FROM singer GROUP BY name ORDER BY q"  # alias without AS
    assert "z" in _texts(tok, held.allowed(no_as, names)[0])
    # a word being written continues only to a name or SQL word it starts
    partial = _texts(tok, held.allowed("SELECT name FROM singer WHERE na", names)[0])
    assert partial and all("name"[2:].startswith(t.lower()) for t in partial)
    assert held.allowed("SELECT name FROM singer WHERE name", names) == (set(), End.NO_DOT)
    free = (set(), False)
    for text in (
        "SELECT name FROM singer WHERE name = 'a",  # a string
        "SELECT name FROM singer WHERE age > 3 ORDE",  # a keyword after an operand
        'SELECT "na',  # a quoted name
    ):
        assert held.allowed(text, names) == free, text
    # the SELECT list, a subquery's too: the same words, and the aliases FROM will bind
    for text in ("SELECT ", "SELECT name FROM singer WHERE age IN (SELECT ", "SELECT count("):
        got = _texts(tok, held.allowed(text, names)[0])
        assert got and all(_word_or_literal(t, words | set(ALIASES_TO_COME)) for t in got), text
        assert not {"it", "im"} & {t.strip().lower() for t in got}, text
        assert "1" in _texts(tok, held.allowed(text + "T", names)[0]), text  # T1, to come
    assert "1" not in _texts(tok, held.allowed("SELECT name FROM singer WHERE T", names)[0])
    assert not held.allowed("SELECT na", names)[1]  # a name being written, not complete
    assert all("name".startswith("na" + t.lower()) for t in
               _texts(tok, held.allowed("SELECT na", names)[0]))  # fmt: skip

    # after FROM, the columns of the tables the query reads: stadium's capacity only where
    # stadium is read (an open subquery sees the outer tables, a closed one is done)
    def ca(text: str) -> set[str]:
        return _texts(tok, held.allowed(text + " ca", names)[0])

    assert "p" in ca("SELECT * FROM stadium WHERE")
    assert "p" not in ca("SELECT * FROM singer WHERE") and "s" in ca("SELECT * FROM singer WHERE")
    assert "p" in ca("SELECT * FROM singer AS T1 JOIN stadium AS T2 ON T1.singer_id = T2.id AND")
    closed = "SELECT name FROM singer WHERE age > (SELECT avg(capacity) FROM stadium) AND"
    assert "p" not in ca(closed)
    assert "p" in ca("SELECT name FROM stadium WHERE id IN (SELECT singer_id FROM singer WHERE")
    # FROM a, b AS T2 reads both and binds T2; a derived table's columns are its own (free
    # among the schema's); a CTE's name is a name; SELECT * and T1.* stay writable
    comma = "SELECT * FROM singer T1, stadium T2 WHERE"
    assert "p" in ca(comma) and held.allowed(comma + " T2", names) == (held.pieces.dot, End.NONE)
    derived = "SELECT * FROM stadium AS a JOIN (SELECT singer_id, name FROM singer) AS b ON"
    assert "m" in _texts(tok, held.allowed(derived + " a.id = b.singer_id WHERE na", names)[0])
    cte = "WITH qq AS (SELECT name FROM singer) SELECT qq"
    assert held.allowed(cte, names) == (set(), True)
    assert held.allowed("SELECT *", names) == free and held.allowed("SELECT * ", names) == free
    assert "*" in _texts(tok, held.allowed("SELECT T1.", names)[0])
    assert "*" in _texts(tok, held.allowed("SELECT * FROM singer AS T1 WHERE T1.", names)[0])
    # a keyword that may be the start of a longer one (SmolLM2 writes ORDER as OR + DER) is
    # left to go on; a space after it is an operand's start
    after_or = _texts(tok, held.allowed("SELECT name FROM singer GROUP BY name OR", names)[0])
    assert {"D", "DER", "d", "der"} & after_or
    assert any(t.strip() and t[0] == " " and "name".startswith(t.strip()) for t in after_or)
    assert held.allowed("SELECT name FROM singer GROUP BY name ORDER", names) == free
    loose = IdentifierConstraint(tok, Pieces(tok, bare=False), [names])
    assert loose.allowed("SELECT name FROM singer WHERE", names) == free
    assert loose.allowed("SELECT name FROM", names)[0]  # the table rule holds either way


def test_the_table_after_from_has_the_columns_the_select_list_named_before_it(
    tok,  # noqa: F811
    concerts: Path,
) -> None:
    """SQL names the columns before the tables: held, the k-th table of a query part has the
    columns the part wrote with `Tk.` before binding Tk (Spider's convention), and the SELECT
    list's bare columns that no table named so far has; a filter no table passes is left out,
    and with `Pieces(bare=False)` every table stays open."""
    names = _names(concerts)
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    loose = IdentifierConstraint(tok, Pieces(tok, bare=False), [names])
    tables = ("singer", "stadium", '"order"')

    def offered(text: str, rule: IdentifierConstraint = held) -> set[str]:
        # a table's name but its last letter, written after `text`: a token goes on to it
        return {t for t in tables if rule.allowed(f"{text} {t[:-1]}", names)[0]}

    assert offered("SELECT capacity FROM") == {"stadium"}
    assert offered("SELECT capacity FROM", loose) == set(tables)
    assert offered("SELECT count(*) FROM") == set(tables)  # nothing named: any
    assert offered("SELECT age, capacity FROM") == {"singer", "stadium"}  # none has both
    assert offered("SELECT age, capacity FROM singer JOIN") == {"stadium"}  # age is read
    assert offered("SELECT T1.name, T2.capacity FROM") == {"singer"}  # T1: the first table
    assert offered("SELECT T1.name, T2.capacity FROM singer AS T1 JOIN") == {"stadium"}
    assert offered("SELECT T1.name, T2.nothing FROM singer AS T1 JOIN") == set(tables)
    assert offered("SELECT name FROM singer WHERE age IN (SELECT capacity FROM") == {"stadium"}
    assert offered("SELECT EXTRACT(YEAR FROM d), capacity FROM") == {"stadium"}
    assert offered("SELECT count(*) AS age FROM") == set(tables)  # an output's alias
    # a subquery already closed is done: the outer FROM looks at the outer list alone
    assert offered("SELECT (SELECT count(*) FROM singer), capacity FROM") == {"stadium"}
    assert offered("SELECT capacity, (SELECT max(age) FROM singer) FROM") == {"stadium"}
    assert offered("SELECT name FROM singer WHERE name = 'capacity' UNION SELECT age FROM") == {
        "singer"
    }
    # at the first letter already: `s` goes on to stadium, not to singer
    after_s = _texts(tok, held.allowed("SELECT capacity FROM s", names)[0])
    assert after_s and all("tadium".startswith(t.lower()) for t in after_s)


def test_a_complete_word_goes_on_as_what_it_names(tok, concerts: Path) -> None:  # noqa: F811
    """A table or a table's alias goes on to its dot, a function to its parenthesis, a column
    or SQL's word to anything but a dot (SmolLM2 wrote `WHERE Is.x`, `WHERE airports code`,
    `ORDER BY year` on a schema without that column); EXTRACT's units are words only inside
    EXTRACT( ; an operand starts with none of SQL's words that cannot (`is`, `having`)."""
    names = _names(concerts)
    pg = dataclasses.replace(names, functions=FUNCTIONS)  # every function (PostgreSQL's too)
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    dot, paren = held.pieces.dot, held.pieces.paren
    assert dot and paren and not dot & paren
    ids, end = held.allowed("SELECT name FROM singer WHERE singer", names)  # or singer_id
    assert dot <= ids and end == End.NONE and _texts(tok, ids - dot) <= {"_", "_id"}
    assert held.allowed("SELECT name FROM singer AS zz WHERE zz", names) == (dot, End.NONE)
    assert held.allowed("SELECT T1", names) == (dot, End.NONE)  # an alias to come
    assert held.allowed("SELECT count", names) == (paren, End.NONE)
    assert held.allowed("SELECT name FROM singer WHERE not", names) == (set(), End.NO_DOT)
    # an operand starts with no `is` (`WHERE Is not in`); after NOT, IN may come
    assert "s" not in _texts(tok, held.allowed("SELECT name FROM singer WHERE i", names)[0])
    assert held.allowed("SELECT name FROM singer WHERE age NOT betwee", names)[0]
    assert not held.allowed("SELECT name FROM singer WHERE betwee", names)[0]
    assert not held.allowed("SELECT name FROM singer ORDER BY hav", names)[0]
    assert held.allowed("SELECT name FROM singer WHERE age", names)[1] == End.NO_DOT
    assert "e" not in _texts(tok, held.allowed("SELECT name FROM singer WHERE y", names)[0])
    # after FROM a qualifier is a table the query reads (`FROM flights WHERE airports.code`)
    assert held.allowed("SELECT * FROM stadium WHERE stadiu", names)[0]
    assert not held.allowed("SELECT * FROM singer WHERE stadiu", names)[0]
    assert "e" in _texts(tok, held.allowed("SELECT EXTRACT(y", names)[0])
    # a function the database's engine lacks is not offered (sqlite has no `now`, `age(`)
    assert "now" not in names.functions and "julianday" in names.functions
    assert held.allowed("SELECT string_", names) == (set(), End.NONE)
    assert held.allowed("SELECT string_", pg)[0]
    assert held.allowed("SELECT name FROM singer WHERE age", names) == (set(), End.NO_DOT)
    assert held.allowed("SELECT name FROM singer WHERE age", pg)[0] == paren  # PostgreSQL's
    # in the decoder's mask: after a column a dot is gone, a space or a comma is not
    text = "SELECT name FROM singer WHERE age"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text
    logits = torch.zeros(1, tok.get_vocab_size())
    held(logits, [ids])
    assert torch.isinf(logits[0, sorted(dot)]).all()
    assert not torch.isinf(logits[0, tok.encode(" =").ids[0]])
    assert not torch.isinf(logits[0, sorted(paren)]).any()


@pytest.fixture
def music(tmp_path: Path) -> Path:
    """Chinook's shape in small: artist <- album <- track and single, an employee who reports
    to another (a foreign key to its own table), and a note no key names."""
    path = tmp_path / "music.sqlite"
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE artist (id INTEGER PRIMARY KEY, name TEXT);"
        "CREATE TABLE album (id INTEGER PRIMARY KEY, title TEXT,"
        " artist_id INTEGER REFERENCES artist(id));"
        "CREATE TABLE track (id INTEGER PRIMARY KEY, name TEXT, album_id INTEGER"
        " REFERENCES album(id), milliseconds INTEGER);"
        "CREATE TABLE employee (id INTEGER PRIMARY KEY, name TEXT,"
        " reports_to INTEGER REFERENCES employee(id));"
        "CREATE TABLE note (id INTEGER PRIMARY KEY, text TEXT);"
        "CREATE TABLE single (id INTEGER PRIMARY KEY, album_id INTEGER REFERENCES album(id));"
    )
    con.close()
    return path


def test_a_join_follows_the_foreign_keys(tok, music: Path) -> None:  # noqa: F811
    """After JOIN, a table a foreign key links to one read before; in its ON condition a
    column of such a key, and after `T1.col =` the column it pairs with (SmolLM2 joined
    Chinook's album to artist on both ids, invoice to itself on a date). Where no key links
    the tables, and with the bare words free, joins stay as they were."""
    names = _names(music)
    held = IdentifierConstraint(tok, Pieces(tok), [names])
    loose = IdentifierConstraint(tok, Pieces(tok, bare=False), [names])
    tables = ("artist", "album", "track", "employee", "note", "single")

    def offered(text: str, rule: IdentifierConstraint = held) -> set[str]:
        return {t for t in tables if rule.allowed(f"{text} {t[:-1]}", names)[0]}

    def columns(text: str, rule: IdentifierConstraint = held) -> set[str]:
        cols = [c for t in tables for c in names.columns[t]]
        return {c for c in cols if rule.allowed(text + c[:-1], names)[0]}

    # not album itself; note, which no key names, cannot be checked
    assert offered("SELECT * FROM album JOIN") == {"artist", "track", "single", "note"}
    assert offered("SELECT * FROM album AS T1 JOIN", loose) == set(tables)
    assert offered("SELECT * FROM employee AS T1 JOIN") == {"employee", "note"}  # its own key
    assert offered("SELECT * FROM album AS T1 CROSS JOIN") == set(tables)  # no key to follow
    # another child of the same parent (Spider's city and countrylanguage, both of country)
    assert offered("SELECT * FROM track AS T1 JOIN") == {"album", "note", "single"}
    assert offered("SELECT * FROM note AS T1 JOIN") == set(tables)  # no key: free
    # the SELECT list's look-ahead narrows the linked tables to the one with T2's column...
    assert offered("SELECT T2.milliseconds FROM album AS T1 JOIN") == {"track"}
    # ...and where no linked table has it, the keys win: not album joined to itself
    assert offered("SELECT T2.title FROM album AS T1 JOIN") == {"artist", "track", "single", "note"}
    on = "SELECT T1.name FROM artist AS T1 JOIN album AS T2 ON "
    assert columns(on + "T2.") == {"artist_id"}
    assert columns(on + "T1.") == {"id"}
    assert columns(on + "T1.id = T2.") == {"artist_id"}
    assert columns(on + "T2.artist_id = T1.") == {"id"}
    assert columns(on + "T2.", loose) == {"id", "title", "artist_id"}
    three = on + "T1.id = T2.artist_id JOIN track AS T3 ON T3."
    assert columns(three) == {"album_id"}
    assert columns(three + "album_id = T2.") == {"id"}
    # past the condition's first comparison, in WHERE, and between unlinked tables: free
    assert columns(on + "T1.id = T2.artist_id AND T2.") == {"id", "title", "artist_id"}
    assert columns(on + "T1.id = T2.artist_id WHERE T2.") == {"id", "title", "artist_id"}
    assert columns("SELECT * FROM note AS T1 JOIN track AS T2 ON T2.") == set(
        names.columns["track"]
    )
    boss = "SELECT T1.name FROM employee AS T1 JOIN employee AS T2 ON T1."
    assert columns(boss) == {"id", "reports_to"}
    assert columns(boss + "reports_to = T2.") == {"id"}
