"""Schema pruning (moe/sql/pruning.py): a database whose whole schema does not fit the model
gives each question the tables and columns it names, found by names and by the values the
database holds; a training example keeps its gold tables; what was cut is recorded; a user's
pair that does not fit even pruned is still refused by line.

The database is a real outside one: Chinook (tests/chinook.py) with four of the embedded
default's schemas added, 19 tables in all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.errors import InputError
from moe.sql.prompts import prompt_text
from moe.sql.pruning import Pruner, ValueIndex, gold_tables, rank
from moe.sql.records import load_pairs
from moe.sql.sandbox import ReadOnlyDb, SchemaStyle, serialize_schema
from moe.sql.sets import build_sql_sets
from tests import chinook
from tests.test_sql import HANDWRITTEN, _pairs_file, chinook_db, limits, small, tok  # noqa: F401


@pytest.fixture(scope="module")
def wide_db(tmp_path_factory) -> Path:
    """Chinook plus four themed schemas (singer/concert, ...), copied in by their own DDL."""
    return chinook.build_wide(tmp_path_factory.mktemp("wide") / "wide.sqlite")


def _schema(db: Path):
    with ReadOnlyDb(db) as ro:
        return ro.schema(), ValueIndex.build(ro, ro.schema())


def test_questions_find_their_tables_by_names_and_values(wide_db: Path) -> None:
    schema, index = _schema(wide_db)
    assert len(schema.tables) == 19
    # "Canada" is held by customer.country and by singer.country; the value alone finds both,
    # the word "customers" decides between them.
    hits = index.hits("How many customers live in Canada?")
    assert ("customer", "country") in hits and ("singer", "country") in hits
    r = rank(schema, "How many customers live in Canada?", index)
    assert r.tables[0] == "customer"
    assert r.columns["customer"].index("country") < r.columns["customer"].index("city")
    # a value no name gives: the artist's name, with the album table between it and track
    r = rank(schema, "Which tracks are by AC/DC?", index)
    assert set(r.tables[:3]) == {"track", "artist", "album"}
    # without the value index the artist is not found (the index is what finds it)
    assert "artist" not in rank(schema, "Which tracks are by AC/DC?").tables[:3]
    assert gold_tables(
        "WITH t AS (SELECT * FROM Track) SELECT a.name FROM artist a JOIN album USING (id)", schema
    ) == {"track", "artist", "album"}


def test_prune_keeps_required_tables_then_rank_order_and_cuts_columns_when_it_must(
    wide_db: Path,
    tok,  # noqa: F811 (the fixture imported above)
) -> None:
    schema, index = _schema(wide_db)
    pruner = Pruner(schema, None, index)
    style = SchemaStyle()
    whole = serialize_schema(schema, style)

    def under(n: int):
        return lambda text: len(tok.encode(text).ids) <= n

    n_whole = len(tok.encode(whole).ids)
    half = pruner.prune("How many customers live in Canada?", style, under(n_whole // 2))
    assert half is not None and half.kept_tables[0] != "customer"  # database order
    assert "customer" in half.kept_tables and 1 < len(half.kept_tables) < 19
    assert len(tok.encode(half.text).ids) <= n_whole // 2
    assert half.note.startswith(f"schema pruned to {len(half.kept_tables)} of 19 tables")
    # required tables come first even when the question does not name them
    req = pruner.prune("How many customers live in Canada?", style, under(n_whole // 2), {"genre"})
    assert req is not None and "genre" in req.kept_tables
    # too small for one whole table: the first table keeps its keys and best columns
    track = serialize_schema(schema, style).split("; ")
    one = next(t for t in track if t.startswith("track("))
    cols = pruner.prune(
        "What is the average unit price of tracks?", style, under(len(tok.encode(one).ids) - 5)
    )
    assert cols is not None and cols.kept_tables == ["track"]
    assert cols.text.startswith("track(id int pk") and "unit_price" in cols.text
    assert "column(s) of track" in cols.note
    assert pruner.prune("How many tracks?", style, under(3)) is None  # nothing fits


def test_a_schema_larger_than_the_context_is_pruned_per_example(
    tmp_path: Path,
    tok,  # noqa: F811 (the fixture imported above)
    wide_db: Path,
) -> None:
    # the last pair's question names nothing: only its gold SQL keeps its table in training
    vague = ("And how many of those are there?", "SELECT count(*) FROM concert")
    train = _pairs_file(tmp_path / "mine.jsonl", [*HANDWRITTEN[:5], vague])
    test = _pairs_file(
        tmp_path / "mine_test.jsonl",
        [
            ("Which tracks are by AC/DC?", "SELECT T1.name FROM track AS T1 JOIN album AS T2 ON T1.album_id = T2.id JOIN artist AS T3 ON T2.artist_id = T3.id WHERE T3.name = 'AC/DC'"),
            ("How many customers live in Canada?", "SELECT count(*) FROM customer WHERE country = 'Canada'"),
        ],
    )  # fmt: skip
    d = dict(
        sql_domain_database=str(wide_db),
        sql_domain_pairs=str(train),
        sql_domain_test=str(test),
        sql_domain_train_pairs=60,
    )
    schema, _ = _schema(wide_db)
    whole = len(tok.encode(serialize_schema(schema, SchemaStyle())).ids)
    cap = whole * 2 // 3  # the whole schema does not fit; two thirds of it do
    lim = limits(tok, total=cap, prompt=cap, response=cap)
    # pruning off: the stated rule shortens the whole schema and still refuses the user's pair
    with pytest.raises(InputError, match=r"mine.*\.jsonl, line \d+ on domain\.sqlite: the example"):
        build_sql_sets(small(**d, sql_schema_pruning=False), tmp_path / "off", lim)
    got = build_sql_sets(small(**d), tmp_path / "on", lim)
    train_set = load_pairs(tmp_path / "on" / "domain_train.jsonl")
    test_set = load_pairs(tmp_path / "on" / "domain_test.jsonl")
    assert [p.question for p in test_set][:2] == [
        "Which tracks are by AC/DC?",
        "How many customers live in Canada?",
    ]
    for p in train_set + test_set:  # every example fits its limits, pruned or whole
        n = lim.count([prompt_text(p) + p.sql + "\n"])[0] + 1
        assert n <= cap + 1, (p.question, n)
        if p.pruned:
            assert p.pruned.startswith("schema pruned to") and "left out: tables" in p.pruned
            assert len(tok.encode(p.schema).ids) < whole
    # a training example keeps the tables its gold SQL reads; the user's too
    mine = [p for p in train_set if p.origin != "generated"]
    assert len(mine) == 6 and all(p.pruned for p in mine)
    assert "concert(" in mine[-1].schema
    for p in train_set:
        shown = {t.split("(")[0] for t in p.schema.split("; ")}
        assert gold_tables(p.sql, schema) <= shown, (p.sql, shown)
    # test questions find theirs by their words and values alone
    for p in test_set[:2]:
        shown = {t.split("(")[0] for t in p.schema.split("; ")}
        assert gold_tables(p.sql, schema) <= shown, (p.question, shown)
    summary = got.summary()["schema_pruned"]
    assert summary["domain_train"]["examples"] == len([p for p in train_set if p.pruned])
    assert summary["domain_test"]["gold_tables_kept"] >= 2
    assert any("pruned to what their question needs" in n for n in got.notes)
    # a user's pair that does not fit even pruned is refused by file and line, nothing written
    tiny = limits(tok, total=40, prompt=40, response=40)
    with pytest.raises(InputError, match="line 1 on domain.sqlite: the example does not fit the "
                       "model even with the schema pruned to its tables"):  # fmt: skip
        build_sql_sets(small(**d), tmp_path / "tiny", tiny)
    assert not list((tmp_path / "tiny").glob("*.jsonl"))


def test_ask_prunes_a_schema_that_leaves_the_answer_no_room(
    tmp_path: Path,
    tok,  # noqa: F811 (the fixture imported above)
    wide_db: Path,
) -> None:
    import torch

    from moe.hf.model_dir import save_model_dir
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from tasks.publish import ask

    schema, _ = _schema(wide_db)
    whole = len(tok.encode(serialize_schema(schema, SchemaStyle())).ids)
    torch.manual_seed(0)
    seq_len = whole * 2 // 3  # the whole schema does not fit the model
    model = MoETransformer(
        ModelConfig(seq_len=seq_len, n_layer=1, d_model=32), MoEConfig(), tok.get_vocab_size()
    )
    save_model_dir(model, tmp_path / "model")
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    before = wide_db.read_bytes()
    got = ask(tmp_path / "model", "How many customers live in Canada?", wide_db, tmp_path, 8)
    assert got["pruned"].startswith("schema pruned to") and "left out: tables" in got["pruned"]
    assert got["outcome"].status in ("ok", "error", "denied")  # an untrained model's SQL ran
    with pytest.raises(InputError, match="turn data.sql_schema_pruning on"):
        ask(tmp_path / "model", "How many customers?", wide_db, tmp_path, 8, prune_schema=False)
    assert wide_db.read_bytes() == before


def test_ask_runs_the_model_at_the_evaluate_sections_dtype(
    tmp_path: Path,
    tok,  # noqa: F811
    chinook_db: Path,  # noqa: F811
) -> None:
    """`ask` loads the model as evaluation does (evaluate.device, evaluate.dtype): its answer
    is the one the model decodes with bf16 weights when the section says bfloat16."""
    import torch

    from moe.data.tokenizer import specials
    from moe.hf.model_dir import load_model_dir, save_model_dir
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from moe.sql.evaluate import stop_ids
    from tasks.publish import ask, ask_prompt

    torch.manual_seed(3)
    cfg = ModelConfig(seq_len=2048, n_layer=2, d_model=64, n_head=4, n_kv_head=2)
    model = MoETransformer(cfg, MoEConfig(num_experts=4, top_k=2), tok.get_vocab_size())
    with torch.no_grad():  # weights of a spread that writes tokens (a fresh head writes none)
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    save_model_dir(model, tmp_path / "model")
    tok.save(str(tmp_path / "model" / "tokenizer.json"))
    q = "How many customers live in Brazil?"
    prompt = ask_prompt(tmp_path / "model", q, chinook_db, tmp_path, 24)
    stop = stop_ids(tok, specials(tok, tmp_path / "model" / "tokenizer.json").eos)

    def decoded(dtype: torch.dtype) -> str:
        m = load_model_dir(tmp_path / "model", dtype).eval()
        return tok.decode(m.generate_batch([prompt], 24, stop)[0]).strip()

    bf16, fp32 = decoded(torch.bfloat16), decoded(torch.float32)
    assert bf16 and fp32 and bf16 != fp32  # the seed gives a model whose answer tells the two apart
    got = ask(tmp_path / "model", q, chinook_db, tmp_path, 24, device="cpu", dtype="bfloat16")
    assert got["sql"] == bf16
    assert ask(tmp_path / "model", q, chinook_db, tmp_path, 24, device="cpu")["sql"] == fp32
