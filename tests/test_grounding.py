"""Literals grounded in the database (moe/sql/grounding.py) and the vote that counts only
grounded candidates (moe/sql/consistency.py `choose(grounded=)`), on a real sqlite file read
through the sandbox, as the evaluation reads it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moe.sql.consistency import choose
from moe.sql.grounding import HELD, NAMED, UNHELD, UNNAMED, for_database
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
def grounded(music: ReadOnlyDb) -> Callable[[str, str], int]:
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
    grounded: Callable[[str], int], sql: str, held: bool
) -> None:
    assert grounded(sql) == (HELD if held else UNHELD)


def test_only_grounded_candidates_vote(music: ReadOnlyDb, grounded: Callable[[str], int]) -> None:
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
    grounded: Callable[[str, str], int],
) -> None:
    """A real value the question does not name (a real genre, the wrong one) is UNNAMED once
    the question is given; words are compared as the value index compares them."""
    sql = "SELECT count(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id WHERE T1.name = '{}'"
    asked = "How many tracks are in the heavy metal genre?"
    assert grounded(sql.format("Heavy Metal"), asked) == NAMED
    assert grounded(sql.format("Rock"), asked) == UNNAMED
    assert grounded(sql.format("Rock"), "") == HELD  # no question: the database alone
    assert grounded(sql.format("Metal Heavy"), asked) == UNHELD  # held neither
    # a number compared with a number column needs no question's word
    assert grounded("SELECT name FROM track WHERE milliseconds > '300000'", asked) == HELD


@pytest.mark.parametrize(
    ("value", "question", "named"),
    [
        ("France", "How many French singers are there?", True),  # a demonym
        ("USA", "List the American customers.", True),
        ("United States", "Which customers live in the USA?", True),  # a code
        ("Netherlands", "Show the Dutch players.", True),
        ("Comedy", "How many comedies were released?", True),  # a plural
        ("Country", "Which countries have a lake?", True),
        ("Rock", "Name the rockers.", True),  # the start of the question's word
        ("heavy metal", "Tracks in the Heavy Metal genre", True),  # case
        ("Rock", "How many tracks are in the heavy metal genre?", False),
        ("Paris", "Invoices billed to Lyon", False),
        ("USA", "Tell us every customer.", False),  # "us" is no country here
        ("Germany", "How many French singers are there?", False),
    ],
)
def test_a_question_names_a_value_in_its_forms(value: str, question: str, named: bool) -> None:
    from moe.sql.forms import named_in

    assert named_in(value, question) is named


# The vote's reproductions (issue 68): real questions name values in other forms.
FRENCH = "SELECT count(*) FROM invoice WHERE billingcountry = 'France'"  # 2: right
ALL = "SELECT count(*) FROM invoice"  # 3: names no value, wrong
GERMANY = "SELECT count(*) FROM invoice WHERE billingcountry = 'Norway'"  # held, unnamed


@pytest.mark.parametrize(
    "question",
    ["How many invoices were billed to French customers?", "How many invoices went to Frankreich?"],
)
def test_a_held_value_is_never_outvoted_through_the_questions_words_by_one_naming_none(
    music: ReadOnlyDb, grounded: Callable[[str, str], int], question: str
) -> None:
    """7 candidates filter on 'France' (held; named by "French", or in a form the table does
    not know), 1 names no value: the 7 win, as the plain vote would have it. Before, the
    question's-words rule took the 7 votes and the one unfiltered count won."""
    cands = [(FRENCH, -1.0 - i / 10) for i in range(7)] + [(ALL, -0.5)]
    got = choose(music, cands, grounded=lambda sql: grounded(sql, question))
    assert (got.sql, got.agreed, got.ran) == (FRENCH, 7, 8)


def test_the_question_still_picks_its_own_value_over_another_held_one(
    music: ReadOnlyDb, grounded: Callable[[str, str], int]
) -> None:
    """A real value, but not the one asked about (Norway for "French"), loses its votes to
    the candidate that names the question's value, however many they are; against a
    candidate naming no value alone it keeps them."""
    asked = "How many invoices were billed to French customers?"
    cands = [(GERMANY, -1.0 - i / 10) for i in range(5)] + [(FRENCH, -2.0), (ALL, -0.5)]
    got = choose(music, cands, grounded=lambda sql: grounded(sql, asked))
    assert got.sql == FRENCH
    alone = [(GERMANY, -1.0 - i / 10) for i in range(5)] + [(ALL, -0.5)]
    assert choose(music, alone, grounded=lambda sql: grounded(sql, asked)).sql == GERMANY


def test_votes_tied_the_question_breaks_the_tie(
    music: ReadOnlyDb, grounded: Callable[[str, str], int]
) -> None:
    """One candidate filters on a held genre the question does not name (scored highest),
    one names no value: a tie of one vote each, which the question's words break (the demo's
    "Which department has the most doctors?" against `department = 'oncology'`)."""
    asked = "How many tracks are there?"
    rock = "SELECT count(*) FROM track AS T1 JOIN genre AS T2 ON T1.genre_id = T2.id WHERE T2.name = 'Rock'"
    every = "SELECT count(*) FROM track"
    got = choose(music, [(rock, -1.0), (every, -2.0)], grounded=lambda sql: grounded(sql, asked))
    assert got.sql == every


def test_votes_tied_a_group_that_names_the_value_once_is_as_named_as_one_that_names_it_twice(
    music: ReadOnlyDb, grounded: Callable[[str, str], int]
) -> None:
    """Chinook, seed 1339 (issue 68): two copies of a count of the genre table that name
    'Rock' (wrong) against the join on the genre's name and a filter on its key, which names
    no value (right). Two votes each; both groups name the question's value, so the tie goes
    to the group of the model's best candidate, not to the one naming 'Rock' more often."""
    asked = "How many tracks are in the Rock genre?"
    genres = "SELECT COUNT(*) FROM genre WHERE name = 'Rock'"
    joined = (
        "SELECT COUNT(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id"
        " WHERE T1.name = 'Rock'"
    )
    by_key = "SELECT COUNT(*) FROM track WHERE genre_id = 1"
    cands = [(genres, -1.53), (genres, -1.53), (joined, -1.41), (by_key, -32.08)]
    assert grounded(genres, asked) == grounded(joined, asked) == NAMED
    assert grounded(by_key, asked) == HELD
    got = choose(music, cands, grounded=lambda sql: grounded(sql, asked))
    assert (got.sql, got.agreed, got.ran) == (joined, 2, 4)


def test_votes_tied_a_group_naming_the_value_wins_over_one_naming_none(
    music: ReadOnlyDb, grounded: Callable[[str, str], int]
) -> None:
    """One candidate filters on 'France' (named by "French"), one counts every invoice,
    naming no value, and the model scored it higher: a vote each, and the question's value
    breaks the tie against the model's preference."""
    asked = "How many invoices were billed to French customers?"
    got = choose(music, [(FRENCH, -2.0), (ALL, -1.0)], grounded=lambda sql: grounded(sql, asked))
    assert (got.sql, got.agreed) == (FRENCH, 1)
