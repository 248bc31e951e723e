"""The pretrain stage's training: the model (fresh, or model.init's start model) on the
memmap tokens, warm-up and cosine decay. A retry resumes from the newest valid checkpoint."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from prefect import task
from prefect.cache_policies import NONE

from moe.adapters.method import apply_method
from moe.data.tokens import BatchSampler, TokenStore
from moe.errors import InputError
from moe.hashing import weights_files_digest
from moe.hf.model_init import build_init_model, init_model_skeleton
from moe.model.transformer import MoETransformer
from moe.train.stop import Budget
from moe.train.trainer import Trainer, TrainResult
from moe.train.validation import Validation
from tasks.checkpoints import checkpoint_store
from tasks.config import Config
from tasks.launch import run_training
from tasks.runs import training_fingerprint
from tasks.training import (
    TRAIN_RETRIES,
    fit_and_save,
    save_model,
    stage_price,
    stage_resilience,
    write_metrics_csv,
)

log = logging.getLogger(__name__)


@task(name="pretrain-model", cache_policy=NONE, **TRAIN_RETRIES)
def pretrain_model(
    cfg: Config,
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float = 0.0,
    receipt: dict[str, Any] | None = None,
) -> TrainResult:
    """budget_left: what is left of cost.budget for this stage (0 = no budget). Where it
    trains (here, torchrun, a Job across pretrain.nodes machines, which fetch the data the
    receipt names) is tasks/launch.py's to decide."""
    return run_training(
        cfg,
        "pretrain",
        lambda: _pretrain(cfg, data_dir, out_dir, log_fn, budget_left),
        data_dir,
        out_dir,
        log_fn,
        budget_left=budget_left,
        receipt=receipt,
    )


def _pretrain(
    cfg: Config,
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float,
) -> TrainResult:
    """Pretraining in this process (alone, or as one rank of torchrun or of a node)."""
    train_store, val_store = TokenStore(data_dir, "train"), TokenStore(data_dir, "val")
    torch.manual_seed(cfg.pretrain.seed)
    t = cfg.pretrain
    weights = None  # under torchrun: the file each rank reads its part of the model from
    # (model.init_pretrain skip only evaluates the imported model: whole, as one process.)
    sharded = dist.is_initialized() and not (cfg.model.init and cfg.model.init_pretrain == "skip")
    if cfg.model.init:  # continued pretraining of an imported model (seed 000, section 7.1)
        if sharded:
            model, weights = init_model_skeleton(cfg.model, cfg.moe, out_dir / ".init")
        else:
            model = build_init_model(cfg.model, cfg.moe)
        if model.vocab_size < train_store.vocab_size:
            raise InputError(
                f"model.init: the model's embedding has {model.vocab_size} rows, its tokenizer"
                f" {train_store.vocab_size} tokens"
            )
        log.info("model.init: %s (%s)", cfg.model.init, cfg.model.init_pretrain)
        if cfg.model.init_pretrain == "skip":
            return _pass_on(
                model,
                BatchSampler(val_store, t.batch_size, cfg.model.seq_len, t.seed + 1),
                t.eval_batches,
                out_dir,
            )
    else:
        # Under torchrun the model is built on the meta device: each rank draws the same
        # weights one process would, and keeps only its shards (moe/train/distributed.py).
        with torch.device("meta" if sharded else "cpu"):
            model = MoETransformer(cfg.model, cfg.moe, train_store.vocab_size)
    log.info(
        "model: %.2fM parameters, %.2fM active per token",
        model.num_params() / 1e6,
        model.num_params(active_only=True) / 1e6,
    )
    base_sha256 = None  # continued pretraining with adapters: the frozen base's digest,
    if t.method != "full":  # the same however many processes read it
        base_sha256 = weights_files_digest(Path(cfg.model.init))
    apply_method(model, t, "pretrain")
    fingerprint = training_fingerprint(cfg, "pretrain", data_dir)
    scratch = weights is not None and weights.parent == out_dir / ".init"
    try:
        trainer = _pretrainer(
            cfg,
            model,
            train_store,
            val_store,
            out_dir,
            fingerprint,
            log_fn,
            budget_left,
            weights,
            base_sha256,
        )
    except BaseException:
        if scratch and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)  # a streamed import: scratch
        raise
    if scratch:
        dist.barrier()  # every rank has read its part of the streamed import
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)
    init = Path(cfg.model.init) if cfg.model.init else None
    return fit_and_save(cfg, trainer, out_dir, f"pretrain/{fingerprint[:16]}", init)


def _pretrainer(
    cfg: Config,
    model: MoETransformer,
    train_store: TokenStore,
    val_store: TokenStore,
    out_dir: Path,
    fingerprint: str,
    log_fn: Callable[[dict[str, Any]], None],
    budget_left: float,
    weights: Path | None,
    base_sha256: str | None = None,
) -> Trainer:
    t = cfg.pretrain
    return Trainer(
        model,
        t,
        BatchSampler(train_store, t.batch_size, cfg.model.seq_len, t.seed),
        checkpoint_store(cfg, out_dir / "checkpoints", f"pretrain/{fingerprint[:16]}"),
        fingerprint=fingerprint,
        schedule="cosine",
        min_lr=t.min_lr,
        router_lr_mult=cfg.moe.router_lr_mult,
        validation=Validation(
            BatchSampler(val_store, t.batch_size, cfg.model.seq_len, t.seed + 1),
            t.eval_every,
            t.eval_batches,
        ),
        budget=Budget(stage_price(cfg, "pretrain"), budget_left, cfg.cost.alert_fraction),
        log_fn=log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=stage_resilience(cfg, "pretrain", out_dir / "checkpoints", fingerprint),
        weights=weights,
        base_sha256=base_sha256,
    )


def _pass_on(model: MoETransformer, val: BatchSampler, batches: int, out_dir: Path) -> TrainResult:
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
    save_model(model, out_dir)
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
