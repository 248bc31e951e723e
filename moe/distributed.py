"""Data parallel + expert parallel training on torch.distributed (NCCL on GPUs, gloo on CPUs).

Experts spread evenly over the ranks, tokens exchanged with all_to_all.

- Dense parameters (attention, norms, embeddings, routers, shared experts) are replicated;
  their gradients are averaged over ranks with one all-reduce of a flat buffer.
- Each rank holds num_experts / world_size experts (rank r: global ids r*E_l .. r*E_l+E_l-1).
  After routing, each rank sorts its assignments by global expert id and sends each rank the
  rows for that rank's experts (`all_to_all_single` with uneven splits); the owner computes
  them with the same grouped GEMM and sends the results back. Autograd runs through both
  exchanges (`_AllToAll`), so an expert's gradient sums every rank's tokens; it is divided by
  the world size like the dense gradients (the loss is a mean over ranks).
- The routers' load counts are all-reduced before the aux-free bias and the utilisation
  average move, so every rank routes identically.
- Checkpoints hold every expert under its global id (gathered from the ranks): a checkpoint
  written at world size 2 restores at world size 1 and the other way round.

Shape suffixes as in moe/experts.py; R = rows received from all ranks.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from moe.experts import GroupedExperts, grouped_mm, swiglu
from moe.model import MoETransformer


def init(timeout_s: float = 60.0, device: str = "auto") -> tuple[int, int]:
    """Join the process group torchrun describes (env://); (rank, world size). NCCL when the
    training device (`pretrain.device`: auto, cpu, cuda) is a GPU, else gloo, so a CPU run on a
    machine that has GPUs stays on gloo. A peer that never arrives or dies fails within
    timeout_s."""
    if not dist.is_initialized():
        on_gpu = device != "cpu" and torch.cuda.is_available()
        backend = "nccl" if on_gpu else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return dist.get_rank(), dist.get_world_size()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:  # type: ignore[override]
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        gin = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gin, g.contiguous(), in_splits, out_splits)
        return gin, None, None


class ExpertParallelExperts(GroupedExperts):
    """This rank's slice of a layer's experts; computes every rank's tokens for them."""

    def __init__(self, full: GroupedExperts, rank: int, world: int) -> None:
        E = full.num_experts
        if E % world:
            raise ValueError(
                f"moe.num_experts={E} does not divide over {world} processes: pick a process "
                "count that divides it"
            )
        local = E // world
        d_model = full.w13_EDG.shape[1]
        super().__init__(local, d_model, full.hidden)
        self.num_experts = E  # routing ids are global
        self.num_local, self.rank, self.world = local, rank, world
        lo = rank * local
        with torch.no_grad():
            self.w13_EDG.copy_(full.w13_EDG[lo : lo + local])
            self.w2_EFD.copy_(full.w2_EFD[lo : lo + local])

    def compute(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        W, El = self.world, self.num_local
        send_WEl = counts_E.view(W, El)
        recv_WEl = torch.empty_like(send_WEl)
        dist.all_to_all_single(recv_WEl, send_WEl.contiguous())  # who sends me what
        in_splits = send_WEl.sum(1).tolist()  # sizes must be on the host for the exchange
        out_splits = recv_WEl.sum(1).tolist()
        x_RD = _AllToAll.apply(x_AD, out_splits, in_splits)
        # Received rows come by source rank, then by local expert: regroup by local expert.
        local_R = torch.repeat_interleave(
            torch.arange(El, device=x_AD.device).repeat(W), recv_WEl.flatten()
        )
        perm_R = torch.sort(local_R, stable=True).indices
        counts_El = recv_WEl.sum(0)
        offs_El = torch.cumsum(counts_El, 0, dtype=torch.int32)
        h = grouped_mm(x_RD[perm_R], self.w13_EDG, offs_El, counts_El)
        y_sorted = grouped_mm(swiglu(h), self.w2_EFD, offs_El, counts_El)
        y_RD = torch.empty_like(y_sorted).index_copy(0, perm_R, y_sorted)
        return _AllToAll.apply(y_RD, in_splits, out_splits)


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def shard_experts(model: MoETransformer, rank: int, world: int) -> MoETransformer:
    """Replace every MoE layer's experts by this rank's slice (in place; returns the model)."""
    if world == 1:
        return model
    for layer in model.moe_layers:
        if not isinstance(layer.experts, ExpertParallelExperts):
            layer.experts = ExpertParallelExperts(layer.experts, rank, world)
    return model


def _params(model: torch.nn.Module, expert: bool) -> Iterator[torch.nn.Parameter]:
    for name, p in model.named_parameters():
        if is_expert_param(name) == expert and p.grad is not None:
            yield p


def sync_gradients(model: torch.nn.Module, world: int) -> None:
    """Average gradients over ranks: dense ones by one all-reduce of a flat buffer; expert
    ones already hold every rank's tokens (through the exchange) and are only scaled."""
    if world == 1:
        return
    dense = [p.grad for p in _params(model, expert=False)]
    if dense:
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in dense:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    for p in _params(model, expert=True):
        p.grad.div_(world)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, world: int) -> float:
    """Global gradient norm over replicated dense and sharded expert parameters; clips in
    place like torch.nn.utils.clip_grad_norm_ and returns the norm before clipping."""
    dense_sq = sum((p.grad.float().pow(2).sum() for p in _params(model, False)), torch.zeros(()))
    expert_sq = sum((p.grad.float().pow(2).sum() for p in _params(model, True)), torch.zeros(()))
    if world > 1:
        expert_sq = expert_sq.to(next(model.parameters()).device)
        dist.all_reduce(expert_sq)
        expert_sq = expert_sq.cpu()
    total = float((dense_sq.cpu() + expert_sq).sqrt())
    if max_norm > 0 and total > max_norm:
        scale = max_norm / (total + 1e-6)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    return total


def sync_routing_load(model: MoETransformer, world: int) -> None:
    """Sum every router's load over ranks before `update_routing` (identical routing)."""
    if world == 1:
        return
    for layer in model.moe_layers:
        dist.all_reduce(layer.router.load_E)


def _gather_experts(t: torch.Tensor, world: int) -> torch.Tensor:
    """Concatenate every rank's slice along dim 0 (NCCL gathers on the GPU; the result
    comes back on t's device)."""
    dev = t.device
    if dist.get_backend() == "nccl":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=0).to(dev)


def full_state(
    tensors: dict[str, torch.Tensor], world: int, names: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Tensors with every expert under its global id: expert slices are gathered from all
    ranks (every rank must call this). `names` maps a tensor name to its parameter's name
    (identity for model tensors; the optimizer's index -> name for optimizer state)."""
    if world == 1:
        return tensors
    out = {}
    for key, t in tensors.items():
        pname = names.get(key, key)
        out[key] = _gather_experts(t, world) if is_expert_param(pname) and t.dim() >= 1 else t
    return out


def local_slice(
    tensors: dict[str, torch.Tensor], rank: int, world: int, names: dict[str, str]
) -> dict[str, torch.Tensor]:
    """Inverse of full_state: this rank's slice of every expert tensor of a checkpoint
    written at any world size."""
    if world == 1:
        return tensors
    out = {}
    for key, t in tensors.items():
        pname = names.get(key, key)
        if is_expert_param(pname) and t.dim() >= 1:
            local = t.shape[0] // world
            out[key] = t[rank * local : (rank + 1) * local].clone()
        else:
            out[key] = t
    return out
