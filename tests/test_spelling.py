"""A held query's names as the schema spells them (moe/sql/spelling.py): the case of the
schema's tables and columns, nothing else of the text; on Chinook (a real outside database)
the rewritten queries return what the model's own did; and the answer held decoding returns
is so spelled."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from moe.sql.spelling import in_schema_spelling, spellings
from tests.test_constrain import _names
from tests.test_sql import chinook_db, tok  # noqa: F401 (fixtures: Chinook, a real BPE)


@pytest.fixture
def airports(tmp_path: Path) -> Path:
    """Spider's flight_2 spelling: mixed-case names, one spelled two ways, one quoted."""
    path = tmp_path / "flights.sqlite"
    con = sqlite3.connect(path)
    con.executescript(
        "CREATE TABLE Airports (AirportCode TEXT, AirportName TEXT, City TEXT, MPG REAL);"
        'CREATE TABLE airlines (uid INTEGER, Airline TEXT, city TEXT, "Home Town" TEXT, Count INT);'
        "INSERT INTO Airports VALUES ('AKO', 'Colorado Plains', 'Akron', 1.5);"
        "INSERT INTO airlines VALUES (1, 'United', 'Akron', 'Akron', 3);"
    )
    con.commit()
    con.close()
    return path


def test_names_take_the_schemas_case_and_nothing_else_moves(airports: Path) -> None:
    names = _names(airports)
    got = in_schema_spelling(
        "SELECT AiRpOrTnAME, mpg, CoUnT(*) FROM aIRPORTS AS t1 WHERE t1.CITY = 'aIRPORTS'"
        " AND \"AirportName\" != 'mpg''s' -- airportname\nGROUP BY AIRPORTCODE LIMIT 1e5",
        names,
    )
    assert got == (
        "SELECT AirportName, MPG, CoUnT(*) FROM Airports AS t1 WHERE t1.CITY = 'aIRPORTS'"
        " AND \"AirportName\" != 'mpg''s' -- airportname\nGROUP BY AirportCode LIMIT 1e5"
    )  # `City` and `city` are two tables' spellings: CITY is left as written; `CoUnT(` a call
    assert "city" not in spellings(names) and '"home town"' not in spellings(names)
    assert in_schema_spelling('SELECT "HOME TOWN" FROM AIRLINES', names) == (
        'SELECT "HOME TOWN" FROM airlines'  # a quoted name stays as written
    )
    # a literal cut off where max_new_tokens ended the answer
    cut = "SELECT airline FROM airlines WHERE uid = 'all AIRLINES"
    assert (
        in_schema_spelling(cut, names) == "SELECT Airline FROM airlines WHERE uid = 'all AIRLINES"
    )


def test_on_chinook_the_spelled_queries_return_what_the_written_ones_did(
    chinook_db: Path,  # noqa: F811
) -> None:
    names = _names(chinook_db)
    written = [
        "SELECT CoUnT(*) FROM TrAcK WHERE MiLlIsEcOnDs > 300000",
        "SELECT T1.NaMe FROM ArTiSt AS T1 JOIN AlBuM AS T2 ON T1.Id = T2.ArTiSt_Id"
        " WHERE T2.TiTlE = 'Let There Be Rock'",
        "SELECT CoUnTrY, count(*) FROM CUSTOMER GROUP BY COUNTRY ORDER BY 2 DESC LIMIT 3",
        "SELECT Avg(UNIT_PRICE) FROM Track WHERE Name LIKE 'The%'",
    ]
    con = sqlite3.connect(chinook_db)
    try:
        for sql in written:
            spelled = in_schema_spelling(sql, names)
            assert spelled != sql and spelled.lower() == sql.lower()
            rows = con.execute(sql).fetchall()
            assert rows and con.execute(spelled).fetchall() == rows, sql
            for word in re.findall(r"[A-Za-z_]\w*", re.sub(r"'[^']*'", "", spelled)):
                if word.lower() in spellings(names) and not re.search(rf"{word}\s*\(", spelled):
                    assert word == spellings(names)[word.lower()], (word, spelled)
    finally:
        con.close()


def test_a_held_answer_is_decoded_in_the_schemas_spelling(airports: Path, tok) -> None:  # noqa: F811
    """sql_accuracy's and Candidates' answers (`_answer`): the first line of the decoded
    tokens, spelled as the schema spells its names where they were held to it, and as
    written where they were not."""
    from moe.sql.evaluate import _answer

    out = tok.encode("SELECT aIrPoRtNaMe FROM aIRPORTS WHERE mpg > 1\nSELECT 2").ids
    assert _answer(tok, out, _names(airports)) == ("SELECT AirportName FROM Airports WHERE MPG > 1")
    assert _answer(tok, out) == "SELECT aIrPoRtNaMe FROM aIRPORTS WHERE mpg > 1"
