"""The optimizer and its schedule: AdamW's parameter groups, the learning rate at a step, and
the optimizer state as checkpoints hold it (whole, or this rank's shards by parameter name)."""

from __future__ import annotations

import math
from typing import Literal

import torch

from moe.model.transformer import MoETransformer
from moe.train.config import OptimConfig


def build_optimizer(
    model: MoETransformer, cfg: OptimConfig, router_lr_mult: float
) -> torch.optim.AdamW:
    """AdamW groups: decayed matrices, undecayed norms/biases, and the routers at a higher lr.
    The fused kernel on every device (the CPU's too, and DTensor shards): one multi-tensor
    op per group, its step counters where the parameters are (no host read per step), and
    `found_inf`, which skips a diverged step on the device (moe/train/stop.py Divergence)."""
    decay, no_decay, router = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".router." in name:
            router.append(p)
        elif p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_mult": 1.0, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0, "name": "no_decay"},
        # routers learn 3-5x faster than the base rate; no weight decay on them.
        {"params": router, "weight_decay": 0.0, "lr_mult": router_lr_mult, "name": "router"},
    ]
    groups = [g for g in groups if g["params"]]
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=bool(params) or None
    )


def lr_at(
    step: int,
    max_steps: int,
    lr: float,
    warmup: int,
    min_lr: float,
    schedule: Literal["cosine", "linear"],
) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr + (min_lr - lr) * min(1.0, progress)


class LrSchedule:
    """Warm-up, then cosine (pretraining) or linear decay (finetuning) to `min_lr`. Under a
    time budget the schedule follows whichever is further along, the steps or the training
    time used, so a run cut by its budget still ends its decay."""

    def __init__(
        self, cfg: OptimConfig, schedule: Literal["cosine", "linear"], min_lr: float
    ) -> None:
        self.cfg, self.schedule, self.min_lr = cfg, schedule, min_lr

    def schedule_step(self, step: int, elapsed_s: float) -> int:
        """The step the schedule reads."""
        cfg = self.cfg
        budget = cfg.time_budget_s
        if budget <= 0 or step < cfg.warmup_steps:
            return step
        frac = min(1.0, elapsed_s / budget)
        return max(step, cfg.warmup_steps + int(frac * (cfg.max_steps - cfg.warmup_steps)))

    def set(self, optimizer: torch.optim.Optimizer, step: int, elapsed_s: float) -> float:
        """Set every group's lr for this step (times its multiplier); returns the base lr."""
        cfg = self.cfg
        lr = lr_at(
            self.schedule_step(step, elapsed_s),
            cfg.max_steps,
            cfg.lr,
            cfg.warmup_steps,
            self.min_lr,
            self.schedule,
        )
        for g in optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
        return lr


def param_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """Optimizer state index -> parameter name (torch numbers params across groups)."""
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    return {str(i): names.get(id(p), "") for i, p in enumerate(flat)}


def optimizer_shards(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, by_name: bool = False
) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's optimizer moments ("<index>.<moment>", or "optim.<parameter>.<moment>"
    with by_name) and the JSON rest (param groups), as flatten_optimizer gives them."""
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for g in optimizer.param_groups for p in g["params"]]
    tensors: dict[str, torch.Tensor] = {}
    for i, p in enumerate(flat):
        for k, v in optimizer.state.get(p, {}).items():
            tensors[f"optim.{names[id(p)]}.{k}" if by_name else f"{i}.{k}"] = v
    groups = optimizer.state_dict()["param_groups"]
    return tensors, {"param_groups": groups, "scalars": {}}


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's state before its first step (zeros, step 0), so a restore has tensors of the
    right shards to read into."""
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p not in optimizer.state or not optimizer.state[p]:
                optimizer.state[p] = {
                    # the fused kernel keeps its step counter where the parameter is
                    "step": torch.zeros((), dtype=torch.float32, device=p.device),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
