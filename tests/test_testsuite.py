"""Test-suite accuracy (moe/sql/testsuite.py): differently filled copies of a database that
tell a wrong query from the gold one where the original fill cannot, and Spider's comparison
rules (moe/sql/sandbox.py `same_result`)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from moe.sql.evaluate import suite_match
from moe.sql.sandbox import ReadOnlyDb, same_result
from moe.sql.testsuite import build_suite, literals
from tests.test_sql import chinook_db  # noqa: F401 (a fixture)


@pytest.fixture
def small_db(tmp_path: Path) -> Path:
    """Doctors and their appointments: every cost under 50, no doctor in 'Oslo'."""
    path = tmp_path / "clinic.sqlite"
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE doctor (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT);"
        "CREATE TABLE visit (id INTEGER PRIMARY KEY,"
        " doctor_id INTEGER REFERENCES doctor(id), cost INTEGER);"
    )
    con.executemany(
        "INSERT INTO doctor VALUES (?, ?, ?)",
        [(i, f"Dr {i}", ("Bergen", "Tromso")[i % 2]) for i in range(1, 21)],
    )
    con.executemany(
        "INSERT INTO visit VALUES (?, ?, ?)", [(i, 1 + i % 20, i % 50) for i in range(1, 101)]
    )
    con.commit()
    con.close()
    return path


GOLD = [
    "SELECT name FROM doctor WHERE city = 'Oslo'",
    "SELECT count(*) FROM visit WHERE cost > 100",
]


def test_copies_keep_the_schema_and_keys_and_meet_the_gold_literals(
    tmp_path: Path, small_db: Path
) -> None:
    assert literals(GOLD) == (["Oslo"], [100.0])
    copies = build_suite(small_db, tmp_path / "suite", GOLD, copies=3)
    again = build_suite(small_db, tmp_path / "again", GOLD, copies=3)
    assert [p.read_bytes() for p in copies] == [p.read_bytes() for p in again]  # seeded
    orig = sqlite3.connect(small_db)
    ddl = orig.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall()
    cities, costs, counts = set(), set(), set()
    for path in copies:
        con = sqlite3.connect(path)
        assert con.execute("SELECT sql FROM sqlite_master ORDER BY name").fetchall() == ddl
        # every visit points at a doctor of the same copy; ids unique (primary keys)
        assert con.execute(
            "SELECT count(*) FROM visit WHERE doctor_id NOT IN (SELECT id FROM doctor)"
        ).fetchone() == (0,)
        assert con.execute("SELECT count(*) FROM doctor WHERE name IS NULL").fetchone() == (0,)
        cities |= {r[0] for r in con.execute("SELECT city FROM doctor")}
        costs |= {r[0] for r in con.execute("SELECT cost FROM visit")}
        counts.add(con.execute("SELECT count(*) FROM visit").fetchone()[0])
        con.close()
    assert "Oslo" in cities and {99, 100, 101} & costs and max(costs) > 100
    assert len(counts) > 1  # the copies differ in size too


def test_a_wrong_query_right_by_chance_on_one_fill_fails_the_suite(
    tmp_path: Path, small_db: Path
) -> None:
    copies = [ReadOnlyDb(p) for p in build_suite(small_db, tmp_path / "s", GOLD, copies=3)]
    original = ReadOnlyDb(small_db)
    try:
        gold = GOLD[1]
        wrong = "SELECT count(*) FROM visit WHERE cost > 1000"
        right = "SELECT count(*) FROM visit WHERE 100 < cost"
        # on the original fill both return 0: execution accuracy cannot tell them apart
        assert original.run(wrong).rows == original.run(gold).rows == [(0,)]
        assert not suite_match(copies, gold, wrong)
        assert suite_match(copies, gold, right)
        assert suite_match(copies, GOLD[0], "SELECT name FROM doctor WHERE city LIKE 'Oslo'")
        assert not suite_match(copies, GOLD[0], "SELECT name FROM doctor WHERE city = 'Paris'")
    finally:
        for db in (original, *copies):
            db.close()


def test_the_suite_of_a_real_database(tmp_path: Path, chinook_db: Path) -> None:  # noqa: F811
    gold = "SELECT count(*) FROM customer WHERE country = 'Canada'"
    copies = [ReadOnlyDb(p) for p in build_suite(chinook_db, tmp_path / "c", [gold], copies=2)]
    try:
        for db in copies:
            assert db.run(gold).ok
            assert db.run("SELECT count(*) FROM invoice_line").rows[0][0] <= 400
        assert suite_match(copies, gold, "SELECT count(*) FROM customer WHERE 'Canada' = country")
        assert not suite_match(copies, gold, "SELECT count(*) FROM customer WHERE country = 'USA'")
    finally:
        for db in copies:
            db.close()


def test_columns_in_any_order_rows_as_multisets_or_in_order() -> None:
    gold = [("rock", 3), ("jazz", 1), ("jazz", 1)]
    assert same_result([(3, "rock"), (1, "jazz"), (1, "jazz")], gold, ordered=False)
    assert same_result([(1, "jazz"), (1, "jazz"), (3, "rock")], gold, ordered=False)
    assert not same_result([(1, "jazz"), (1, "jazz"), (3, "rock")], gold, ordered=True)
    assert same_result([(3, "rock"), (1, "jazz"), (1, "jazz")], gold, ordered=True)
    assert not same_result([(3, "rock"), (1, "jazz")], gold, ordered=False)  # a multiset
    assert not same_result([(3, "rock", 1), (1, "jazz", 1), (1, "jazz", 1)], gold, False)
    # a permutation must hold for every row, not column by column
    assert not same_result([("rock", 1), ("jazz", 3), ("jazz", 1)], gold, ordered=False)
    assert same_result([(2.0000000001, 1)], [(1, 2)], ordered=False)  # numbers within 1e-6


def test_the_score_counts_a_match_only_where_the_original_agrees(
    tmp_path: Path, small_db: Path
) -> None:
    """Test-suite accuracy is built from execution accuracy: a prediction right on every
    filled copy but wrong on the original database counts as wrong, and over any set of
    predictions test-suite accuracy never exceeds execution accuracy."""
    from moe.sql.evaluate import _score, _Scorer
    from moe.sql.records import SqlPair

    gold = GOLD[1]
    # right wherever the visit table does not hold exactly 100 rows: every copy, not the original
    tricky = "SELECT count(*) + ((SELECT count(*) FROM visit) = 100) FROM visit WHERE cost > 100"
    pair = SqlPair("visits over 100?", gold, small_db.name, "schema")
    scorer = _Scorer([pair], small_db.parent, 2.0, 10_000, test_suite=3)
    try:
        copies = [scorer._open(c) for c in scorer.suites[small_db.name]]
        assert suite_match(copies, gold, tricky)  # what the test rests on
        rows = [
            scorer.score(pair, p)
            for p in (gold, tricky, "SELECT count(*) FROM visit WHERE cost > 1000", "SELEC")
        ]
    finally:
        scorer.close()
    assert [(r["execution_match"], r["test_suite_match"]) for r in rows] == [
        (True, True),  # the gold itself
        (False, False),  # right on the copies, wrong on the original: wrong
        (True, False),  # right on the original by chance, wrong on a copy
        (False, False),  # does not run
    ]
    score = _score(rows)
    assert score["test_suite_accuracy"] == 0.25 <= score["execution_accuracy"] == 0.5


def test_a_question_whose_answer_is_a_tie_is_not_kept(tmp_path: Path, small_db: Path) -> None:
    """`ORDER BY key LIMIT k` that cuts through rows sharing the key has several right
    answers and one gold (the engine's tie order): the generator's check sees the tie at the
    cut, and none of the generated pairs has one."""
    import random

    from moe.sql.databases import Databases
    from moe.sql.sources import generate_records, tied_at_the_cut

    db = ReadOnlyDb(small_db)
    try:
        # ten doctors in each city: "the city with the fewest doctors" is either
        tie = "SELECT city FROM doctor GROUP BY city ORDER BY COUNT(*) ASC LIMIT 1"
        assert tied_at_the_cut(db, tie)
        # costs 0..49, two visits each: the top 3 cut through the pair at 48; the top 2 are
        # the pair at 49, in an order the engine chooses (an ordered comparison reads it)
        assert tied_at_the_cut(db, "SELECT id FROM visit ORDER BY cost DESC LIMIT 3")
        assert tied_at_the_cut(db, "SELECT id FROM visit ORDER BY cost DESC LIMIT 2")
        assert not tied_at_the_cut(db, "SELECT name FROM doctor ORDER BY id DESC LIMIT 3")
        assert not tied_at_the_cut(db, "SELECT name FROM doctor ORDER BY id DESC LIMIT 1")
        assert not tied_at_the_cut(db, "SELECT count(*) FROM visit")
    finally:
        db.close()
    dbs = Databases(2.0, 10_000)
    try:
        records = generate_records(small_db, dbs, random.Random(0), 200, set())
        check = ReadOnlyDb(small_db)
        assert len(records) > 50
        assert not [r.sql for r in records if tied_at_the_cut(check, r.sql)]
        check.close()
    finally:
        dbs.close()


def test_every_accuracy_comes_with_its_95_percent_interval() -> None:
    """Wilson's interval, as statistics tables give it: 0.217 of 60 (13 right) is
    0.131-0.336 (by hand: centre 0.2337, half-width 0.1025); all right or none stays inside
    [0, 1]; the report carries it."""
    from moe.sql.evaluate import _score, wilson

    assert wilson(13, 60) == [0.1312, 0.3362]
    assert wilson(0, 25)[0] == 0.0 and wilson(0, 25)[1] == pytest.approx(0.1332, abs=1e-4)
    assert wilson(25, 25)[1] == 1.0 and wilson(25, 25)[0] == pytest.approx(0.8668, abs=1e-4)
    rows = [{"execution_match": m, "valid": True, "exact": False, "status": "ok"} for m in
            [True] * 13 + [False] * 47]  # fmt: skip
    assert _score(rows)["execution_accuracy_ci95"] == [0.1312, 0.3362]
