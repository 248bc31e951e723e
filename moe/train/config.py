"""The training sections: what every training stage shares (`OptimConfig`: steps, batches, the
optimiser, devices, processes, the method), pretraining's and finetuning's own, and early
stopping (moe/train/trainer.py, early_stop.py, optim.py, ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moe.adapters.config import LoraConfig
from moe.config import DEVICE, Problems, knob


@dataclass
class EarlyStopConfig:
    """Early stopping (moe/train/early_stop.py): composite score, lr-scaled patience, cost-aware stop."""

    patience: int = knob(
        0, ge=0, note=" (0 = off)"
    )  # evaluations without improvement before stopping, at the initial lr; 0 = off
    min_delta: float = knob(0.001, ge=0)  # an improvement smaller than this does not count
    util_weight: float = knob(
        0.5, ge=0
    )  # composite = val_loss + util_weight * (1 - expert utilisation)
    value_per_loss: float = (
        knob(
            0.0, ge=0, note=" (0 = off)"
        )  # currency value of lowering val loss by 1.0; 0 = no cost-aware stop
    )
    trend_window: int = knob(3, ge=2)  # evaluations fitted to project the remaining improvement


@dataclass
class OptimConfig:
    """What every training stage shares: steps and batches, the optimiser, where and how it
    runs, how often it logs and saves, and on how many processes and machines."""

    max_steps: int = knob(300, ge=1)  # optimizer steps of the stage
    batch_size: int = knob(16, ge=1)  # sequences per step (over all processes)
    grad_accum: int = knob(1, ge=1)  # micro-batches whose gradients make one step
    lr: float = knob(2e-3, gt=0)  # peak learning rate (AdamW)
    warmup_steps: int = knob(30, ge=0)  # linear warm-up to lr over this many steps
    weight_decay: float = knob(0.1, ge=0)  # AdamW weight decay (not on norms, biases or embeddings)
    beta1: float = knob(0.9, ge=0, lt=1)  # AdamW beta1
    beta2: float = knob(0.95, ge=0, lt=1)  # AdamW beta2
    grad_clip: float = knob(
        1.0, ge=0, note=" (0 = no clipping)"
    )  # max_norm (2.0 is a common choice under bf16)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    # Where it trains: auto (a GPU when there is one), cpu, cuda or cuda:N.
    device: str = knob("auto", pattern=DEVICE, note="auto, cpu, cuda or cuda:N")
    seed: int = 1337  # model init, data order and dropout
    # Steps between metrics rows (W&B, metrics.jsonl, the progress bar). Across several
    # processes the ranks also agree there on the training time and on a stop asked for
    # from outside: keep log_every steps well inside a spot machine's notice.
    log_every: int = knob(10, ge=1)
    # Steps between checkpoints (with checkpoint.every: stage).
    checkpoint_every: int = knob(100, ge=1)
    # Above 0: stop after this many seconds of training; the lr decay follows the time used when
    # that is ahead of the steps, so the run still ends annealed. 0 = max_steps only. Across
    # several processes the time moves at metrics rows (log_every): the stop may come up to
    # log_every steps late, and the time-based lr holds between rows.
    time_budget_s: float = knob(0.0, ge=0, note=" (0 = off)")
    # Processes on this machine (torchrun: data parallel + expert parallel); moe.num_experts
    # and batch_size must divide by it. 0 = one per GPU of the stage's pool
    # (pools.definitions.POOL.gpus; one where the machine turns out to have no GPU).
    nproc: int = knob(0, ge=0, note=" (0 = one per GPU of the pool)")
    # Above one process the dense blocks are sharded over all of them (FSDP2) and the experts
    # over groups of this many (expert parallelism: each holds num_experts / this of them).
    # It must divide the world size and moe.num_experts; 0 = all the processes, 1 = experts
    # sharded with the dense blocks, no token exchange.
    expert_parallel: int = knob(0, ge=0, note=" (0 = all the processes)")
    # Recompute each block's activations in the backward instead of keeping them: less
    # memory for longer sequences or larger batches, about a third more compute.
    activation_checkpoint: bool = False
    # Compile each block with torch.compile (regional compilation, as torchtitan): the blocks
    # share one compiled program, compiled in seconds rather than the whole model's minutes;
    # fused kernels for what runs between the products. Worth it on a GPU; on a CPU the
    # compile costs more than it saves in a short stage.
    compile: bool = False
    # Machines this stage spans, each with the processes above (world size = nodes x
    # processes). Above 1 the stage's flow run launches a Kubernetes Indexed Job of that many
    # pods (tasks/multinode.py, the `multinode` section); data, the start model and the
    # checkpoints reach every node through the object store.
    nodes: int = knob(1, ge=1)
    # What trains: "full" (every weight, AdamW state for all of them), "lora" (low-rank
    # adapters on a frozen base: the `lora` section) or "qlora" (the same on a base stored in
    # 4-bit NF4). The adapted model is merged into the stage's model folder when it ends, so
    # the next stage, `ask` and the export read it as any model; the adapters alone are kept
    # beside it (adapter.safetensors) for `model export`'s PEFT folder.
    method: Literal["full", "lora", "qlora"] = "full"  # what trains
    lora: LoraConfig = field(default_factory=LoraConfig)  # the adapters of lora and qlora
    # The routers under this stage: "trained" (gate weights learn, the aux-free bias moves),
    # "frozen" (nothing moves: a narrow domain cannot collapse the routing the base learned),
    # "bias-only" (only the aux-free bias moves, so the load still balances). "auto": frozen
    # under lora and qlora (as PEFT, which does not adapt routers), trained under full.
    router: Literal["auto", "trained", "frozen", "bias-only"] = "auto"  # what routing moves

    def router_policy(self) -> str:
        """The router policy this stage runs with ("auto" resolved)."""
        if self.router != "auto":
            return self.router
        return "trained" if self.method == "full" else "frozen"


@dataclass
class PretrainConfig(OptimConfig):
    """Pretraining: warm-up + cosine decay to min_lr, validation, early stopping."""

    min_lr: float = knob(2e-4, ge=0)  # the cosine decay ends here
    eval_every: int = knob(100, ge=1)  # steps between validation losses
    eval_batches: int = knob(8, ge=1)  # batches per validation
    # Stop when the validation loss stops improving.
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)

    def check(self, p: Problems) -> None:
        p.require(self.min_lr <= self.lr, "min_lr", self.min_lr, f"must be <= lr ({self.lr})")


@dataclass
class FinetuneConfig(OptimConfig):
    """Supervised finetuning on prompt -> SQL pairs: linear decay, loss on response tokens."""

    max_steps: int = knob(900, ge=1)  # optimizer steps of the stage
    # Peak learning rate (AdamW); on finetune_sql 2e-3 beat 3e-3 over 3 seeds (bench/RESULTS.md).
    lr: float = knob(2e-3, gt=0)
    warmup_steps: int = knob(10, ge=0)  # linear warm-up to lr over this many steps
    weight_decay: float = knob(0.0, ge=0)  # AdamW weight decay
    # Steps between checkpoints (with checkpoint.every: stage).
    checkpoint_every: int = knob(50, ge=1)
    max_len: int = knob(
        192, ge=8
    )  # prompt + response tokens; prepare fits every example to it or refuses (moe/sql/fitting.py)
    # Pack examples into rows of max_len tokens, each example attending only to itself (a
    # block-causal mask, positions restarting), so that a step computes no padding and every
    # step has one shape; batch_size is then the examples a step holds in expectation.
    # false: one example a row, padded to the step's longest.
    packing: bool = True
    # Rows of pretraining text added to each batch, as a fraction of batch_size (replay:
    # keeps the model from forgetting what pretraining taught it).
    replay_ratio: float = knob(0.25, ge=0, le=4)
    # Where replay rows come from: "train" (the pretraining text itself, ~1M tokens on the
    # default: no row is seen twice) or "replay" (the split held back from pretraining by
    # data.replay_fraction; ~55k tokens on the default, so a long finetune memorises it and
    # forgets the rest: bench/RESULTS.md).
    replay_split: Literal["train", "replay"] = "train"
    # The share of each batch's SQL rows drawn from the stage before's pairs instead of this
    # stage's (finetune_domain: the generic SQL pairs), so that the domain stage keeps what
    # the SQL stage taught; 0 = this stage's pairs alone. In expectation: rows are drawn at
    # random, the batch size stays.
    replay_pairs: float = knob(0.0, ge=0, lt=1)
    focus_weight: float = knob(2.0, gt=0)  # loss weight of focus tokens (below)
    # The SQL keywords, and the digits: the numbers of a question must be copied exactly, and
    # mis-copied digits were the errors left (weighting them lifted the domain accuracy over
    # three seeds from 0.83 to 0.95 and the weakest seed from 0.715 to 0.855: bench/RESULTS.md).
    focus_tokens: list[str] = field(
        default_factory=lambda: [
            *("SELECT", "WHERE", "JOIN", "GROUP", "ORDER", "COUNT", "LIMIT"),
            *"0123456789",
        ]
    )
