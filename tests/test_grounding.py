"""Literals grounded in the database (moe/sql/grounding.py) and the vote that counts only
grounded candidates (moe/sql/consistency.py `choose(grounded=)`), on a real sqlite file read
through the sandbox, as the evaluation reads it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moe.sql.consistency import choose
from moe.sql.grounding import for_database
from moe.sql.sandbox import ReadOnlyDb
from tests.test_consistency import sandbox


@pytest.fixture
def music(tmp_path: Path) -> Iterator[ReadOnlyDb]:
    db = sandbox(
        tmp_path / "music.sqlite",
        "CREATE TABLE genre (id INTEGER PRIMARY KEY, name TEXT);"
        "CREATE TABLE track (id INTEGER PRIMARY KEY, name TEXT, milliseconds INTEGER,"
        " genre_id INTEGER REFERENCES genre(id));"
        "CREATE TABLE invoice (id INTEGER PRIMARY KEY, billingcity TEXT, billingcountry TEXT);"
        "INSERT INTO genre VALUES (1, 'Rock'), (2, 'Jazz'), (3, 'Heavy Metal');"
        "INSERT INTO track VALUES (1, 'Go Down', 331180, 1), (2, 'Dog Eat Dog', 215196, 1),"
        " (3, 'Iron Man', 412000, 3);"
        "INSERT INTO invoice VALUES (1, 'Paris', 'France'), (2, 'Lyon', 'France'),"
        " (3, 'Oslo', 'Norway');",
    )
    yield db
    db.close()


@pytest.fixture
def grounded(music: ReadOnlyDb) -> Callable[[str], bool]:
    return for_database(music)


@pytest.mark.parametrize(
    ("sql", "held"),
    [
        # a text compared with a column of numbers (Chinook's `genre_id = 'Rock'`)
        ("SELECT count(*) FROM track WHERE genre_id = 'Rock'", False),
        ("SELECT count(*) FROM track WHERE genre_id = '1'", True),  # a number in quotes
        # a value of another column (`billingcountry = 'Paris'`)
        ("SELECT id FROM invoice WHERE billingcountry = 'Paris'", False),
        ("SELECT id FROM invoice WHERE billingcity = 'Paris'", True),
        ("SELECT id FROM invoice WHERE 'paris' = billingcity", True),  # as the index compares
        ("SELECT id FROM invoice WHERE billingcountry IN ('France', 'Paris')", False),
        ("SELECT id FROM invoice WHERE billingcountry != 'Nowhere'", False),
        # aliases resolve to their tables; a miscopied value is not held
        (
            "SELECT T2.name FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Heavy Metal'",
            True,
        ),  # fmt: skip
        (
            "SELECT T2.name FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Heavy Meta'",
            False,
        ),  # fmt: skip
        # a real value whose answer is empty stays grounded (Jazz has no tracks)
        (
            "SELECT T2.name FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Jazz'",
            True,
        ),  # fmt: skip
        # what cannot be resolved or parsed says nothing
        ("SELECT name FROM genre JOIN track ON genre.id = track.genre_id WHERE name = 'x'", True),
        ("SELECT id FROM invoice WHERE nosuch = 'Paris'", True),
        ("SELECT id FROM invoice WHERE billingcity LIKE 'Par%'", True),
        ("SELEC id FROM WHERE = 'Paris'", True),
        # an alias is the table of its own SELECT (Spider reuses T1 inside a subquery)
        (
            "SELECT T1.name FROM genre AS T1 WHERE T1.name = 'Rock' AND T1.id IN"
            " (SELECT T1.genre_id FROM track AS T1)",
            True,
        ),  # fmt: skip
        (
            "SELECT T1.name FROM genre AS T1 WHERE T1.name = 'Rok' AND T1.id IN"
            " (SELECT T1.genre_id FROM track AS T1)",
            False,
        ),  # fmt: skip
        # a value that is no words (a sign, another script) is not judged
        ("SELECT id FROM invoice WHERE billingcity = '東京'", True),
        ("SELECT id FROM invoice WHERE billingcity = 'A+'", True),
    ],
)
def test_a_literal_is_grounded_when_its_column_holds_it(
    grounded: Callable[[str], bool], sql: str, held: bool
) -> None:
    assert grounded(sql) is held


def test_only_grounded_candidates_vote(music: ReadOnlyDb, grounded: Callable[[str], bool]) -> None:
    """Two samples filter the genre's key by its name and agree on a count of 0; the one that
    joins the genre's name is the answer once the ungrounded lose their votes. A real value
    with an empty answer keeps its vote against a larger ungrounded group."""
    cands = [
        ("SELECT count(*) FROM track WHERE genre_id = 'Rock'", -1.0),
        ("SELECT count(*) FROM track WHERE genre_id = 'Rock' LIMIT 1", -1.5),
        (
            "SELECT count(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Rock'",
            -2.0,
        ),  # fmt: skip
    ]
    plain = choose(music, cands)
    assert (plain.sql, plain.agreed) == (cands[0][0], 2)
    held = choose(music, cands, grounded=grounded)
    assert (held.sql, held.agreed, held.ran) == (cands[2][0], 1, 3)
    empty = [
        (
            "SELECT T2.name FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Jaz'",
            -1.0,
        ),  # fmt: skip
        (
            "SELECT T2.name FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
            " WHERE T1.name = 'Jaz' LIMIT 9",
            -1.1,
        ),  # fmt: skip
        ("SELECT name FROM track WHERE genre_id = 2", -3.0),  # Jazz: no tracks, grounded
        ("SELECT name FROM track WHERE genre_id = 1", -2.0),  # Rock's tracks: grounded
    ]
    # the empty group holds two ungrounded queries and one grounded: one vote, as Rock's
    # tracks have; the larger group wins the tie, answered by its grounded query
    got = choose(music, empty, grounded=grounded)
    assert (got.sql, got.agreed) == (empty[2][0], 3)


def test_with_the_question_a_value_must_be_the_one_asked_about(
    grounded: Callable[[str, str], bool],
) -> None:
    """A real value the question does not name (a real genre, the wrong one) is not grounded
    once the question is given; words are compared as the value index compares them."""
    sql = "SELECT count(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id WHERE T1.name = '{}'"
    asked = "How many tracks are in the heavy metal genre?"
    assert grounded(sql.format("Heavy Metal"), asked)
    assert not grounded(sql.format("Rock"), asked)
    assert grounded(sql.format("Rock"), "")  # no question: the database alone
    assert not grounded(sql.format("Metal Heavy"), asked)  # held neither
    # a number compared with a number column needs no question's word
    assert grounded("SELECT name FROM track WHERE milliseconds > '300000'", asked)
