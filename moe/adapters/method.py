"""What a stage trains (`method: full | lora | qlora`) and what its routers may move.

`apply_method` turns a model loaded for a stage into the model that stage trains: unchanged
for full finetuning; for LoRA, the base frozen and adapters added (moe/adapters/lora.py); for
QLoRA, the same over a base whose large matrices are stored in 4-bit NF4
(moe/adapters/nf4.py). The router policy applies to every method.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from moe.adapters.config import Adapted
from moe.adapters.lora import (
    AdapterPlan,
    add_adapters,
    hold_base_in,
    quantize_base,
    set_router_policy,
)
from moe.model.transformer import MoETransformer

log = logging.getLogger(__name__)


def apply_method(model: MoETransformer, cfg: Adapted, stage: str) -> AdapterPlan | None:
    """Adapters (and NF4 for qlora) per `cfg.method`, then the router policy. Returns where
    the adapters went, or None for full finetuning."""
    plan = None
    if cfg.method in ("lora", "qlora"):
        plan = add_adapters(model, cfg.lora, seed=cfg.seed)
        if cfg.method == "qlora":
            quantize_base(model, cfg.lora.nf4_block)
        elif (dtype := frozen_dtype(cfg)) is not None:
            freed = hold_base_in(model, dtype)
            log.info("%s: the frozen base in %s (%.2f GB less)", stage, dtype, freed / 1e9)
        log.info(
            "%s: %s on %d projections and %d expert layers: %s trainable parameters, %s frozen",
            stage,
            cfg.method,
            len(plan.linears),
            len(plan.expert_layers),
            f"{plan.trainable:,}",
            f"{plan.frozen:,}",
        )
    policy = cfg.router_policy()
    set_router_policy(model, policy)
    if plan is not None:
        # gate weights that learn count as trainable (set_router_policy decides them)
        plan.trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return plan


def frozen_dtype(cfg: Adapted) -> torch.dtype | None:
    """The dtype LoRA holds its frozen base in: bf16 where the stage computes under bf16
    autocast on a GPU in one process (the sharded engine gathers one dtype per unit and keeps
    fp32 weights); None (as loaded, fp32) elsewhere, so CPU runs stay bit-identical."""
    if cfg.method != "lora" or dist.is_initialized() or not torch.cuda.is_available():
        return None
    on_gpu = cfg.device == "auto" or cfg.device.startswith("cuda")  # as moe/train/ranks.py
    return torch.bfloat16 if on_gpu and cfg.dtype in ("auto", "bfloat16") else None


def trainable_bytes(model: torch.nn.Module) -> int:
    """Bytes of what trains: the parameters with gradients, their gradients and AdamW's two
    moments (fp32 each)."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return n * 4 * 4
