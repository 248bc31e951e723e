"""The pretrain recipe: the model (fresh, or model.init's start model) on the memmap tokens,
warm-up and cosine decay, validation and early stopping. A rerun resumes from the newest
valid checkpoint. With model.init and `init_pretrain: skip` the imported model passes through
untrained, its held-out loss measured."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from moe.adapters.method import apply_method
from moe.data.tokens import BatchSampler, TokenStore
from moe.errors import InputError
from moe.hashing import weights_files_digest
from moe.hf.model_dir import save_stage_model
from moe.hf.model_init import build_init_model, init_model_skeleton
from moe.model.transformer import MoETransformer
from moe.recipes.context import RunContext
from moe.recipes.fit import fit_and_save, training_fingerprint, write_metrics_csv
from moe.recipes.params import Params
from moe.train.trainer import Trainer, TrainResult
from moe.train.validation import Validation

log = logging.getLogger(__name__)


def pretrain(params: Params, data_dir: Path, out_dir: Path, ctx: RunContext) -> TrainResult:
    """Pretraining in this process (alone, or as one rank of torchrun or of a node): the
    prepared data in `data_dir`, the model folder and checkpoints written under `out_dir`."""
    train_store, val_store = TokenStore(data_dir, "train"), TokenStore(data_dir, "val")
    torch.manual_seed(params.pretrain.seed)
    t, m = params.pretrain, params.model
    weights = None  # under torchrun: the file each rank reads its part of the model from
    # (model.init_pretrain skip only evaluates the imported model: whole, as one process.)
    sharded = dist.is_initialized() and not (m.init and m.init_pretrain == "skip")
    if m.init:  # continued pretraining of an imported model (seed 000, section 7.1)
        if sharded:
            model, weights = init_model_skeleton(m, params.moe, out_dir / ".init")
        else:
            model = build_init_model(m, params.moe)
        if model.vocab_size < train_store.vocab_size:
            raise InputError(
                f"model.init: the model's embedding has {model.vocab_size} rows, its tokenizer"
                f" {train_store.vocab_size} tokens"
            )
        log.info("model.init: %s (%s)", m.init, m.init_pretrain)
        if m.init_pretrain == "skip":
            val = BatchSampler(val_store, t.batch_size, m.seq_len, t.seed + 1)
            return pass_on(model, val, t.eval_batches, out_dir)
    else:
        # Under torchrun the model is built on the meta device: each rank draws the same
        # weights one process would, and keeps only its shards (moe/train/distributed.py).
        with torch.device("meta" if sharded else "cpu"):
            model = MoETransformer(m, params.moe, train_store.vocab_size)
    log.info(
        "model: %.2fM parameters, %.2fM active per token",
        model.num_params() / 1e6,
        model.num_params(active_only=True) / 1e6,
    )
    base_sha256 = None  # continued pretraining with adapters: the frozen base's digest,
    if t.method != "full":  # the same however many processes read it
        base_sha256 = weights_files_digest(Path(m.init))
    apply_method(model, t, "pretrain")
    fingerprint = training_fingerprint(params, "pretrain", data_dir)
    scratch = weights is not None and weights.parent == out_dir / ".init"
    try:
        trainer = _pretrainer(
            params, model, train_store, val_store, out_dir, fingerprint, ctx, weights, base_sha256
        )
    except BaseException:
        if scratch and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)  # a streamed import: scratch
        raise
    if scratch:
        dist.barrier()  # every rank has read its part of the streamed import
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)
    init = Path(m.init) if m.init else None
    return fit_and_save(trainer, out_dir, f"pretrain/{fingerprint[:16]}", ctx, init)


def _pretrainer(
    params: Params,
    model: MoETransformer,
    train_store: TokenStore,
    val_store: TokenStore,
    out_dir: Path,
    fingerprint: str,
    ctx: RunContext,
    weights: Path | None,
    base_sha256: str | None = None,
) -> Trainer:
    t, seq = params.pretrain, params.model.seq_len
    return Trainer(
        model,
        t,
        # batch_size is a step's: each of its grad_accum micro-batches draws its share
        BatchSampler(train_store, -(-t.batch_size // t.grad_accum), seq, t.seed),
        ctx.store(params.checkpoint, out_dir / "checkpoints", f"pretrain/{fingerprint[:16]}"),
        fingerprint=fingerprint,
        schedule="cosine",
        min_lr=t.min_lr,
        router_lr_mult=params.moe.router_lr_mult,
        validation=Validation(
            BatchSampler(val_store, t.batch_size, seq, t.seed + 1), t.eval_every, t.eval_batches
        ),
        budget=ctx.budget,
        log_fn=ctx.log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=ctx.resilience(out_dir / "checkpoints", fingerprint),
        weights=weights,
        base_sha256=base_sha256,
    )


def pass_on(model: MoETransformer, val: BatchSampler, batches: int, out_dir: Path) -> TrainResult:
    """model.init_pretrain: skip. The imported model becomes the pretrain stage's model as it
    is; its held-out loss is measured so the stage still reports one."""
    t0 = time.perf_counter()
    model.eval()
    losses = []
    with torch.no_grad():
        for i in range(batches):
            x, y, _ = val.batch_at(i)
            losses.append(float(model(x, y)[1]))
    loss = sum(losses) / len(losses)
    save_stage_model(model, out_dir)
    write_metrics_csv(out_dir)
    log.info("model.init_pretrain: skip; held-out loss of the imported model %.4f", loss)
    return TrainResult(
        steps=0,
        resumed_from=None,
        train_loss=loss,
        val_loss=loss,
        tokens=0,
        wall_s=time.perf_counter() - t0,
        stop_reason="skipped (model.init_pretrain: skip)",
        checkpoint="",
        tokens_per_s=0.0,
        experts_per_layer=model.experts_per_layer(),
    )
