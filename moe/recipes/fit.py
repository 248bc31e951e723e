"""What every training recipe shares: what decides whether a checkpoint is resumed (the
fingerprint), and the fit-and-save around the trainer that leaves the stage's model folder.

A rerun resumes from its newest valid checkpoint (the trainer looks for one before it
starts), so a machine that dies costs at most `checkpoint_every` steps; one that gives notice
by SIGTERM costs about one step (moe/recipes/context.py `saving_on_sigterm`).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from moe.adapters.files import adapter_spec, save_adapter_dir
from moe.adapters.lora import (
    add_adapters,
    dequantize_base,
    has_adapters,
    merge_adapters,
    set_router_policy,
)
from moe.checkpoint.tensors import load_model_tensors
from moe.hashing import sha256_file
from moe.hf.model_dir import save_stage_model
from moe.model.transformer import MoETransformer
from moe.recipes.context import RunContext, saving_on_sigterm
from moe.recipes.params import Params
from moe.train import distributed as D
from moe.train.trainer import Trainer, TrainResult

# The per-step columns of metrics.csv (what `dvc plots` draws).
METRICS_COLUMNS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "expert_cv",
    "expert_max_vio",
    "dropped_fraction",
    "cost",
)


def resumable(params: Params, section: str) -> Params:
    """The params as far as resuming cares: the process and machine counts are not part of a
    training state (checkpoints hold every expert under its global id), so changing them
    resumes."""
    sec = getattr(params, section)
    return dataclasses.replace(params, **{section: dataclasses.replace(sec, nproc=0, nodes=1)})


def training_fingerprint(
    params: Params, stage: str, data_dir: Path, init_dir: Path | None = None
) -> str:
    """What a checkpoint must have been trained with to be resumed by `stage`: the stage's
    hyper-parameters (pretrain: model, moe and pretrain; a finetune stage: its own section), the
    prepared data (its meta.json, which holds every split's sha256) and, for a finetune stage,
    the model it starts from. The process and machine counts are left out (see resumable)."""
    if stage == "pretrain":
        parts = [resumable(params, "pretrain").fingerprint("model", "moe", "pretrain")]
    elif init_dir is None:
        raise ValueError(f"{stage}: a finetune stage's fingerprint needs the model it starts from")
    else:
        parts = [
            resumable(params, stage).fingerprint(stage),
            sha256_file(init_dir / "model.safetensors"),
        ]
    return ":".join([*parts, sha256_file(data_dir / "meta.json")])


def write_metrics_csv(out_dir: Path) -> Path:
    """metrics.jsonl -> metrics.csv of the per-step training rows (for `dvc plots`)."""
    src, dest = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
    rows = (
        [json.loads(line) for line in src.read_text().splitlines() if line] if src.is_file() else []
    )
    with open(dest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(METRICS_COLUMNS), extrasaction="ignore")
        w.writeheader()
        w.writerows(r for r in rows if "loss" in r)
    return dest


def fit_and_save(
    trainer: Trainer, out_dir: Path, run_key: str, ctx: RunContext, init: Path | None = None
) -> TrainResult:
    """Train (resuming if a checkpoint fits), then write the final weights and the CSV log.
    Across processes every rank trains; the experts are gathered and rank 0 writes. A stage
    with adapters leaves them beside the merged model (adapter.safetensors, with the digest
    of the base they were trained on: `init`'s)."""
    stage = run_key.split("/", 1)[0]
    # A SIGTERM's step is saved and landed; then the signal ends the run (nothing below runs).
    with saving_on_sigterm(trainer, stage, ctx.notice):
        try:
            with ctx.follow(
                stage, trainer.cfg.max_steps, trainer.metrics.log_fn
            ) as trainer.metrics.log_fn:
                result = trainer.fit()
        finally:  # a failed run's checkpoint being written still lands (a retry resumes from it)
            trainer.checkpointer.store.close()
    model = trainer.model
    adapted = has_adapters(model)
    if trainer.ranks.meshes is not None:
        # The final weights whole (rank 0 alone keeps them; the optimizer stays sharded).
        full = D.full_tensors(D.unique_state(model), keep=trainer.ranks.rank == 0)
        if trainer.ranks.rank != 0:
            return result
        model = MoETransformer(model.cfg, model.mcfg, model.vocab_size)
        if adapted:  # the same structure, and the same parameters marked as trained
            add_adapters(model, trainer.cfg.lora, seed=trainer.cfg.seed)
            set_router_policy(model, trainer.cfg.router_policy())
        load_model_tensors(model, full)
    if ctx.finished is not None:
        ctx.finished(trainer.checkpointer.store.root, run_key, trainer.ranks.world)
    model = model.to("cpu")
    if adapted:  # the adapters alone beside the model, then the model with them merged
        save_adapter_dir(
            model, out_dir, adapter_spec(trainer.cfg, trainer.checkpointer.base_sha256, init)
        )
        dequantize_base(model)  # QLoRA: the merge adds to the weights the adapters trained on
        merge_adapters(model)
    else:  # a full run where an adapter run wrote before: its adapters no longer apply
        for name in ("adapter.safetensors", "adapter.json"):
            (out_dir / name).unlink(missing_ok=True)
    save_stage_model(model, out_dir, init)
    write_metrics_csv(out_dir)
    return result
