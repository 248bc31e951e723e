"""The cell values a question names, in its prompt beside their columns (moe/sql/values.py,
data.sql_question_values; issue 68 item 2): found through the value index, written as the
database writes them, the same text in the prepared pair (training, evaluation) and at `ask`.

The database is a real outside one: Chinook (tests/chinook.py) with four of the embedded
default's schemas added (tests/test_pruning.py `wide_db`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.sql.prompts import prompt_text
from moe.sql.pruning import ValueIndex
from moe.sql.records import load_pairs
from moe.sql.sandbox import ReadOnlyDb, SchemaStyle, serialize_schema
from moe.sql.sets import build_sql_sets
from moe.sql.values import named_values, values_line
from tests.test_pruning import wide_db  # noqa: F401 (a fixture)
from tests.test_sql import _pairs_file, limits, small, tok  # noqa: F401

INDEX = ValueIndex.of_texts(
    {
        ("city", "name"): ["New York", "York", "Paris"],
        ("singer", "country"): ["France", "USA", "France"],
        ("customer", "country"): ["France", "Brazil"],
        ("album", "title"): ["Let There Be Rock", "O'Brien Sings"],
        ("flag", "code"): ["a", "1", "no"],
    }
)


def test_a_question_names_values_by_their_words_and_a_country_by_its_forms() -> None:
    q = "How many French singers live in New York?"
    assert named_values(INDEX, q, 5) == [
        ("city", "name", "New York"),  # the longest first; 'York' is inside it: left out
        ("singer", "country", "France"),  # "singers": the singer's column before the customer's
        ("customer", "country", "France"),
    ]
    assert named_values(INDEX, q, 1) == [("city", "name", "New York")]
    assert named_values(INDEX, q, 0) == []
    # as the database writes it, quoted as SQL quotes it
    assert values_line(INDEX, "Songs of o'brien sings?", 3) == "album.title = 'O''Brien Sings'"
    # stop words and bare numbers name nothing; a question naming no value gets no line
    assert values_line(INDEX, "Is there a code 1 or no code?", 3) == ""
    assert values_line(INDEX, "How many albums are there?", 3) == ""


def test_prepared_pairs_carry_the_values_into_the_prompt(
    tmp_path: Path,
    tok,  # noqa: F811
    wide_db: Path,  # noqa: F811
) -> None:
    test = _pairs_file(
        tmp_path / "test.jsonl",
        [("How many customers live in Canada?", "SELECT count(*) FROM customer WHERE country = 'Canada'"),
         ("How many tracks are there?", "SELECT count(*) FROM track")],
    )  # fmt: skip
    d = dict(sql_domain_database=str(wide_db), sql_domain_test=str(test), sql_domain_train_pairs=40)
    on = build_sql_sets(small(**d, sql_question_values=2), tmp_path / "on", limits(tok))
    off = build_sql_sets(small(**d), tmp_path / "off", limits(tok))
    pairs = load_pairs(tmp_path / "on" / "domain_test.jsonl")
    canada, tracks = pairs[0], pairs[1]
    assert canada.values == "customer.country = 'Canada'; employee.country = 'Canada'"
    assert "\n-- values: customer.country = 'Canada'; employee.country = 'Canada'\n-- question: How many customers live in Canada?\n" in prompt_text(canada)  # fmt: skip
    assert tracks.values == "" and "-- values:" not in prompt_text(tracks)
    assert all(not p.values for p in load_pairs(tmp_path / "off" / "domain_test.jsonl"))
    # the generated training pairs name their values word for word: most get a line
    train = load_pairs(tmp_path / "on" / "domain_train.jsonl")
    assert sum(bool(p.values) for p in train) > len(train) // 4
    for p in train:
        if "'" in p.sql and p.values:
            assert p.values.count(" = '") <= 2
    # the lengths the stages are fitted to count the line
    assert on.longest["domain_test"] > off.longest["domain_test"]


def test_ask_gives_the_model_the_prepared_prompt_with_its_values(
    tmp_path: Path,
    tok,  # noqa: F811
    wide_db: Path,  # noqa: F811
) -> None:
    import torch

    from moe.data.tokenizer import specials
    from moe.hf.model_dir import save_model_dir
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from tasks.publish import ask_prompt

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(seq_len=4096, n_layer=1, d_model=32), MoEConfig(), tok.get_vocab_size()
    )
    save_model_dir(model, tmp_path / "model")
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    test = _pairs_file(
        tmp_path / "test.jsonl",
        [("Which tracks are by AC/DC?", "SELECT T1.name FROM track AS T1 JOIN album AS T2 ON T1.album_id = T2.id JOIN artist AS T3 ON T2.artist_id = T3.id WHERE T3.name = 'AC/DC'")],
    )  # fmt: skip
    d = dict(sql_domain_database=str(wide_db), sql_domain_test=str(test), sql_domain_train_pairs=40)
    build_sql_sets(small(**d, sql_question_values=3), tmp_path / "data", limits(tok))
    pair = load_pairs(tmp_path / "data" / "domain_test.jsonl")[0]
    # "tracks": the track table's column first
    assert pair.values == "track.composer = 'AC/DC'; artist.name = 'AC/DC'"
    sp = specials(tok, tmp_path / "model" / "tokenizer.json")
    want = [*sp.prefix, *tok.encode(sp.chat(prompt_text(pair)), add_special_tokens=False).ids]
    got = ask_prompt(tmp_path / "model", pair.question, wide_db, tmp_path, question_values=3)
    assert got == want
    assert ask_prompt(tmp_path / "model", pair.question, wide_db, tmp_path) != want


@pytest.mark.parametrize("limit", [1, 4])
def test_the_index_reads_values_as_the_database_writes_them(wide_db: Path, limit: int) -> None:  # noqa: F811
    with ReadOnlyDb(wide_db) as ro:
        index = ValueIndex.build(ro, ro.schema())
    got = named_values(index, "Which albums did aerosmith make?", limit)
    assert got[0] == ("artist", "name", "Aerosmith") and len(got) <= limit


def test_a_values_spelling_and_its_columns_do_not_depend_on_the_databases_order() -> None:
    texts = {("genre", "name"): ["Rock", "ROCK", "Line one\nline two", "Jazz"]}
    again = {("genre", "name"): list(reversed(texts[("genre", "name")]))}
    a, b = ValueIndex.of_texts(texts), ValueIndex.of_texts(again)
    assert a.raw == b.raw and a.raw[("genre", "name")]["rock"] == "ROCK"
    assert a.holding("jazz") == [("genre", "name")] and a.holding("blues") == []
    assert values_line(a, "rock or jazz?", 3) == "genre.name = 'Jazz'; genre.name = 'ROCK'"
    assert values_line(a, "line one line two", 3) == ""  # a line of its own stays one line
    # a column read whose values are all too short once compared stays in the index, empty
    assert ValueIndex.of_texts({("g", "grade"): ["A+", "B-"]}).values == {("g", "grade"): []}
    # a pruned schema's tables only
    q = "How many French singers live in New York?"
    assert named_values(INDEX, q, 5, tables={"singer"}) == [("singer", "country", "France")]


def test_a_pruned_example_names_no_value_of_a_table_it_lost(
    tmp_path: Path,
    tok,  # noqa: F811
    wide_db: Path,  # noqa: F811
) -> None:
    test = _pairs_file(
        tmp_path / "test.jsonl",
        [("How many customers live in Canada?", "SELECT count(*) FROM customer WHERE country = 'Canada'")],
    )  # fmt: skip
    d = dict(sql_domain_database=str(wide_db), sql_domain_test=str(test), sql_domain_train_pairs=40)
    with ReadOnlyDb(wide_db) as ro:
        whole = len(tok.encode(serialize_schema(ro.schema(), SchemaStyle())).ids)
    cap = whole * 2 // 3  # the whole schema does not fit: every example is pruned
    build_sql_sets(small(**d, sql_question_values=4), tmp_path / "p", limits(tok, cap, cap, cap))
    pairs = load_pairs(tmp_path / "p" / "domain_test.jsonl")
    pairs += load_pairs(tmp_path / "p" / "domain_train.jsonl")
    named = 0
    for p in pairs:
        assert p.pruned
        shown = {t.split("(")[0] for t in p.schema.split("; ")}
        tables = {v.split(".")[0] for v in p.values.split("; ")} if p.values else set()
        assert tables <= shown, (p.question, p.values, shown)
        named += bool(p.values)
    assert named and pairs[0].values.startswith("customer.country = 'Canada'")


def test_ask_builds_its_prompt_as_the_data_was_prepared(tmp_path: Path) -> None:
    """`moe-pipeline ask` takes the prompt's settings from the prepared data's params.yaml
    (what the model was trained on), not from params changed since."""
    from flows.commands.outputs import _prompt_settings
    from moe.data.config import DataConfig

    now = DataConfig(sql_question_values=0, sql_schema_values=2)
    assert _prompt_settings(now, tmp_path)["sql_question_values"] == 0  # nothing prepared
    (tmp_path / "params.yaml").write_text("data:\n  sql_question_values: 3\n")
    got = _prompt_settings(now, tmp_path)
    assert (got["sql_question_values"], got["sql_schema_values"]) == (3, 2)
