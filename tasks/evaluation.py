"""Evaluation tasks: perplexity of every stage's model, SQL accuracy of the finetuned ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.config import Config
from moe.data import BatchSampler, TokenStore
from moe.evaluate import perplexity, sql_accuracy
from moe.sql import load_pairs
from moe.tokenizer import EOT, load_tokenizer
from tasks import retry_unless_input_error
from tasks.progress import progress
from tasks.training import load_model

log = logging.getLogger(__name__)


@task(
    name="evaluate-perplexity",
    cache_policy=NONE,
    retries=1,
    retry_condition_fn=retry_unless_input_error,
)
def evaluate_perplexity(cfg: Config, data_dir: Path, model_dir: Path) -> dict[str, float]:
    model = load_model(model_dir)
    sampler = BatchSampler(
        TokenStore(data_dir, "val"), cfg.train.batch_size, model.cfg.seq_len, cfg.train.seed + 1
    )
    out = perplexity(model, sampler, cfg.evaluate.val_batches)
    log.info("%s: validation loss %.4f, perplexity %.2f", model_dir, out["loss"], out["perplexity"])
    return out


@task(
    name="evaluate-sql", cache_policy=NONE, retries=1, retry_condition_fn=retry_unless_input_error
)
def evaluate_sql(cfg: Config, data_dir: Path, model_dir: Path) -> dict[str, Any]:
    model = load_model(model_dir)
    tok = load_tokenizer(data_dir / "tokenizer.json")
    pairs = load_pairs(data_dir / "sql" / "domain_test.jsonl")[: cfg.evaluate.max_examples]
    name = f"evaluate-{model_dir.name}"
    with progress(name, len(pairs), "questions") as update:
        out = sql_accuracy(
            model,
            tok,
            pairs,
            data_dir / "sql" / "dbs",
            cfg.evaluate.max_new_tokens,
            tok.token_to_id(EOT),
            progress=update,
        )
    log.info(
        "%s: SQL execution accuracy %.3f, exact match %.3f on %d held-out domain pairs",
        model_dir,
        out["execution_accuracy"],
        out["exact_match"],
        out["examples"],
    )
    return out
