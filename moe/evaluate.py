"""Evaluation: perplexity on held-out tokens, and SQL execution accuracy by generation."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.data import BatchSampler
from moe.model import MoETransformer
from moe.sql import SqlPair, execution_match, prompt_text, sql_runs


@torch.no_grad()
def perplexity(model: MoETransformer, sampler: BatchSampler, batches: int) -> dict[str, float]:
    """Mean loss over `batches` fixed windows of the validation split, and its exp."""
    model.eval()
    device = model.embed.weight.device
    losses = []
    for i in range(batches):
        x, y, _ = sampler.batch_at(0, i)
        _, loss, _ = model(x.to(device), y.to(device))
        losses.append(float(loss))
    mean = sum(losses) / len(losses)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50))}


@torch.no_grad()
def sql_accuracy(
    model: MoETransformer,
    tok: Any,
    pairs: list[SqlPair],
    db_dir: Path,
    max_new_tokens: int,
    eot_id: int,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Greedy-generate SQL for each pair and score it three ways: valid (it runs on the pair's
    sqlite database), execution match (same result rows as the reference) and exact match
    (whitespace- and case-normalised text). `progress(n)` is told how many pairs are done."""
    model.eval()
    # The response is one line: stop at the end token or at any token that holds a newline.
    stop_ids = {eot_id} | {i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i])}
    exact = executes = valid = 0
    samples = []
    done = 0
    for pair in pairs:
        prompt = tok.encode(prompt_text(pair)).ids
        prompt = prompt[-(model.cfg.seq_len - 1) :]
        out = model.generate(prompt, max_new_tokens, stop_ids=stop_ids)
        predicted = tok.decode(out).split("\n")[0].strip()
        ok_exact = " ".join(predicted.split()).lower() == " ".join(pair.sql.split()).lower()
        ok_valid = sql_runs(db_dir / pair.db, predicted)
        ok_exec = ok_valid and execution_match(db_dir / pair.db, predicted, pair.sql)
        exact += ok_exact
        executes += ok_exec
        valid += ok_valid
        if progress:
            progress(done := done + 1)
        if len(samples) < 5:
            samples.append(
                {
                    "question": pair.question,
                    "gold": pair.sql,
                    "predicted": predicted,
                    "execution_match": ok_exec,
                }
            )
    n = max(len(pairs), 1)
    return {
        "examples": len(pairs),
        "valid_sql": valid / n,
        "execution_accuracy": executes / n,
        "exact_match": exact / n,
        "samples": samples,
    }
