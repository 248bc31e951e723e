"""The adapters' section: LoRA and QLoRA (moe/adapters/lora.py, nf4.py), and what a training
section must say for the adapters to be applied to it (`Adapted`: its method, its lora section
and its router policy; moe/train/config.py `OptimConfig` is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from moe.config import knob


@dataclass
class LoraTargets:
    """Which projections carry adapters (moe/adapters/lora.py). All on by default: the QLoRA
    paper and LLaMA-Factory's `all` found adapters on every linear layer needed to match full
    finetuning; attention only (the original LoRA paper) learns less per step."""

    attention: bool = True  # q, k, v and the output projection
    mlp: bool = True  # the dense blocks' SwiGLU (gate, up, down)
    shared_expert: bool = True  # the MoE layers' shared expert (gate, up, down)
    # The routed experts' 3-D weights: one low-rank pair per expert and projection, computed
    # through the same grouped dispatch as the experts (PEFT's `target_parameters`).
    experts: bool = True  # the routed experts, through the grouped dispatch


@dataclass
class LoraConfig:
    """Low-rank adapters for `method: lora | qlora`: W x + (alpha / rank) B A x with B = 0 at
    the start (PEFT's and torchtune's rule), the base frozen. Rank 8 with alpha 16 (a scale of
    2) is LLaMA-Factory's and torchtune's default; dropout 0 is Unsloth's and LLaMA-Factory's."""

    rank: int = knob(8, ge=1)  # the adapters' rank r
    alpha: float = knob(16.0, gt=0)  # scale = alpha / rank
    dropout: float = knob(0.0, ge=0, lt=1)  # on the adapters' input only
    targets: LoraTargets = field(default_factory=LoraTargets)  # where adapters go
    # The routed experts' rank: "same" gives every expert `rank`; "divided" gives each
    # rank // num_experts (at least 1), so all experts together hold about one adapter's
    # parameters (PEFT's advice for `target_parameters`, whose rank is per expert).
    expert_rank: Literal["same", "divided"] = "same"  # each routed expert's rank
    train_embeddings: bool = False  # the token embeddings stay frozen unless asked
    train_head: bool = False  # the output head stays frozen unless asked
    # QLoRA: the frozen base in NF4 (torchao), this many weights per quantisation block
    # (64: the QLoRA paper's and torchao's default); adapters in fp32, compute in bf16 on CUDA.
    nf4_block: int = knob(64, ge=16)  # weights per NF4 block (QLoRA)


class Adapted(Protocol):
    """A training section as the adapters read it (moe/train/config.py `OptimConfig`)."""

    method: str  # full, lora or qlora
    lora: LoraConfig
    seed: int
    device: str
    dtype: str

    def router_policy(self) -> str: ...
