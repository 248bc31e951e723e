"""SQL execution accuracy by generation: each test question answered greedily, the answer run
read-only beside the gold query and scored as Spider (and BIRD) score it."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.errors import InputError
from moe.model.transformer import MoETransformer
from moe.sql.consistency import VOTES, Choice, choose
from moe.sql.constrain import IdentifierConstraint, Names, Pieces
from moe.sql.databases import open_database
from moe.sql.generator import KINDS
from moe.sql.grounding import for_database
from moe.sql.hardness import LEVELS, hardness
from moe.sql.prompts import prompt_text
from moe.sql.records import SqlPair
from moe.sql.sandbox import ReadOnlyDb, normalized_sql, orders, same_result
from moe.sql.schema import Schema
from moe.sql.spelling import in_schema_spelling
from moe.sql.testsuite import build_suite


@torch.no_grad()
def stop_ids(tok: Any, eos: int) -> set[int]:
    """Where an answer ends: the end token, or any token that holds a newline (the SQL
    answer is one line)."""
    return {eos} | {i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i])}


def sql_accuracy(
    model: MoETransformer,
    tok: Any,
    pairs: list[SqlPair],
    db_dir: Path,
    max_new_tokens: int,
    eot_id: int,
    progress: Callable[[int], None] | None = None,
    batch_size: int = 32,
    time_limit_s: float = 2.0,
    row_limit: int = 10_000,
    prefix: list[int] | tuple[int, ...] = (),
    test_suite: int = 0,
    chat: Callable[[str], str] = str,
    candidates: int = 1,
    temperature: float = 0.8,
    seed: int = 0,
    vote: str = "grounded",
    constrain: bool = False,
    constrain_bare: bool = True,
    answers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Greedy-generate SQL for each pair (in batches, with a KV cache) and score it: valid
    (it runs on the pair's database), execution match (the same rows as the reference, as
    Spider's and BIRD's evaluators compare them: moe/sql/sandbox.py `same_result`) and exact match
    (both queries equal after sqlglot normalises them); overall, per kind of query and per
    Spider difficulty level of the gold query.
    Predicted SQL runs on a read-only connection that refuses writes, ATTACH, pragmas and
    extensions, within `time_limit_s` and `row_limit`; what exceeds them counts as wrong
    and is counted (`timeouts`, `row_limits`, `denied`). `progress(n)` hears how many are
    done. `prefix` (the model's bos, when it wants one) goes before every prompt, and `chat`
    renders it in the model's chat template when it has one.

    With `test_suite` > 0, also test-suite accuracy: a prediction that matches must match on
    that many differently filled copies of its database (testsuite.py; gold queries' values).

    With `candidates` > 1, execution-guided self-consistency (moe/sql/consistency.py): the
    greedy answer and `candidates - 1` sampled at `temperature` (seeded by `seed`), each run
    on the pair's database, the answer the most of them agree on; each row says how many
    agreed (`vote`: consistency.py `VOTES`). One candidate is greedy, unchanged.

    With `constrain`, identifiers are held to each question's schema while decoding
    (moe/sql/constrain.py; `constrain_bare`: the bare words too). `answers` gets every row."""
    model.eval()
    stop = stop_ids(tok, eot_id)
    keep = model.cfg.seq_len - max_new_tokens  # room for the prompt beside the answer
    if keep < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room in model.seq_len")
    rows: list[dict[str, Any]] = []
    scorer = _Scorer(pairs, db_dir, time_limit_s, row_limit, test_suite)
    sampler = Candidates(model, tok, max_new_tokens, stop, candidates, temperature, seed)
    pieces = Pieces(tok, bare=constrain_bare) if constrain else None
    try:
        for lo in range(0, len(pairs), batch_size):
            chunk = pairs[lo : lo + batch_size]
            prompts = [
                [*prefix, *tok.encode(chat(prompt_text(p)), add_special_tokens=False).ids]
                for p in chunk
            ]
            _refuse_long_prompts(prompts, chunk, keep)
            names = [scorer.names(p) for p in chunk] if pieces is not None else None
            if candidates > 1:
                rows += _voted(scorer, chunk, sampler(prompts, pieces, names), vote)
            else:
                adjust = IdentifierConstraint(tok, pieces, names) if names else None
                outs = model.generate_batch(prompts, max_new_tokens, stop, adjust=adjust)
                for i, (pair, out) in enumerate(zip(chunk, outs, strict=True)):
                    rows.append(scorer.score(pair, _answer(tok, out, names[i] if names else None)))
            if progress:
                progress(len(rows))
    finally:
        scorer.close()
    if answers is not None:
        answers.extend(rows)
    report = _report(rows, max_new_tokens, test_suite)
    report["decoding"] |= _decoding(rows, candidates, temperature, constrain, vote)
    return report


def _decoding(
    rows: list[dict[str, Any]],
    candidates: int,
    temperature: float,
    constrain: bool,
    vote: str = "grounded",
) -> dict[str, Any]:
    """How the answers were decoded, beyond greedy's own record."""
    out: dict[str, Any] = {}
    if constrain:
        out["identifiers"] = "held to each question's schema"
    if candidates > 1:
        out |= {
            "method": "execution-guided self-consistency",
            "candidates": candidates,
            "sampled": f"{candidates - 1} at temperature {temperature:g}, beside the greedy one",
            "agreement": sum(r["agreed"] for r in rows) / max(1, len(rows)) / candidates,
            "vote": VOTES[vote],
        }
    return out


def _voted(
    scorer: _Scorer, pairs: list[SqlPair], drawn: list[list[tuple[str, float]]], vote: str
) -> list[dict[str, Any]]:
    """Each pair's row for the answer its candidates vote for, with how many agreed and ran,
    and the candidates themselves (a dump can be voted again: bench/revote.py)."""
    rows = []
    for pair, cands in zip(pairs, drawn, strict=True):
        choice = scorer.choose(pair, cands, vote)
        score = scorer.score(pair, choice.sql)
        rows.append({**score, "agreed": choice.agreed, "ran": choice.ran, "candidates": cands})
    return rows


def _answer(tok: Any, out: list[int], names: Names | None = None) -> str:
    """The query of a generated answer: its first line; held to `names`, with the schema's
    spelling of its tables and columns (moe/sql/spelling.py)."""
    sql = tok.decode(out).split("\n")[0].strip()
    return in_schema_spelling(sql, names) if names else sql


class Candidates:
    """Each prompt's candidate queries with the model's log-probability of each: the greedy
    answer, then `n - 1` sampled (one batch for all of a chunk's samples)."""

    def __init__(
        self, model: Any, tok: Any, max_new: int, stop: set[int], n: int, temp: float, seed: int
    ) -> None:
        self.model, self.tok, self.max_new, self.stop = model, tok, max_new, stop
        self.n, self.temp = n, temp
        self.gen = torch.Generator(model.embed.weight.device).manual_seed(seed)

    def __call__(
        self,
        prompts: list[list[int]],
        pieces: Pieces | None = None,
        names: list[Names] | None = None,
    ) -> list[list[tuple[str, float]]]:
        """With `pieces` and `names`, every candidate's identifiers held to its schema."""
        k = self.n - 1
        held, held_k = None, None
        if pieces is not None and names is not None:
            held = IdentifierConstraint(self.tok, pieces, names)
            held_k = IdentifierConstraint(self.tok, pieces, [n for n in names for _ in range(k)])
        greedy_scores: list[float] = []
        greedy = self.model.generate_batch(
            prompts, self.max_new, self.stop, scores=greedy_scores, adjust=held
        )
        scores: list[float] = []
        sampled = self.model.generate_batch(
            [p for p in prompts for _ in range(k)],
            self.max_new,
            self.stop,
            temperature=self.temp,
            generator=self.gen,
            scores=scores,
            adjust=held_k,
        )
        out = []
        for i, (g, s) in enumerate(zip(greedy, greedy_scores, strict=True)):
            rows = range(i * k, (i + 1) * k)
            held_to = names[i] if names is not None and pieces is not None else None
            out.append(
                [(_answer(self.tok, g, held_to), s)]
                + [(_answer(self.tok, sampled[j], held_to), scores[j]) for j in rows]
            )
        return out


class _Scorer:
    """Scores predictions on their databases (opened once each, a file or a server's link)
    and, with `test_suite` > 0, on that many filled copies of each sqlite database, built in
    a temporary folder from the gold queries of `pairs` (a server's database gets none:
    nothing is written to a server)."""

    def __init__(
        self,
        pairs: list[SqlPair],
        db_dir: Path,
        time_limit_s: float,
        row_limit: int,
        test_suite: int,
    ) -> None:
        self.db_dir, self.time_limit_s, self.row_limit = db_dir, time_limit_s, row_limit
        self.dbs: dict[Path, ReadOnlyDb] = {}
        self.schemas: dict[Path, Schema] = {}
        self.grounded: dict[Path, Callable[[str, str], int]] = {}  # grounding.py, per database
        self.tmp = tempfile.TemporaryDirectory(prefix="test-suite-") if test_suite else None
        self.suites: dict[str, list[Path]] = {}
        if self.tmp is not None:
            for name in sorted({p.db for p in pairs if p.db.endswith(".sqlite")}):
                gold = [p.sql for p in pairs if p.db == name]
                self.suites[name] = build_suite(
                    db_dir / name, Path(self.tmp.name), gold, test_suite
                )

    def _open(self, path: Path) -> ReadOnlyDb:
        if path not in self.dbs:
            self.dbs[path] = open_database(path, self.time_limit_s, self.row_limit)
        return self.dbs[path]

    def db(self, pair: SqlPair) -> ReadOnlyDb:
        """The sandbox of the pair's database."""
        return self._open(self.db_dir / pair.db)

    def schema(self, pair: SqlPair) -> Schema:
        """The pair's database's whole schema, each database read once."""
        path = self.db_dir / pair.db
        if path not in self.schemas:
            self.schemas[path] = self._open(path).schema()
        return self.schemas[path]

    def names(self, pair: SqlPair) -> Names:
        """What the pair's (pruned) schema lets an answer name."""
        return Names.of(self.schema(pair), pair.schema)

    def dialect(self, pair: SqlPair) -> str:
        return getattr(self.db(pair), "dialect", "sqlite")

    def choose(self, pair: SqlPair, cands: list[tuple[str, float]], vote: str) -> Choice:
        """The candidates' answer on the pair's database, by `vote` (consistency.py)."""
        db, path = self.db(pair), self.db_dir / pair.db
        if vote == "grounded" and path not in self.grounded:
            self.grounded[path] = for_database(db, self.schema(pair))
        test = self.grounded[path] if vote == "grounded" else None
        asked = f"{pair.question} {pair.evidence or ''}"  # BIRD's evidence names values too
        held = (lambda sql: test(sql, asked)) if test else None
        return choose(db, cands, self.dialect(pair), vote == "rows", held)

    def score(self, pair: SqlPair, predicted: str) -> dict[str, Any]:
        row = _score_one(self._open(self.db_dir / pair.db), pair, predicted)
        if self.tmp is not None and pair.db in self.suites:
            copies = [self._open(c) for c in self.suites[pair.db]]
            row["test_suite_match"] = row["execution_match"] and suite_match(
                copies, pair.sql, predicted
            )
        return row

    def close(self) -> None:
        for db in self.dbs.values():
            db.close()
        if self.tmp is not None:
            self.tmp.cleanup()


def _report(rows: list[dict[str, Any]], max_new_tokens: int, test_suite: int) -> dict[str, Any]:
    """The figures of the scored rows: overall, per kind of query, how they were decoded,
    and samples."""
    return {
        **_score(rows),
        "decoding": {
            "method": "greedy",
            "max_new_tokens": max_new_tokens,
            "stop": "end token or newline",
            "test_suite": test_suite,
        },
        "by_template": {
            t: _score([r for r in rows if r["template"] == t])
            for t in KINDS
            if any(r["template"] == t for r in rows)
        },
        # Spider's difficulty levels of the gold queries, by Spider's rule (moe/sql/hardness.py)
        "by_difficulty": {
            level: _score([r for r in rows if r["difficulty"] == level])
            for level in LEVELS
            if any(r["difficulty"] == level for r in rows)
        },
        # the first five, and the first five it got wrong: what a reader checks first
        "samples": [
            {k: r[k] for k in ("question", "gold", "predicted", "execution_match")}
            for r in rows[:5] + [r for r in rows[5:] if not r["execution_match"]][:5]
        ],
    }


def _refuse_long_prompts(prompts: list[list[int]], chunk: list[SqlPair], keep: int) -> None:
    """Prepare fits every prompt; a later change of lengths must not cut one."""
    too_long = [(len(ids), p) for ids, p in zip(prompts, chunk, strict=True) if len(ids) > keep]
    if too_long:
        n, p = max(too_long, key=lambda t: t[0])
        raise InputError(
            f"{len(too_long)} prompt(s) longer than model.seq_len - evaluate.max_new_tokens"
            f" = {keep} tokens (the longest {n}, {p.origin or p.question!r}): raise"
            " model.seq_len or lower evaluate.max_new_tokens, and prepare again"
        )


def wilson(hits: int, n: int, z: float = 1.96) -> list[float]:
    """The 95% interval of a rate of `hits` in `n` (Wilson's score interval: right near 0
    and 1 and for small n, where the normal approximation is not)."""
    if n == 0:
        return [0.0, 1.0]
    p, z2 = hits / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return [round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4)]


def _score(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of a set of scored rows (`_score_one`), with the 95% interval of the
    execution accuracy over these questions."""
    n = max(len(rs), 1)
    hits = sum(r["execution_match"] for r in rs)
    return {
        "examples": len(rs),
        "valid_sql": sum(r["valid"] for r in rs) / n,
        "execution_accuracy": hits / n,
        "execution_accuracy_ci95": wilson(hits, len(rs)),
        "exact_match": sum(r["exact"] for r in rs) / n,
        **(
            {"test_suite_accuracy": sum(r["test_suite_match"] for r in rs) / n}
            if rs and "test_suite_match" in rs[0]
            else {}
        ),
        **{
            key: sum(r["status"] == status for r in rs)
            for key, status in (
                ("timeouts", "timeout"),
                ("row_limits", "row_limit"),
                ("denied", "denied"),
                ("reference_failures", "reference_failed"),
            )
        },
    }


def suite_match(copies: list[ReadOnlyDb], gold_sql: str, predicted: str) -> bool:
    """Whether `predicted` returns the gold result on every copy where the gold query runs
    (a copy where it does not, e.g. over the time limit, cannot tell them apart)."""
    ordered = orders(gold_sql)
    for db in copies:
        gold = db.run(gold_sql)
        if not gold.ok:
            continue
        got = db.run(predicted)
        if not got.ok or not same_result(got.rows or [], gold.rows or [], ordered=ordered):
            return False
    return True


def _score_one(db: ReadOnlyDb, pair: SqlPair, predicted: str) -> dict[str, Any]:
    gold = db.run(pair.sql)
    got = db.run(predicted)
    dialect = getattr(db, "dialect", "sqlite")  # a server's SQL is parsed in its own dialect
    norm_p, norm_g = normalized_sql(predicted, dialect), normalized_sql(pair.sql, dialect)
    exact = (
        norm_p == norm_g
        if norm_p is not None and norm_g is not None
        else " ".join(predicted.split()).lower() == " ".join(pair.sql.split()).lower()
    )
    return {
        "question": pair.question,
        "gold": pair.sql,
        "predicted": predicted,
        "template": pair.kind,
        "difficulty": hardness(pair.sql, dialect),
        "valid": got.ok,
        # the reference ran at prepare; one that stops here (a slower machine, the time limit)
        # cannot be scored and counts as wrong, counted apart
        "status": got.status if gold.ok else "reference_failed",
        "execution_match": gold.ok
        and got.ok
        and same_result(got.rows or [], gold.rows or [], ordered=orders(pair.sql, dialect)),
        "exact": exact,
    }
