"""The finetune recipe: a model folder on SQL pairs (the prompt masked, the answer and its focus
tokens weighted), replay rows of the pretraining tokens mixed in, warm-up and linear decay;
full, LoRA or QLoRA as the stage's section says. A rerun resumes from the newest valid
checkpoint. The model it starts from is any model folder: the previous stage's, or one that
`model import` wrote."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe.adapters.method import apply_method
from moe.data.tokenizer import Specials, encode_ids, load_tokenizer, specials
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, SFTExample, TokenStore
from moe.errors import InputError
from moe.hf.model_dir import load_model_dir, model_dir_skeleton
from moe.recipes.context import RunContext
from moe.recipes.fit import fit_and_save, training_fingerprint
from moe.recipes.params import Params
from moe.sql.prompts import prompt_text, response_text
from moe.sql.records import load_pairs
from moe.train.config import FinetuneConfig
from moe.train.trainer import Trainer, TrainResult

log = logging.getLogger(__name__)

# Each finetune stage: the pairs it trains on (under the prepared data's sql/) and the stage
# whose model it starts from (flows/bodies/finetune.py declares the stages from this).
FINETUNES: dict[str, tuple[str, str]] = {
    "finetune_sql": ("generic.jsonl", "pretrain"),
    "finetune_domain": ("domain_train.jsonl", "finetune_sql"),
}


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


def with_replayed(
    examples: list[SFTExample], replayed: list[SFTExample], share: float
) -> list[SFTExample]:
    """`examples` and `replayed` in one set whose weights draw `share` of the rows from
    `replayed` (each set keeping its own weights among its examples)."""
    own = sum(ex.weight for ex in examples)
    theirs = sum(ex.weight for ex in replayed)
    scale = share / (1 - share) * own / theirs
    return [*examples, *(dataclasses.replace(ex, weight=ex.weight * scale) for ex in replayed)]


def finetune(
    params: Params,
    stage: str,
    data_dir: Path,
    pairs_file: str,
    init_dir: Path,
    out_dir: Path,
    ctx: RunContext,
) -> TrainResult:
    """Finetuning in this process (alone, or as one rank of torchrun or of a node): the pairs
    `data_dir/sql/pairs_file` on the model folder `init_dir`, settings in params.<stage>,
    the model folder and checkpoints written under `out_dir`."""
    f: FinetuneConfig = getattr(params, stage)
    tok = load_tokenizer(data_dir / "tokenizer.json")
    sp = specials(tok, data_dir / "tokenizer.json")
    examples = sft_examples(data_dir / "sql" / pairs_file, tok, sp)
    if f.replay_pairs > 0:  # the stage before's pairs, a share of every batch's rows
        before = FINETUNES[FINETUNES[stage][1]][0]
        replayed = sft_examples(data_dir / "sql" / before, tok, sp)
        examples = with_replayed(examples, replayed, f.replay_pairs)
    # Under torchrun each rank reads only its shards of the start model (never whole).
    sharded = dist.is_initialized()
    model = model_dir_skeleton(init_dir) if sharded else load_model_dir(init_dir, torch.float32)
    # LoRA / QLoRA: the base frozen and adapters added; the router policy (moe/adapters/method.py)
    plan = apply_method(model, f, stage)
    if model.vocab_size < tok.get_vocab_size():
        raise InputError(
            f"{init_dir}: the model's embedding has {model.vocab_size} rows, the prepared"
            f" data's tokenizer ({data_dir / 'tokenizer.json'}) {tok.get_vocab_size()} tokens:"
            " prepare the data with the model's own tokenizer (model.init, or tokenizer.path)"
        )
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
        packing=f.packing,
        row_multiple=dist.get_world_size() if sharded else 1,
        micro_batches=f.grad_accum,
    )
    if f.replay_ratio > 0:  # a share of a micro-batch's rows (packed: of its max_len rows)
        rows = max(1, round(batches.rows * f.replay_ratio))
        if sharded:  # every process takes an equal share of all the rows
            world = dist.get_world_size()
            rows = -(-(batches.rows + rows) // world) * world - batches.rows
        replay = BatchSampler(TokenStore(data_dir, f.replay_split), rows, f.max_len, f.seed + 1)
        batches = MixedBatches(batches, replay)
    fingerprint = training_fingerprint(params, stage, data_dir, init_dir)
    run_key = f"{stage}/{fingerprint[:16]}"
    trainer = Trainer(
        model,
        f,
        batches,
        ctx.store(params.checkpoint, out_dir / "checkpoints", run_key),
        fingerprint=fingerprint,
        schedule="linear",
        min_lr=0.0,
        expert_warmup=False,
        router_lr_mult=model.mcfg.router_lr_mult,
        budget=ctx.budget,
        log_fn=ctx.log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=ctx.resilience(out_dir / "checkpoints", fingerprint),
        weights=init_dir / "model.safetensors" if sharded else None,
        # the frozen base, by the digest of the file it came from (the fingerprint's too)
        base_sha256=fingerprint.split(":")[1] if plan is not None else None,
    )
    return fit_and_save(trainer, out_dir, run_key, ctx, init_dir)
