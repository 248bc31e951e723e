"""Where training runs: the device and its autocast, this process's rank among the world, the
sharded engine's meshes (FSDP2 + expert parallelism under torchrun, moe/train/distributed.py),
and the few collectives the loop needs (this rank's rows of a batch, a mean over ranks)."""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe.model.buffers import init_buffers
from moe.model.experts import prepare_compile
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.config import OptimConfig

log = logging.getLogger(__name__)


def resolve_device(name: str, setting: str = "pretrain.device") -> torch.device:
    """auto: the GPU when there is one, else the CPU; `setting` names the knob in errors."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"{setting}={name!r} but CUDA is not available on this machine; use auto or cpu"
        )
    return torch.device(name)


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; on CPU only when asked (`dtype: bfloat16`), with a
    warning where the CPU has no bf16 instructions (`cpu_bf16_native`)."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        if device.type == "cpu" and not cpu_bf16_native():
            log.warning(
                "dtype: bfloat16 on a CPU without bf16 instructions (no AVX512-BF16 or AMX):"
                " oneDNN emulates them (a SmolLM2-135M training step ran 28x slower than in"
                " float32 on an AVX2 EPYC; bench/cpu_bf16.py measures this CPU); set the"
                " stage's dtype to auto or float32 on this machine"
            )
        return torch.bfloat16
    return None


@functools.cache
def cpu_bf16_native() -> bool:
    """Whether this CPU computes bf16 natively (oneDNN's own check: AVX512-BF16 or AMX)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Ranks:
    """The device, the rank and world size, and the meshes when the model is sharded."""

    def __init__(self, cfg: OptimConfig) -> None:
        self.device = resolve_device(cfg.device)
        # Under torchrun: data parallel + expert parallel. Each rank trains on its rows of
        # every global batch and holds 1/world of the experts.
        self.rank, self.world = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        )
        self.amp_dtype = autocast_dtype(self.device, cfg.dtype)
        self.meshes: D.Meshes | None = None

    def place(self, model: MoETransformer, cfg: OptimConfig, weights: Path | None) -> None:
        """Put the model where it trains. Under torchrun (even one process: the GPU path of
        tests/test_cuda.py) it is sharded (FSDP2 + expert parallelism); a model built on the
        meta device then fills its shards only, from `weights` (a safetensors file in the
        model's names) or with the initialisation one process would draw after the same
        seed. A plain run trains the module as it is."""
        if getattr(cfg, "compile", False):  # before sharding, as torchtitan orders them
            prepare_compile(self.device)
            for block in model.blocks:
                block.compile()
        if dist.is_initialized():
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
            meta = D.on_meta(model)
            if not meta:
                model.to(self.device)
            ep = D.expert_degree(cfg.expert_parallel, self.world, model.mcfg.num_experts)
            self.meshes = D.make_meshes(self.device, ep)
            # bf16 (on CUDA by default, on CPU when asked): FSDP gathers bf16, reduces fp32.
            bf16 = self.amp_dtype == torch.bfloat16
            D.parallelize(model, self.meshes, param_dtype=torch.bfloat16 if bf16 else None)
            if meta:
                model.to_empty(device=self.device)
                init_buffers(model)
                if weights is not None:
                    D.load_safetensors(model, weights)
                else:
                    D.init_like_one_process(model)
            for layer in model.moe_layers:  # the balancing loss enters through each block
                layer.aux_grad_scale = 1.0 / cfg.grad_accum
                layer.router.balance_group = dist.group.WORLD  # of the global batch
        if getattr(cfg, "activation_checkpoint", False):
            for block in model.blocks:
                block.recompute = True
            for layer in model.moe_layers:  # the balancing loss inside the recomputed block
                layer.aux_grad_scale = 1.0 / cfg.grad_accum
        model.to(self.device)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def rows(self, batch: tuple) -> tuple:
        """This rank's rows of a global batch (all of it at world size 1)."""
        if self.world == 1:
            return batch
        x = batch[0]
        if x.shape[0] % self.world:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split over {self.world} processes: "
                "make batch_size (plus replay rows when finetuning) a multiple of the process count"
            )
        n = x.shape[0] // self.world
        lo = self.rank * n
        return tuple(None if t is None else t[lo : lo + n] for t in batch)

    def to_device(self, batch: tuple) -> tuple:
        """This rank's rows of a global batch on the device: (x, y, loss weights or None, the
        flat positions whose target carries loss, the loss tokens of the whole global batch,
        each token's example in a packed row or None).
        What the batch says is read on the host, where it is (numpy: no device op), so that
        the device is never asked (moe/model/transformer.py `loss_rows`)."""
        n_tok = int(np.count_nonzero(batch[1].cpu().numpy() != -100))
        x, y, w, *packed = self.rows(batch)
        flat = np.flatnonzero(y.cpu().numpy().reshape(-1) != -100)
        move = self.copy_to_device
        w = None if w is None else move(w)
        seg = move(packed[0]) if packed else None
        return move(x), move(y), w, move(torch.from_numpy(flat)), n_tok, seg

    def copy_to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device. To a GPU through pinned memory, without waiting: a
        copy from pageable memory blocks until the GPU's queued work is done (the caching host
        allocator keeps the pinned buffer until its copy has run). Made contiguous first: a
        strided view (a sampler's x = t[:, :-1]) keeps its strides when pinned, and its copy
        then goes through an unpinned contiguous temporary, which may wait."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of `t` over ranks."""
        if self.world == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t / self.world

    def agree_max(self, seconds: float) -> float:
        """Ranks agree on a time (lr under a time budget, cost-aware stop): the largest."""
        if self.world == 1:
            return seconds
        t = torch.tensor([seconds], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(t, 0)
        return int(t)

    def reduce_micro(
        self, loss: torch.Tensor, counts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A micro-batch's loss (mean over ranks) and expert counts (summed), in one small
        all-reduce, left on the device (read once per metrics row, not per step)."""
        if self.world == 1:  # float64, as the host summed the values it read before
            return loss.detach().float().double(), counts
        packed = torch.cat([loss.detach().float().reshape(1), *[c.float() for c in counts]])
        dist.all_reduce(packed)
        counts = list(packed[1:].view(len(counts), -1)) if counts else []
        return packed[0].double() / self.world, counts
