"""What a training stage holds in GPU memory besides activations, by method, from the
model's shapes alone (a model on the meta device: nothing is allocated or drawn).

- weights: fp32 (the trainer keeps fp32 weights and computes under bf16 autocast on CUDA),
  QLoRA's adapted projections in NF4 (4 bits, an int8 scale per block, an fp32 scale per
  256 blocks);
- trainable state: each trained parameter's gradient and AdamW's two moments (fp32).

Sharded over the stage's processes (FSDP2 for dense weights, expert parallelism for the
experts), each GPU holds its share. Activations are not predicted: `HEADROOM` of each GPU is
left for them, the allocator and communication buffers (bench/RESULTS.md, "LoRA and QLoRA").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe.config import LoraConfig, ModelConfig, MoEConfig
from moe.model.lora import adapter_counts
from moe.model.transformer import MoETransformer

HEADROOM = 0.85  # of a GPU's memory for weights and trainable state
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)  # per weight: codes, block scales, their scales


@dataclass(frozen=True)
class StateBytes:
    """Bytes of one whole copy of a stage's weights and trainable state."""

    params: int  # the model's parameters
    trainable: int  # parameters that train (adapters, or all of them)
    weights: float
    trainable_state: float  # gradients + AdamW moments of the trainable parameters
    single_process: bool = False  # QLoRA: its NF4 base is not sharded

    @property
    def total(self) -> float:
        return self.weights + self.trainable_state

    def gpus_needed(self, gpu_memory_gib: float) -> int:
        """GPUs of this memory that hold it sharded evenly, HEADROOM of each used."""
        return max(1, math.ceil(self.total / (gpu_memory_gib * 2**30 * HEADROOM)))


def state_bytes(
    model_cfg: ModelConfig, moe_cfg: MoEConfig, vocab: int, method: str, lora: LoraConfig
) -> StateBytes:
    """What `method` ("full", "lora", "qlora") holds for this architecture."""
    with torch.device("meta"):
        model = MoETransformer(model_cfg, moe_cfg, vocab)
    params = model.num_params()
    if method == "full":
        return StateBytes(params, params, 4.0 * params, 12.0 * params)
    adapters, adapted = adapter_counts(model, lora)
    trainable = adapters
    if lora.train_embeddings:
        trainable += model.embed.weight.numel()
    if lora.train_head and not model_cfg.tie_embeddings:
        trainable += model.lm_head.weight.numel()
    base = 4.0 * (params - adapted) + (NF4_BYTES if method == "qlora" else 4.0) * adapted
    return StateBytes(
        params + adapters,
        trainable,
        base + 4.0 * adapters,
        12.0 * trainable,
        single_process=method == "qlora",
    )
