"""The finetune stages' training: the previous stage's model on SQL pairs (prompt masked, the
answer and its focus tokens weighted), replay rows of the pretraining tokens mixed in, warm-up
and linear decay. A retry resumes from the newest valid checkpoint."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from prefect import task
from prefect.cache_policies import NONE

from moe.adapters.method import apply_method
from moe.data.tokenizer import Specials, encode_ids, load_tokenizer, specials
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, SFTExample, TokenStore
from moe.errors import InputError
from moe.hf.model_dir import model_dir_skeleton
from moe.sql.prompts import prompt_text, response_text
from moe.sql.records import load_pairs
from moe.train.config import FinetuneConfig
from moe.train.stop import Budget
from moe.train.trainer import Trainer, TrainResult
from tasks.checkpoints import checkpoint_store
from tasks.config import Config
from tasks.launch import run_training
from tasks.runs import training_fingerprint
from tasks.training import TRAIN_RETRIES, fit_and_save, load_model, stage_price, stage_resilience

log = logging.getLogger(__name__)


def sft_examples(path: Path, tok: Any, sp: Specials) -> list[SFTExample]:
    """Prompt (after the model's bos, if it wants one; in its chat template, if it has one)
    and answer ending in eos; nothing the tokenizer's post-processor would add in the
    middle."""
    return [
        SFTExample(
            [*sp.prefix, *encode_ids(tok, sp.chat(prompt_text(p)))],
            [*encode_ids(tok, response_text(p)), sp.eos],
            p.weight,
        )
        for p in load_pairs(path)
    ]


def focus_token_ids(tok: Any, words: list[str]) -> set[int]:
    """Token ids of the focus words, with and without a leading space. A word the tokenizer
    splits contributes all of its pieces (whole keywords are weighted)."""
    ids: set[int] = set()
    for w in words:
        for variant in (w, " " + w):
            ids.update(encode_ids(tok, variant))
    return ids


@task(name="finetune-model", cache_policy=NONE, **TRAIN_RETRIES)
def finetune_model(
    cfg: Config,
    stage: str,
    data_dir: Path,
    pairs_file: str,
    init_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float = 0.0,
    receipt: dict[str, Any] | None = None,
) -> TrainResult:
    return run_training(
        cfg,
        stage,
        lambda: _finetune(cfg, stage, data_dir, pairs_file, init_dir, out_dir, log_fn, budget_left),
        data_dir,
        out_dir,
        log_fn,
        init_dir,
        pairs_file,
        budget_left,
        receipt,
    )


def _finetune(
    cfg: Config,
    stage: str,
    data_dir: Path,
    pairs_file: str,
    init_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float,
) -> TrainResult:
    """Finetuning in this process (alone, or as one rank of torchrun or of a node)."""
    f: FinetuneConfig = getattr(cfg, stage)
    tok = load_tokenizer(data_dir / "tokenizer.json")
    sp = specials(tok, data_dir / "tokenizer.json")
    examples = sft_examples(data_dir / "sql" / pairs_file, tok, sp)
    # Under torchrun each rank reads only its shards of the start model (never whole).
    sharded = dist.is_initialized()
    model = model_dir_skeleton(init_dir) if sharded else load_model(init_dir)
    # LoRA / QLoRA: the base frozen and adapters added; the router policy (moe/adapters/method.py)
    plan = apply_method(model, f, stage)
    if f.max_len > model.cfg.seq_len:
        raise InputError(
            f"{stage}.max_len={f.max_len} exceeds the model's seq_len={model.cfg.seq_len}: lower it"
        )
    batches = SFTBatches(
        examples,
        f.batch_size,
        f.max_len,
        f.seed,
        sp.pad,
        focus_token_ids(tok, f.focus_tokens),
        f.focus_weight,
    )
    if f.replay_ratio > 0:
        rows = max(1, round(f.batch_size * f.replay_ratio))
        replay = BatchSampler(TokenStore(data_dir, f.replay_split), rows, f.max_len, f.seed + 1)
        batches = MixedBatches(batches, replay)
    fingerprint = training_fingerprint(cfg, stage, data_dir, init_dir)
    trainer = Trainer(
        model,
        f,
        batches,
        checkpoint_store(cfg, out_dir / "checkpoints", run_key := f"{stage}/{fingerprint[:16]}"),
        fingerprint=fingerprint,
        schedule="linear",
        min_lr=0.0,
        expert_warmup=False,
        router_lr_mult=model.mcfg.router_lr_mult,
        budget=Budget(stage_price(cfg, stage), budget_left, cfg.cost.alert_fraction),
        log_fn=log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=stage_resilience(cfg, stage, out_dir / "checkpoints", fingerprint),
        weights=init_dir / "model.safetensors" if sharded else None,
        # the frozen base, by the digest of the file it came from (the fingerprint's too)
        base_sha256=fingerprint.split(":")[1] if plan is not None else None,
    )
    return fit_and_save(cfg, trainer, out_dir, run_key, init_dir)
