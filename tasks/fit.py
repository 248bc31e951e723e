"""Pools chosen by what fits: a training stage's weights and trainable state per method
(moe/train/memory.py) against the GPUs of each defined pool. tasks/config.py refuses a stage
that cannot fit its pool and resolves `pools.stages.<stage>: auto`; `moe-pipeline plan`
prints the table. A leaf of tasks/: it takes sections and pools, not the Config.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moe.model.config import ModelConfig, MoEConfig
from moe.train.config import OptimConfig

if TYPE_CHECKING:
    from moe.train.memory import StateBytes

METHODS = ("full", "lora", "qlora")


def model_vocab(model: ModelConfig, tokenizer_vocab: int) -> int:
    """The embedding rows of the stage's model: model.init's (its model.json or config.json),
    else the tokenizer's vocabulary."""
    if model.init:
        folder = Path(model.init)
        for name, key in (("model.json", "vocab_size"), ("config.json", "vocab_size")):
            try:
                value = json.loads((folder / name).read_text()).get(key)
            except (OSError, json.JSONDecodeError):
                continue
            if isinstance(value, int):
                return value
    return tokenizer_vocab


@dataclass(frozen=True)
class PoolFit:
    pool: str
    gpus_needed: int  # GPUs of this pool's kind that hold the state
    machines: int  # machines of the pool that give them
    fits: bool  # within what the stage's processes and nodes give on this pool
    per_hour: float  # machines x the pool's rate


def needs(
    model: ModelConfig, moe: MoEConfig, vocab: int, sec: OptimConfig, method: str = ""
) -> StateBytes:
    """Weights and trainable state of `method` (the stage's own by default), and its
    micro-batch's activations split over n GPUs: batch_size (plus replay rows) / grad_accum
    rows of max_len (a finetune) or seq_len tokens, a loss at every position (an upper
    bound for a finetune), 2 bytes each under bf16 (the default on a GPU), else 4; under bf16
    what stays fp32 and what autocast adds to the weights counted as moe/train/memory.py
    says."""
    # torch (the model on the meta device): imported here, so that loading a configuration
    # that checks no pool's fit (the CLI's help, lineage, the stack's status) starts at once
    from moe.train.memory import activation_bytes, state_bytes

    amp = not (sec.dtype == "float32" or sec.device == "cpu")
    state = state_bytes(model, moe, vocab, method or sec.method, sec.lora, amp=amp)
    replay = getattr(sec, "replay_ratio", 0.0)
    rows = sec.batch_size + (max(1, round(sec.batch_size * replay)) if replay > 0 else 0)
    seq = getattr(sec, "max_len", model.seq_len)
    width = 4 if sec.dtype == "float32" or sec.device == "cpu" else 2

    def activations(n: int) -> float:
        per = max(1, math.ceil(rows / sec.grad_accum / n))
        return activation_bytes(model, moe, vocab, per, seq, 1.0, width, amp=amp)

    return dataclasses.replace(state, activations=activations)


def pool_fits(state: StateBytes, sec: OptimConfig, pools: dict[str, Any]) -> list[PoolFit]:
    """Each GPU pool that declares its GPUs' memory: the GPUs the state needs there and
    whether the stage's processes give them (nproc 0: one per GPU of a machine; x nodes)."""
    out = []
    for name, pool in pools.items():
        if not pool.gpus or not pool.gpu_memory_gib:
            continue
        need = state.gpus_needed(pool.gpu_memory_gib)
        per_machine = sec.nproc or pool.gpus
        machines = max(1, math.ceil(need / pool.gpus))
        fits = need <= min(per_machine, pool.gpus) * sec.nodes
        if state.single_process:  # QLoRA: one GPU or none
            fits = need == 1
        out.append(PoolFit(name, need, machines, fits, round(machines * pool.rate, 4)))
    return out


def cheapest(fits: list[PoolFit]) -> PoolFit | None:
    """Of the pools where the stage fits as configured, the lowest hourly price."""
    ok = [f for f in fits if f.fits]
    return min(ok, key=lambda f: (f.per_hour, f.pool)) if ok else None


def refusal(
    stage: str,
    model: ModelConfig,
    moe: MoEConfig,
    vocab: int,
    sec: OptimConfig,
    pool_name: str,
    pools: dict[str, Any],
) -> str | None:
    """Why `stage` cannot hold its weights and trainable state on its pool's GPUs, naming
    the pools and methods that would; None when it fits (or the pool declares no GPU
    memory, or the stage runs on the CPU)."""
    pool = pools[pool_name]
    if sec.device == "cpu" or not pool.gpus or not pool.gpu_memory_gib:
        return None
    state = needs(model, moe, vocab, sec)
    fits = pool_fits(state, sec, pools)
    mine = next(f for f in fits if f.pool == pool_name)
    if mine.fits:
        return None
    other_pools = [f.pool for f in fits if f.fits]
    adaptable = stage != "pretrain" or bool(model.init)  # adapters need a pretrained model
    other_methods = [
        m
        for m in METHODS
        if m != sec.method
        and adaptable
        and next(
            f
            for f in pool_fits(needs(model, moe, vocab, sec, m), sec, pools)
            if f.pool == pool_name
        ).fits
    ]
    given = min(sec.nproc or pool.gpus, pool.gpus) * sec.nodes
    return (
        f"{stage} ({sec.method}) holds {state.total / 1e9:.1f} GB of weights and trainable "
        f"state, and {(state.per_gpu(1) - state.total - state.one_process) / 1e9:.2f} GB of"
        f" activations ({signed_gb(state.one_process)} GB under autocast) on one GPU:"
        " "
        f"{mine.gpus_needed} GPU(s) of {pool.gpu_memory_gib:g} GiB on {pool_name}, which "
        f"gives it {given}. Would fit: pools {', '.join(other_pools) or 'none'} as it is; "
        f"methods {', '.join(other_methods) or 'none'} on {pool_name}; or more nodes"
    )


def signed_gb(n_bytes: float, width: int = 0) -> str:
    """Bytes as signed GB to 2 places, never "-0.00" (a few bytes under zero)."""
    return f"{round(n_bytes / 1e9, 2) + 0.0:+{width}.2f}"
