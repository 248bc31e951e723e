"""Training tasks: pretrain on the memmap tokens, finetune on SQL pairs.

A retry of either task resumes from its newest valid checkpoint (the trainer looks for one
before it starts), so a machine that dies costs at most `checkpoint_every` steps.
"""

from __future__ import annotations

import json
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
from prefect.tasks import exponential_backoff

from moe.checkpoint.store import load_model_tensors
from moe.config import FinetuneConfig
from moe.data.tokenizer import Specials, encode_ids, load_tokenizer, specials
from moe.data.tokens import BatchSampler, MixedBatches, SFTBatches, SFTExample, TokenStore
from moe.errors import InputError
from moe.hf.convert import (
    build_init_model,
    init_model_skeleton,
    load_model_dir,
    model_dir_skeleton,
    save_model_dir,
)
from moe.model.transformer import MoETransformer
from moe.sql.pairs import load_pairs, prompt_text, response_text
from moe.train import distributed as D
from moe.train.resilience import AttemptJournal
from moe.train.stop import Budget
from moe.train.trainer import Resilience, Trainer, TrainResult
from moe.train.validation import Validation
from tasks import retry_unless_input_error
from tasks.checkpoints import checkpoint_store, offload_checkpoints
from tasks.config import Config, PoolSpec
from tasks.events import row_events
from tasks.launch import run_training
from tasks.progress import training_log
from tasks.runs import training_fingerprint

log = logging.getLogger(__name__)

TRAIN_RETRIES = dict(
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_input_error,
)


def save_model(model: MoETransformer, out_dir: Path) -> Path:
    """The stage's model folder (moe/hf/convert.py): what the next stage, `model export` and
    `ask` read. A model started from model.init keeps the import's source record."""
    extra = {}
    if model.cfg.init and (Path(model.cfg.init) / "model.json").is_file():
        source = json.loads((Path(model.cfg.init) / "model.json").read_text()).get("source")
        extra = {"source": source} if source else {}
    elif model.cfg.init:
        extra = {"source": {"path": model.cfg.init, "model_type": _init_type(model.cfg.init)}}
    return save_model_dir(model, out_dir, extra)


def _init_type(init: str) -> str:
    try:
        return json.loads((Path(init) / "config.json").read_text()).get("model_type", "")
    except (OSError, json.JSONDecodeError):
        return ""


def load_model(model_dir: Path) -> MoETransformer:
    """A stage's model folder, in fp32 (what training updates)."""
    return load_model_dir(model_dir, dtype=torch.float32)


def write_metrics_csv(out_dir: Path) -> Path:
    """metrics.jsonl -> metrics.csv of the per-step training rows (for `dvc plots`)."""
    import csv

    cols = [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "expert_cv",
        "expert_max_vio",
        "dropped_fraction",
        "cost",
    ]
    src, dest = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
    rows = (
        [json.loads(line) for line in src.read_text().splitlines() if line] if src.is_file() else []
    )
    with open(dest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(r for r in rows if "loss" in r)
    return dest


def _fit_and_save(cfg: Config, trainer: Trainer, out_dir: Path, run_key: str) -> TrainResult:
    """Train (resuming if a checkpoint fits), then write the final weights and the CSV log.
    Under torchrun every rank trains; the experts are gathered and rank 0 writes. A bar on a
    terminal and a Prefect progress artifact follow the steps (tasks/progress.py)."""
    stage = run_key.split("/", 1)[0]
    try:
        with training_log(
            stage, trainer.cfg.max_steps, trainer.metrics.log_fn, row_events(cfg, stage)
        ) as trainer.metrics.log_fn:
            result = trainer.fit()
    finally:  # a failed run's checkpoint being written still lands (a retry resumes from it)
        trainer.checkpointer.store.close()
    model = trainer.model
    if trainer.ranks.meshes is not None:
        # The final weights whole (rank 0 alone keeps them; the optimizer stays sharded).
        full = D.full_tensors(D.unique_state(model), keep=trainer.ranks.rank == 0)
        if trainer.ranks.rank != 0:
            return result
        model = MoETransformer(model.cfg, model.mcfg, model.vocab_size)
        load_model_tensors(model, full)
    if cfg.checkpoint.offload:
        if (
            trainer.ranks.world > 1
        ):  # inside torchrun: no Prefect flow here; the parent task retries
            offload_checkpoints.fn(cfg, trainer.checkpointer.store.root, run_key)
        else:
            offload_checkpoints(cfg, trainer.checkpointer.store.root, run_key)
    save_model(model.to("cpu"), out_dir)
    write_metrics_csv(out_dir)
    return result


def _pool(cfg: Config, stage: str) -> PoolSpec:
    return cfg.pools.definitions[cfg.pools.stages[stage]]


def _price(cfg: Config, stage: str) -> float:
    """What an hour of this stage costs: the pool's rate for each machine it spans."""
    return _pool(cfg, stage).rate * cfg.machines(stage)


def _resilience(cfg: Config, stage: str, ckpt_dir: Path, fingerprint: str) -> Resilience:
    """The attempt journal beside the checkpoints, this process's start (what a restart costs
    is measured from it) and, with checkpoint.every: auto, the pool's mean time between
    interruptions."""
    import psutil

    return Resilience(
        AttemptJournal(ckpt_dir / "attempts.json", fingerprint),
        # under torchrun: the stage's own process (tasks.launch.torchrun passes it), not the rank's
        float(os.environ.get("MOE_ATTEMPT_STARTED") or psutil.Process().create_time()),
        _pool(cfg, stage).mtbi_s if cfg.checkpoint.every == "auto" else None,
    )


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
    fingerprint = training_fingerprint(cfg, "pretrain", data_dir)
    scratch = weights is not None and weights.parent == out_dir / ".init"
    try:
        trainer = _pretrainer(
            cfg, model, train_store, val_store, out_dir, fingerprint, log_fn, budget_left, weights
        )
    except BaseException:
        if scratch and int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)  # a streamed import: scratch
        raise
    if scratch:
        dist.barrier()  # every rank has read its part of the streamed import
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(weights.parent, ignore_errors=True)
    return _fit_and_save(cfg, trainer, out_dir, f"pretrain/{fingerprint[:16]}")


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
        budget=Budget(_price(cfg, "pretrain"), budget_left, cfg.cost.alert_fraction),
        log_fn=log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=_resilience(cfg, "pretrain", out_dir / "checkpoints", fingerprint),
        weights=weights,
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


def sft_examples(path: Path, tok: Any, sp: Specials) -> list[SFTExample]:
    """Prompt (after the model's bos, if it wants one) and answer ending in eos; nothing the
    tokenizer's post-processor would add in the middle."""
    return [
        SFTExample(
            [*sp.prefix, *encode_ids(tok, prompt_text(p))],
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
        budget=Budget(_price(cfg, stage), budget_left, cfg.cost.alert_fraction),
        log_fn=log_fn,
        metrics_path=out_dir / "metrics.jsonl",
        resilience=_resilience(cfg, stage, out_dir / "checkpoints", fingerprint),
        weights=init_dir / "model.safetensors" if sharded else None,
    )
    return _fit_and_save(cfg, trainer, out_dir, run_key)
