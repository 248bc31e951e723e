"""Evaluation: perplexity on held-out tokens, and SQL execution accuracy by generation."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.data import BatchSampler
from moe.model import MoETransformer
from moe.sql import TEMPLATES, SqlPair, execution_match, prompt_text, sql_runs, template_of


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
    batch_size: int = 32,
) -> dict[str, Any]:
    """Greedy-generate SQL for each pair (in batches, with a KV cache) and score it three
    ways: valid (it runs on the pair's sqlite database), execution match (same result rows as
    the reference) and exact match (whitespace- and case-normalised text); overall and per
    template (filters, ordering, joins, aggregates). `progress(n)` hears how many are done."""
    model.eval()
    # The response is one line: stop at the end token or at any token that holds a newline.
    stop_ids = {eot_id} | {i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i])}
    keep = model.cfg.seq_len - max_new_tokens  # the prompt's last tokens that fit beside it
    if keep < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} leaves no room in model.seq_len")
    rows: list[dict[str, Any]] = []
    for lo in range(0, len(pairs), batch_size):
        chunk = pairs[lo : lo + batch_size]
        prompts = [tok.encode(prompt_text(p)).ids[-keep:] for p in chunk]
        outs = model.generate_batch(prompts, max_new_tokens, stop_ids)
        for pair, out in zip(chunk, outs, strict=True):
            predicted = tok.decode(out).split("\n")[0].strip()
            valid = sql_runs(db_dir / pair.db, predicted)
            rows.append(
                {
                    "question": pair.question,
                    "gold": pair.sql,
                    "predicted": predicted,
                    "template": template_of(pair.sql),
                    "valid": valid,
                    "execution_match": valid
                    and execution_match(db_dir / pair.db, predicted, pair.sql),
                    "exact": " ".join(predicted.split()).lower()
                    == " ".join(pair.sql.split()).lower(),
                }
            )
        if progress:
            progress(len(rows))

    def score(rs: list[dict[str, Any]]) -> dict[str, Any]:
        n = max(len(rs), 1)
        return {
            "examples": len(rs),
            "valid_sql": sum(r["valid"] for r in rs) / n,
            "execution_accuracy": sum(r["execution_match"] for r in rs) / n,
            "exact_match": sum(r["exact"] for r in rs) / n,
        }

    return {
        **score(rows),
        "by_template": {
            t: score([r for r in rows if r["template"] == t])
            for t in TEMPLATES
            if any(r["template"] == t for r in rows)
        },
        # the first five, and the first five it got wrong: what a reader checks first
        "samples": [
            {k: r[k] for k in ("question", "gold", "predicted", "execution_match")}
            for r in rows[:5] + [r for r in rows[5:] if not r["execution_match"]][:5]
        ],
    }
