"""What a training run is, wherever it runs: the fingerprint that decides whether a
checkpoint is resumed, and the metrics a run in other processes (torchrun ranks, the pods of
a multi-node Job) wrote, replayed where the flow run is. A leaf of tasks/: the launchers
(tasks/launch.py, tasks/multinode.py) and the training tasks all read it, and it imports
none of them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from moe.hashing import sha256_file
from tasks.config import Config


def resumable(cfg: Config, section: str) -> Config:
    """The config as far as resuming cares: the process and machine counts are not part of a
    training state (checkpoints hold every expert under its global id), so changing them
    resumes."""
    sec = getattr(cfg, section)
    return dataclasses.replace(cfg, **{section: dataclasses.replace(sec, nproc=0, nodes=1)})


def training_fingerprint(
    cfg: Config, stage: str, data_dir: Path, init_dir: Path | None = None
) -> str:
    """What a checkpoint must have been trained with to be resumed by `stage`: the stage's
    hyper-parameters (pretrain: model, moe and pretrain; a finetune stage: its own section), the
    prepared data (its meta.json, which holds every split's sha256) and, for a finetune stage,
    the model it starts from. The process and machine counts are left out (see resumable)."""
    if stage == "pretrain":
        parts = [resumable(cfg, "pretrain").fingerprint("model", "moe", "pretrain")]
    elif init_dir is None:
        raise ValueError(f"{stage}: a finetune stage's fingerprint needs the model it starts from")
    else:
        parts = [
            resumable(cfg, stage).fingerprint(stage),
            sha256_file(init_dir / "model.safetensors"),
        ]
    return ":".join([*parts, sha256_file(data_dir / "meta.json")])


def replay_metrics(
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Send the metrics rows a run in other processes wrote (metrics.jsonl) to log_fn (W&B)
    and `on_row` (the events, which its ranks, outside the flow run, could not emit)."""
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line:
                row = json.loads(line)
                log_fn(row)
                if on_row is not None:
                    on_row(row)
