"""Evaluation tasks: perplexity of every stage's model, SQL accuracy of the finetuned ones."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.recipes.evaluate import held_out_perplexity, sql_scores, sql_sets
from tasks import retry_unless_input_error
from tasks.config import Config
from tasks.databases import check_domain_database
from tasks.progress import progress

log = logging.getLogger(__name__)


@task(
    name="evaluate-perplexity",
    cache_policy=NONE,
    retries=1,
    retry_condition_fn=retry_unless_input_error,
)
def evaluate_perplexity(cfg: Config, data_dir: Path, model_dir: Path) -> dict[str, float]:
    return held_out_perplexity(cfg, data_dir, model_dir)


@task(
    name="evaluate-sql", cache_policy=NONE, retries=1, retry_condition_fn=retry_unless_input_error
)
def evaluate_sql(cfg: Config, data_dir: Path, model_dir: Path) -> dict[str, Any]:
    """Execution accuracy (and valid SQL, exact match, per template) of one model on every
    held-out SQL set that the prepared data has (moe/recipes/evaluate.py)."""
    sets = sql_sets(cfg, data_dir)
    out: dict[str, Any] = {}
    # a server domain: the database evaluated on is the one prepare read, or the change is said
    domain = check_domain_database(data_dir, cfg.data.sql_time_limit_s, cfg.data.sql_row_limit)
    if domain is not None:
        out["domain_database"] = domain
    total = sum(len(p) for p in sets.values())
    with progress(f"evaluate-{model_dir.name}", total, "questions") as update:
        out.update(sql_scores(cfg, data_dir, model_dir, sets, update))
    return out
