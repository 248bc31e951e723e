"""Spider's difficulty levels (moe/sql/hardness.py) by Spider's own rule.

Each level below is the one Spider's evaluation script (test-suite-sql-eval's
`Evaluator.eval_hardness`, as nl2sql360 1.1.0 ships it) gives the same query after its own
parser has read it: checked once with that script, not at test time (it needs nltk and a
schema file). bench/scoring_agreement.py --hardness holds every query of Spider's dev split
against it (1,034 of 1,034 agree).
"""

from __future__ import annotations

import pytest

from moe.sql.hardness import Counts, counts, hardness

CASES = [
    # (query, level, (components1, components2, others) as Spider's script counts them)
    ("SELECT count(*) FROM singer", "easy", (0, 0, 0)),
    ("SELECT name, country, age FROM singer ORDER BY age DESC", "medium", (1, 0, 1)),
    (
        "SELECT avg(age), min(age), max(age) FROM singer WHERE country = 'France'",
        "medium",
        (1, 0, 2),
    ),
    ("SELECT song_name FROM singer WHERE age > (SELECT avg(age) FROM singer)", "hard", (1, 1, 0)),
    # NOT counts as an aggregate (Spider's has_agg reads a condition's NOT flag): one is none
    (
        "SELECT name FROM singer WHERE singer_id NOT IN (SELECT singer_id FROM sc)",
        "hard",
        (1, 1, 0),
    ),
    ("SELECT name FROM singer WHERE country = 'France' OR country = 'Spain'", "medium", (2, 0, 1)),
    ("SELECT name FROM singer WHERE name LIKE '%Hey%'", "medium", (2, 0, 0)),
    (
        "SELECT T2.name FROM sc AS T1 JOIN singer AS T2 ON T1.singer_id = T2.singer_id"
        " JOIN concert AS T3 ON T1.concert_id = T3.concert_id WHERE T3.year = 2014",
        "hard",
        (3, 0, 0),
    ),
    # the AND between HAVING conditions counts as an aggregate; their own aggregates do not
    (
        "SELECT country, count(*) FROM singer GROUP BY country"
        " HAVING count(*) > 1 AND avg(age) > 20",
        "medium",
        (1, 0, 2),
    ),
    ("SELECT country FROM singer GROUP BY country HAVING count(*) > 1", "easy", (1, 0, 0)),
    (
        "SELECT country FROM singer WHERE age > 40"
        " INTERSECT SELECT country FROM singer WHERE age < 30",
        "hard",
        (1, 1, 0),
    ),
    # a chain of unions is one nested query of the first
    (
        "SELECT name FROM singer UNION SELECT concert_name FROM concert"
        " UNION SELECT country FROM singer",
        "hard",
        (0, 1, 0),
    ),
    (
        "SELECT T1.name, count(*) FROM singer AS T1 JOIN sc AS T2 ON T1.singer_id = T2.singer_id"
        " GROUP BY T1.singer_id ORDER BY count(*) DESC LIMIT 1",
        "extra",
        (4, 0, 2),
    ),
    ("SELECT name FROM singer ORDER BY age LIMIT 3", "medium", (2, 0, 0)),
    ("SELECT country, age FROM singer GROUP BY country, age", "medium", (1, 0, 2)),
]


@pytest.mark.parametrize(("sql", "level", "spider_counts"), CASES, ids=[c[0][:40] for c in CASES])
def test_levels_are_spiders(sql: str, level: str, spider_counts: tuple[int, int, int]) -> None:
    assert counts(sql) == Counts(*spider_counts)
    assert hardness(sql) == level


def test_the_rule_at_its_edges_and_a_query_that_does_not_parse() -> None:
    assert Counts(1, 0, 0).level == "easy"
    assert Counts(1, 0, 2).level == "medium" and Counts(2, 0, 1).level == "medium"
    assert Counts(2, 0, 2).level == "extra"  # two components and two others: past medium
    assert Counts(2, 0, 3).level == "hard" and Counts(3, 0, 2).level == "hard"
    assert Counts(0, 1, 0).level == "hard" and Counts(0, 2, 0).level == "extra"
    assert Counts(4, 0, 0).level == "extra"
    assert counts("SELEC nothing FROM") is None and hardness("SELEC nothing FROM") == "extra"
    # a server's dialect is read as such (PostgreSQL's ILIKE is no LIKE for the rule)
    assert hardness('SELECT "name" FROM singer WHERE age::int > 3', "postgresql") == "easy"
