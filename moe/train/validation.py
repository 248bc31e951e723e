"""The held-out loss: what picks the best checkpoint and drives early stopping while
training, and a trained model's perplexity on the validation split."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from moe.model.transformer import MoETransformer
from moe.train.ranks import Ranks

# (x, y, loss weights or None), and for packed rows each token's example (moe/data/tokens.py)
Batch = tuple[torch.Tensor, ...]


class BatchSource(Protocol):
    def batch_at(self, step: int, micro: int = 0) -> Batch: ...


@dataclass
class Validation:
    """The held-out loss: `batches` batches of `source` every `every` steps (and at the last
    step). It picks the best checkpoint and drives early stopping."""

    source: BatchSource
    every: int
    batches: int


@torch.no_grad()
def validation_loss(
    model: MoETransformer, validation: Validation | None, ranks: Ranks
) -> float | None:
    """The mean loss over the validation batches (over ranks), or None without them."""
    v = validation
    if v is None or not v.batches:
        return None
    model.eval()
    losses = []
    for i in range(v.batches):
        x, y, w, *packed = ranks.rows(v.source.batch_at(0, i))
        with ranks.autocast():
            _, loss, _ = model(
                x.to(ranks.device),
                y.to(ranks.device),
                None if w is None else w.to(ranks.device),
                logits=False,
                segments_BS=packed[0].to(ranks.device) if packed else None,
            )
        losses.append(float(ranks.mean(loss.detach().float())))
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def perplexity(model: MoETransformer, sampler: BatchSource, batches: int) -> dict[str, float]:
    """Mean loss over `batches` fixed windows of the validation split, and its exp."""
    model.eval()
    device = model.embed.weight.device
    losses = []
    for i in range(batches):
        x, y, _ = sampler.batch_at(0, i)
        _, loss, _ = model(x.to(device), y.to(device), logits=False)
        losses.append(float(loss))
    mean = sum(losses) / len(losses)
    return {"loss": mean, "perplexity": math.exp(min(mean, 50))}
