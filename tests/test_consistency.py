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


def _taught(tok, pairs: list, prompts: list[list[int]], eos: int) -> MoETransformer:  # noqa: F811
    """A tiny model taught to answer each prompt with its pair's SQL (a few seconds)."""
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=160, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        tok.get_vocab_size(),
    )
    seqs = []
    for prompt, pair in zip(prompts, pairs, strict=True):
        answer = [*tok.encode(pair.sql + "\n", add_special_tokens=False).ids, eos]  # as SFT
        x = torch.tensor([prompt + answer[:-1]])
        y = torch.tensor([[-100] * (len(prompt) - 1) + answer])
        seqs.append((x, y))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(800):
        loss = sum(model(x, y, logits=False)[1] for x, y in seqs)
        if float(loss.detach()) < 0.02:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_the_evaluation_votes_over_candidates_and_one_candidate_is_greedy(
    tmp_path: Path,
    shop: ReadOnlyDb,
    tok,  # noqa: F811
) -> None:
    """sql_accuracy scores the greedy answer with one candidate (here the taught SQL: both
    right); with 4 it scores the answer the vote picks from the very candidates the sampler
    draws (the same seed, drawn again here and voted by consistency.choose on the database),
    and each row says how many agreed."""
    from moe.sql.evaluate import Candidates, sql_accuracy, stop_ids
    from moe.sql.prompts import prompt_text
    from moe.sql.records import SqlPair

    pairs = [
        SqlPair("What costs more than 4?", "SELECT name FROM item WHERE price > 4", "shop.sqlite",
                "item(id int pk, name text, price int)"),
        SqlPair("How many items?", "SELECT count(*) FROM item", "shop.sqlite",
                "item(id int pk, name text, price int)"),
    ]  # fmt: skip
    eos = tok.token_to_id("[EOS]") or 0
    prompts = [tok.encode(prompt_text(p), add_special_tokens=False).ids for p in pairs]
    model = _taught(tok, pairs, prompts, eos)
    args = (model, tok, pairs, tmp_path, 24, eos)
    rows: list[dict] = []
    greedy = sql_accuracy(*args, test_suite=0, answers=rows)
    assert greedy["decoding"]["method"] == "greedy"
    assert [r["predicted"] for r in rows] == [p.sql for p in pairs]
    assert greedy["execution_accuracy"] == 1.0
    for vote in ("plain", "rows", "grounded"):
        rows = []
        voted = sql_accuracy(
            *args, test_suite=0, candidates=4, temperature=1.5, seed=1, vote=vote, answers=rows
        )
        assert voted["decoding"]["method"] == "execution-guided self-consistency"
        assert voted["decoding"]["candidates"] == 4 and voted["decoding"]["vote"] == VOTES[vote]
        drawn = Candidates(model, tok, 24, stop_ids(tok, eos), 4, 1.5, 1)(prompts, None, None)
        for row, cands in zip(rows, drawn, strict=True):
            assert len(cands) == 4
            if vote == "grounded":  # its rule reads the question: the pick is one that ran
                assert row["predicted"] in [c for c, _ in cands] and row["ran"] >= 1
                continue
            choice = choose(shop, cands, prefer_rows=vote == "rows")
            assert (row["predicted"], row["agreed"], row["ran"]) == (
                choice.sql,
                choice.agreed,
                choice.ran,
            ), (vote, cands)
