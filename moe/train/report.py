"""What a run of the trainer reports (moe/train/trainer.py `Trainer.fit`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from moe.model.stats import summarize


@dataclass
class TrainResult:
    steps: int
    resumed_from: int | None
    train_loss: float
    val_loss: float | None
    tokens: int
    wall_s: float
    stop_reason: str
    checkpoint: str
    tokens_per_s: float
    expert_share: list[list[float]] = field(default_factory=list)
    expert_cv: float = 0.0
    expert_events: list[dict[str, Any]] = field(default_factory=list)  # growth / pruning
    experts_per_layer: list[int] = field(default_factory=list)
    # Interruptions survived, their cost and goodput; the checkpoint interval and its inputs.
    resilience: dict[str, Any] = field(default_factory=dict)
    # The process group it trained in: "nccl" or "gloo" and how many processes ("" and 1 alone)
    backend: str = ""
    world: int = 1


def report(
    trainer: Any,
    run: Any,
    stop_reason: str,
    path: Path | None,
    val_loss: float | None,
    resilience: dict[str, Any],
) -> TrainResult:
    """What a run of Trainer.fit reports (`run`: its _Run)."""
    total = summarize(trainer.state.load.total)
    progress = trainer.state.progress
    return TrainResult(
        steps=progress.step,
        resumed_from=run.resumed,
        train_loss=float(run.last_loss),
        val_loss=val_loss,
        tokens=progress.tokens,
        wall_s=progress.elapsed_s,
        stop_reason=stop_reason,
        checkpoint=str(path) if path else "",
        tokens_per_s=progress.tokens / max(progress.elapsed_s, 1e-9),
        expert_share=total["share"],  # type: ignore[arg-type]
        expert_cv=float(total["cv"]),  # type: ignore[arg-type]
        expert_events=trainer.expert_events,
        experts_per_layer=trainer.model.experts_per_layer(),
        resilience=resilience,
        backend=str(dist.get_backend()) if dist.is_initialized() else "",
        world=trainer.ranks.world,
    )
