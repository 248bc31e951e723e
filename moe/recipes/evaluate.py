"""The model-level part of evaluation: a model folder's held-out perplexity, and its SQL
scores on every held-out set the prepared data has (execution accuracy, test-suite, valid
SQL, exact match, per template). What a stage adds around them (the database check, the
progress artifact, the report) is tasks/evaluation.py's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.data.tokenizer import load_tokenizer, specials
from moe.data.tokens import BatchSampler, TokenStore
from moe.hf.model_dir import load_model_dir
from moe.model.transformer import MoETransformer
from moe.recipes.params import Params
from moe.sql.config import EvaluateConfig
from moe.sql.evaluate import sql_accuracy
from moe.sql.records import load_pairs
from moe.train.ranks import resolve_device
from moe.train.validation import perplexity

log = logging.getLogger(__name__)

SQL_SETS = {  # what each SQL figure is measured on (moe/sql/sets.py: build_sql_sets)
    "sql": "domain_test.jsonl",  # the target domain's held-out questions
    "generic_seen": "generic_test_seen.jsonl",  # new questions, databases trained on
    "generic_heldout": "generic_test_heldout.jsonl",  # new questions, schemas never trained on
}


def evaluation_dtype(rule: str, device: torch.device) -> torch.dtype:
    """The weights' dtype under evaluate.dtype: auto is bf16 on CUDA, fp32 elsewhere."""
    if rule == "bfloat16" or (rule == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def load_for_evaluation(model_dir: Path, e: EvaluateConfig) -> MoETransformer:
    """The model folder on evaluate.device, its weights in evaluate.dtype's type (rotary
    tables and router logits stay fp32)."""
    device = resolve_device(e.device, "evaluate.device")
    return load_model_dir(model_dir, evaluation_dtype(e.dtype, device)).to(device)


def held_out_perplexity(params: Params, data_dir: Path, model_dir: Path) -> dict[str, float]:
    """Loss and perplexity of the model folder on evaluate.val_batches batches of the held-out
    text (the pretrain section's batch size and seed), on evaluate.device."""
    model = load_for_evaluation(model_dir, params.evaluate)
    sampler = BatchSampler(
        TokenStore(data_dir, "val"),
        params.pretrain.batch_size,
        model.cfg.seq_len,
        params.pretrain.seed + 1,
    )
    out = perplexity(model, sampler, params.evaluate.val_batches)
    log.info("%s: validation loss %.4f, perplexity %.2f", model_dir, out["loss"], out["perplexity"])
    return out


def sql_sets(params: Params, data_dir: Path) -> dict[str, list[Any]]:
    """The held-out pairs of each SQL set the prepared data has (evaluate.max_examples each)."""
    n = params.evaluate.max_examples or None
    return {
        name: load_pairs(data_dir / "sql" / f)[:n]
        for name, f in SQL_SETS.items()
        if name == "sql" or (data_dir / "sql" / f).is_file()
    }


def sql_scores(
    params: Params,
    data_dir: Path,
    model_dir: Path,
    sets: dict[str, list[Any]],
    progress: Callable[[int], None] = lambda done: None,
) -> dict[str, Any]:
    """The model folder's scores on each set of `sql_sets`, every answer run on its database
    under data.sql_time_limit_s and sql_row_limit; `progress` hears the questions done."""
    e, d = params.evaluate, params.data
    model = load_for_evaluation(model_dir, e)
    tok = load_tokenizer(data_dir / "tokenizer.json")
    sp = specials(tok, data_dir / "tokenizer.json")
    out: dict[str, Any] = {}
    done = 0
    for name, pairs in sets.items():
        out[name] = score = sql_accuracy(
            model,
            tok,
            pairs,
            data_dir / "sql" / "dbs",
            e.max_new_tokens,
            sp.eos,
            progress=lambda k, base=done: progress(base + k),
            batch_size=e.batch_size,
            time_limit_s=d.sql_time_limit_s,
            row_limit=d.sql_row_limit,
            prefix=sp.prefix,
            test_suite=e.test_suite,
            chat=sp.chat,
            candidates=e.candidates,
            temperature=e.temperature,
            seed=d.seed,
            vote=e.vote,
            constrain=e.constrain_identifiers,
        )
        done += len(pairs)
        log.info(
            "%s on %s: execution accuracy %.3f, test-suite %s, valid SQL %.3f, exact match"
            " %.3f (%d pairs; %d over the time limit, %d over the row limit, %d denied)",
            model_dir,
            SQL_SETS[name],
            score["execution_accuracy"],
            score.get("test_suite_accuracy", "off"),
            score["valid_sql"],
            score["exact_match"],
            score["examples"],
            score["timeouts"],
            score["row_limits"],
            score["denied"],
        )
    return out
