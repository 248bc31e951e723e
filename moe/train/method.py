"""What a stage trains (`method: full | lora | qlora`) and what its routers may move.

`apply_method` turns a model loaded for a stage into the model that stage trains: unchanged
for full finetuning; for LoRA, the base frozen and adapters added (moe/model/lora.py); for
QLoRA, the same over a base whose large matrices are stored in 4-bit NF4
(moe/model/quant.py). The router policy applies to every method.
"""

from __future__ import annotations

import logging

import torch

from moe.config import OptimConfig
from moe.model.lora import AdapterPlan, add_adapters, quantize_base, set_router_policy
from moe.model.transformer import MoETransformer

log = logging.getLogger(__name__)


def apply_method(model: MoETransformer, cfg: OptimConfig, stage: str) -> AdapterPlan | None:
    """Adapters (and NF4 for qlora) per `cfg.method`, then the router policy. Returns where
    the adapters went, or None for full finetuning."""
    plan = None
    if cfg.method in ("lora", "qlora"):
        plan = add_adapters(model, cfg.lora, seed=cfg.seed)
        if cfg.method == "qlora":
            quantize_base(model, cfg.lora.nf4_block)
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


def trainable_bytes(model: torch.nn.Module) -> int:
    """Bytes of what trains: the parameters with gradients, their gradients and AdamW's two
    moments (fp32 each)."""
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return n * 4 * 4
