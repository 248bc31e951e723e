"""Evaluation tasks: perplexity of every stage's model, SQL accuracy of the finetuned ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.data.tokenizer import load_tokenizer, specials
from moe.data.tokens import BatchSampler, TokenStore
from moe.sql.evaluate import sql_accuracy
from moe.sql.records import load_pairs
from moe.train.ranks import resolve_device
from moe.train.validation import perplexity
from tasks import retry_unless_input_error
from tasks.config import Config
from tasks.databases import check_domain_database
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
    model = load_model(model_dir).to(resolve_device(cfg.evaluate.device, "evaluate.device"))
    sampler = BatchSampler(
        TokenStore(data_dir, "val"),
        cfg.pretrain.batch_size,
        model.cfg.seq_len,
        cfg.pretrain.seed + 1,
    )
    out = perplexity(model, sampler, cfg.evaluate.val_batches)
    log.info("%s: validation loss %.4f, perplexity %.2f", model_dir, out["loss"], out["perplexity"])
    return out


SQL_SETS = {  # what each SQL figure is measured on (moe/sql/sets.py: build_sql_sets)
    "sql": "domain_test.jsonl",  # the target domain's held-out questions
    "generic_seen": "generic_test_seen.jsonl",  # new questions, databases trained on
    "generic_heldout": "generic_test_heldout.jsonl",  # new questions, schemas never trained on
}


@task(
    name="evaluate-sql", cache_policy=NONE, retries=1, retry_condition_fn=retry_unless_input_error
)
def evaluate_sql(cfg: Config, data_dir: Path, model_dir: Path) -> dict[str, Any]:
    """Execution accuracy (and valid SQL, exact match, per template) of one model on every
    held-out SQL set that the prepared data has."""
    model = load_model(model_dir).to(resolve_device(cfg.evaluate.device, "evaluate.device"))
    tok = load_tokenizer(data_dir / "tokenizer.json")
    sp = specials(tok, data_dir / "tokenizer.json")
    n = cfg.evaluate.max_examples or None
    sets = {
        name: load_pairs(data_dir / "sql" / f)[:n]
        for name, f in SQL_SETS.items()
        if name == "sql" or (data_dir / "sql" / f).is_file()
    }
    total = sum(len(p) for p in sets.values())
    out: dict[str, Any] = {}
    # a server domain: the database evaluated on is the one prepare read, or the change is said
    domain = check_domain_database(data_dir, cfg.data.sql_time_limit_s, cfg.data.sql_row_limit)
    if domain is not None:
        out["domain_database"] = domain
    with progress(f"evaluate-{model_dir.name}", total, "questions") as update:
        done = 0
        for name, pairs in sets.items():
            out[name] = sql_accuracy(
                model,
                tok,
                pairs,
                data_dir / "sql" / "dbs",
                cfg.evaluate.max_new_tokens,
                sp.eos,
                progress=lambda k, base=done: update(base + k),
                batch_size=cfg.evaluate.batch_size,
                time_limit_s=cfg.data.sql_time_limit_s,
                row_limit=cfg.data.sql_row_limit,
                prefix=sp.prefix,
                test_suite=cfg.evaluate.test_suite,
                chat=sp.chat,
                candidates=cfg.evaluate.candidates,
                temperature=cfg.evaluate.temperature,
                seed=cfg.data.seed,
            )
            done += len(pairs)
            log.info(
                "%s on %s: execution accuracy %.3f, test-suite %s, valid SQL %.3f, exact match"
                " %.3f (%d pairs;"
                " %d over the time limit, %d over the row limit, %d denied)",
                model_dir,
                SQL_SETS[name],
                out[name]["execution_accuracy"],
                out[name].get("test_suite_accuracy", "off"),
                out[name]["valid_sql"],
                out[name]["exact_match"],
                out[name]["examples"],
                out[name]["timeouts"],
                out[name]["row_limits"],
                out[name]["denied"],
            )
    return out
