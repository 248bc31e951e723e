"""Execution-guided decoding with self-consistency (moe/sql/consistency.py, issue 55): the
vote over candidates run on a real sqlite database, sampling and the model's own scores in
`generate_batch`, and the evaluation's candidates path."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import torch

from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.sql.consistency import VOTES, choose
from moe.sql.sandbox import ReadOnlyDb
from tests.test_sql import tok  # noqa: F401 (a fixture)


def sandbox(path: Path, script: str) -> ReadOnlyDb:
    """A sqlite file made by `script`, opened read-only as evaluation opens it."""
    con = sqlite3.connect(path)
    con.executescript(script)
    con.commit()
    con.close()
    return ReadOnlyDb(path)


@pytest.fixture
def shop(tmp_path: Path) -> ReadOnlyDb:
    db = sandbox(
        tmp_path / "shop.sqlite",
        "CREATE TABLE item (id INTEGER PRIMARY KEY, name TEXT, price INTEGER);"
        "INSERT INTO item VALUES (1, 'pen', 3), (2, 'ink', 7), (3, 'pad', 5);",
    )
    yield db
    db.close()


def test_the_answer_is_what_most_candidates_that_run_agree_on(shop: ReadOnlyDb) -> None:
    """Candidates that fail or are denied are dropped; equal results (another spelling, the
    same rows) vote together; the largest group wins over the model's favourite."""
    got = choose(
        shop,
        [
            ("SELECT name FROM item WHERE price > 4", -1.0),  # the model's favourite: 2 rows
            ("SELECT name FROM item WHERE price > 6", -2.0),  # ink
            ("SELECT name FROM item WHERE 6 < price", -3.0),  # ink again, written otherwise
            ("SELECT name FROM items WHERE price > 6", -0.5),  # no such table: dropped
            ("DELETE FROM item", -0.1),  # refused by the sandbox: dropped
            ("SELECT name FROM item WHERE price > 6", -2.5),  # the same text again
        ],
    )
    assert (got.sql, got.agreed, got.ran, got.candidates) == (
        "SELECT name FROM item WHERE price > 6",
        3,
        4,
        6,
    )
    assert shop.run("SELECT count(*) FROM item").rows == [(3,)]  # nothing changed


def test_a_tie_goes_to_the_models_best_and_nothing_running_leaves_the_greedy(
    shop: ReadOnlyDb,
) -> None:
    tie = choose(shop, [("SELECT 1", -3.0), ("SELECT 2", -1.0)])
    assert (tie.sql, tie.agreed) == ("SELECT 2", 1)
    none = choose(shop, [("SELECT nope", -1.0), ("SELEC 1", -2.0)])
    assert (none.sql, none.agreed, none.ran) == ("SELECT nope", 0, 0)
    # rows in order count only where both queries order
    ordered = choose(
        shop,
        [
            ("SELECT name FROM item ORDER BY price", -1.0),
            ("SELECT name FROM item ORDER BY price DESC", -2.0),
            ("SELECT name FROM item ORDER BY price DESC", -2.2),
        ],
    )
    assert (ordered.sql, ordered.agreed) == ("SELECT name FROM item ORDER BY price DESC", 2)


def test_with_prefer_rows_a_result_with_rows_outvotes_empty_ones(shop: ReadOnlyDb) -> None:
    """A filter on the wrong column runs and returns nothing; two such candidates outvote the
    one that returns rows, unless results with rows come first (a row of NULLs is empty).
    Nothing but empty results leaves the vote as it was."""
    cands = [
        ("SELECT name FROM item WHERE id = 'ink'", -1.0),  # the wrong column: no rows
        ("SELECT name FROM item WHERE id = 'ink' LIMIT 5", -1.5),  # no rows, agreeing
        ("SELECT max(name) FROM item WHERE id = 'ink'", -1.2),  # one row of NULL: empty too
        ("SELECT name FROM item WHERE name = 'ink'", -2.0),  # the one with rows
    ]
    plain = choose(shop, cands)
    assert (plain.sql, plain.agreed) == ("SELECT name FROM item WHERE id = 'ink'", 2)
    rows = choose(shop, cands, prefer_rows=True)
    assert (rows.sql, rows.agreed, rows.ran) == ("SELECT name FROM item WHERE name = 'ink'", 1, 4)
    empty = choose(
        shop, cands[:2] + [("SELECT name FROM item WHERE price > 99", -0.5)], prefer_rows=True
    )
    assert (empty.sql, empty.agreed) == ("SELECT name FROM item WHERE price > 99", 3)


def _model() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=48, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        64,
    ).eval()


def test_sampling_is_seeded_and_the_scores_are_the_models_log_probabilities() -> None:
    """generate_batch at a temperature draws from its generator (the same seed, the same
    tokens; greedy decoding is untouched), and `scores` holds each row's log-probability of
    what it generated, as a forward pass over prompt and answer computes it."""
    model = _model()
    prompts = [[1, 2, 3, 4], [5, 6]]
    with torch.no_grad():
        greedy = model.generate_batch(prompts, 6)
        scores: list[float] = []
        again = model.generate_batch(prompts, 6, scores=scores)
        a = model.generate_batch(
            prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(3)
        )
        b = model.generate_batch(
            prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(3)
        )
        c = model.generate_batch(
            prompts, 6, temperature=1.0, generator=torch.Generator().manual_seed(4)
        )
    assert again == greedy and a == b and a != c
    for prompt, out, score in zip(prompts, greedy, scores, strict=True):
        seq = torch.tensor([prompt + out])
        with torch.no_grad():
            logp = model(seq)[0][0].float().log_softmax(-1)
        want = sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(out))
        assert abs(score - want) < 1e-4, (score, want)


def test_the_evaluation_votes_over_candidates_and_one_candidate_is_greedy(
    tmp_path: Path,
    shop: ReadOnlyDb,
    tok,  # noqa: F811
) -> None:
    """sql_accuracy with candidates > 1 scores the voted answer and says how many agreed;
    with one candidate its rows are the greedy path's, unchanged."""
    from moe.sql.evaluate import sql_accuracy
    from moe.sql.records import SqlPair

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=160, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        tok.get_vocab_size(),
    ).eval()
    pairs = [
        SqlPair("What costs more than 4?", "SELECT name FROM item WHERE price > 4", "shop.sqlite",
                "item(id int pk, name text, price int)"),
        SqlPair("How many items?", "SELECT count(*) FROM item", "shop.sqlite",
                "item(id int pk, name text, price int)"),
    ]  # fmt: skip
    eos = tok.token_to_id("[EOS]") or 0
    args = (model, tok, pairs, tmp_path, 8, eos)
    greedy = sql_accuracy(*args, test_suite=0)
    one = sql_accuracy(*args, test_suite=0, candidates=1)
    assert one == greedy and greedy["decoding"]["method"] == "greedy"
    voted = sql_accuracy(*args, test_suite=0, candidates=4, temperature=1.0, seed=1)
    assert voted["decoding"]["method"] == "execution-guided self-consistency"
    assert voted["decoding"]["candidates"] == 4 and 0 <= voted["decoding"]["agreement"] <= 1
    assert voted["examples"] == 2
    assert voted["decoding"]["vote"] == VOTES["grounded"]  # the default
    for vote in ("plain", "rows"):
        other = sql_accuracy(*args, test_suite=0, candidates=4, temperature=1.0, seed=1, vote=vote)
        assert other["decoding"]["vote"] == VOTES[vote] and other["examples"] == 2
