"""Sharded training on torch.distributed: FSDP2 for the dense blocks, expert parallelism for
the experts, both on DeviceMeshes (NCCL on GPUs, gloo on CPUs).

The layout follows torchtitan's (`apply_fsdp`, `apply_moe_ep_tp`):

- World size W, expert-parallel degree P (a divisor of W and of the expert count; default W).
  Two meshes: the 1-D data-parallel mesh over all W ranks, and the 2-D expert mesh
  ("dp_mod_ep", "ep") of shape (W/P, P).
- Dense parameters (attention, norms, embeddings, routers, shared experts) are `fully_shard`ed
  over the data-parallel mesh, one FSDP unit per block plus the root: each rank holds 1/W of
  them and of their AdamW moments; a block's parameters are all-gathered for its forward and
  backward and its gradients reduce-scattered as the backward goes (overlapped with compute).
  On CUDA in bf16 the all-gathers move bf16 and the reduction runs in fp32
  (`MixedPrecisionPolicy`).
- With P > 1 each MoE layer's experts are DTensors sharded along the expert dim over "ep"
  (`Shard(0)`, global shape (E, D, 2F)) and replicated over "dp_mod_ep": rank r of an EP group
  holds E/P whole experts. Routed rows go to the rank owning their expert and come back
  through `all_to_all_single_autograd` (uneven splits), so an expert's gradient sums the
  tokens of its whole EP group; it is then summed over "dp_mod_ep" and divided by W, the
  gradient divide factor of a loss that is a mean over ranks. With P = 1 the experts are
  ordinary parameters of their block's FSDP unit.
- Gradient clipping sums the squared norms of every rank's local shards (a replicated shard
  counted once) in one all-reduce, so the norm is the one world size 1 computes.
- The routers' load counts are all-reduced before the aux-free bias moves, so every rank
  routes identically.

State: every parameter is a DTensor whose global shape is the unsharded one, so a sharded
checkpoint (moe/checkpoint/sharded.py, through torch.distributed.checkpoint) restores at any world size
and any expert-parallel degree, and `full_tensors` gathers the whole model only for the final
export. World size 1 never comes here: it trains the plain module.

Shape suffixes as in moe/model/experts.py; R = rows received from the EP group.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from moe.model.experts import GroupedExperts, expert_swiglu
from moe.model.transformer import MoETransformer, init_parameter_


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


def single_node() -> bool:
    """True when every rank of the process group runs on this machine (torchrun's
    LOCAL_WORLD_SIZE equals the world size): the ranks share one checkpoint folder."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world


@dataclass
class Meshes:
    """The data-parallel mesh (all ranks) and the expert mesh ("dp_mod_ep", "ep")."""

    world: int
    ep: int
    dp: DeviceMesh
    experts: DeviceMesh

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.experts.get_group("ep")

    @property
    def dp_mod_ep_group(self) -> dist.ProcessGroup:
        return self.experts.get_group("dp_mod_ep")


def expert_degree(requested: int, world: int, num_experts: int) -> int:
    """The expert-parallel degree: `requested` (0 = every rank) checked against the world
    size and the expert count, with a message naming the knob."""
    ep = requested or world
    if world % ep:
        raise ValueError(
            f"expert_parallel={ep} does not divide the {world} processes: pick a divisor "
            f"of {world} (0 = all of them)"
        )
    if num_experts % ep:
        raise ValueError(
            f"moe.num_experts={num_experts} does not divide over {ep} processes: pick a process "
            "count (or expert_parallel) that divides it"
        )
    return ep


def make_meshes(device: torch.device, ep: int) -> Meshes:
    world = dist.get_world_size()
    kind = device.type
    return Meshes(
        world=world,
        ep=ep,
        dp=init_device_mesh(kind, (world,), mesh_dim_names=("dp",)),
        experts=init_device_mesh(kind, (world // ep, ep), mesh_dim_names=("dp_mod_ep", "ep")),
    )


class ExpertParallelExperts(GroupedExperts):
    """A layer's experts as DTensors sharded over the EP group; computes every EP rank's
    tokens for the experts this rank holds."""

    def __init__(self, full: GroupedExperts, meshes: Meshes) -> None:
        torch.nn.Module.__init__(self)
        E, ep = full.num_experts, meshes.ep
        if E % ep:
            raise ValueError(
                f"moe.num_experts={E} does not divide over {ep} processes: pick a process "
                "count that divides it"
            )
        self.num_experts, self.hidden = E, full.hidden  # routing ids are global
        self.num_local, self.ep = E // ep, ep
        self.lora = None
        self.group = meshes.ep_group
        for name in ("w13_EDG", "w2_EFD"):
            setattr(self, name, _expert_shard(getattr(full, name), meshes))
        self.act = full.act  # gpt-oss: the clamped SwiGLU, and a bias per expert (sharded)
        self.b13_EG = self.b2_ED = None
        if full.b13_EG is not None:
            self.b13_EG = _expert_shard(full.b13_EG, meshes)
            self.b2_ED = _expert_shard(full.b2_ED, meshes)
        if full.lora is not None:  # the adapters follow their experts (moe/adapters/lora.py)
            self.lora = full.lora
            for name, p in list(full.lora.named_parameters()):
                setattr(self.lora, name, _expert_shard(p, meshes))

    def compute(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        P, El = self.ep, self.num_local
        w13, w2 = self.w13_EDG.to_local(), self.w2_EFD.to_local()
        send_PEl = counts_E.view(P, El)
        recv_PEl = torch.empty_like(send_PEl)
        dist.all_to_all_single(recv_PEl, send_PEl.contiguous(), group=self.group)
        in_splits = send_PEl.sum(1).tolist()  # sizes must be on the host for the exchange
        out_splits = recv_PEl.sum(1).tolist()
        x_RD = all_to_all_single_autograd(x_AD.contiguous(), out_splits, in_splits, self.group)
        # Received rows come by source rank, then by local expert: regroup by local expert.
        local_R = torch.repeat_interleave(
            torch.arange(El, device=x_AD.device).repeat(P), recv_PEl.flatten()
        )
        perm_R = torch.sort(local_R, stable=True).indices
        b13, b2 = (
            (None, None) if self.b13_EG is None else (self.b13_EG.to_local(), self.b2_ED.to_local())
        )
        y_sorted = expert_swiglu(
            x_RD[perm_R], w13, w2, recv_PEl.sum(0), self.lora, b13, b2, self.act
        )
        y_RD = torch.empty_like(y_sorted).index_copy(0, perm_R, y_sorted)
        return all_to_all_single_autograd(y_RD, in_splits, out_splits, self.group)


def _expert_shard(p: torch.Tensor, meshes: Meshes) -> torch.nn.Parameter:
    """An (E, ...) expert tensor sharded by expert over the EP group (replicated across the
    groups), keeping whether it trains."""
    placements = (Replicate(), Shard(0))
    t = p.detach()
    if t.is_meta:  # shapes only: this rank's experts, filled after `to_empty`
        part = t.chunk(meshes.ep, dim=0)[meshes.experts.get_local_rank("ep")]
        local = DTensor.from_local(part, meshes.experts, placements, run_check=False)
    else:  # every rank holds the same full tensor: each keeps its part, no traffic
        local = distribute_tensor(t, meshes.experts, placements, src_data_rank=None)
    return torch.nn.Parameter(local, requires_grad=p.requires_grad)


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def parallelize(
    model: MoETransformer,
    meshes: Meshes,
    *,
    param_dtype: torch.dtype | None = None,
) -> MoETransformer:
    """Shard `model` in place (it must already be on its device): experts over the EP mesh
    when ep > 1, then one FSDP unit per block and the root over the data-parallel mesh.
    `param_dtype` (bf16 on CUDA) is what FSDP all-gathers and computes in; gradients are
    reduced in fp32."""
    expert_params: set[torch.nn.Parameter] = set()
    if meshes.ep > 1:
        for layer in model.moe_layers:
            if not isinstance(layer.experts, ExpertParallelExperts):
                layer.experts = ExpertParallelExperts(layer.experts, meshes)
            expert_params.update(layer.experts.parameters())
    # cast_forward_inputs=False: autocast casts what each op computes in. FSDP's own cast of
    # a block's arguments would rebuild the MoEAux collector (a dataclass) and its lists, so
    # the block would record its routing into a copy, and round the rotary tables to bf16.
    mp = MixedPrecisionPolicy(
        param_dtype=param_dtype,
        reduce_dtype=torch.float32 if param_dtype else None,
        cast_forward_inputs=False,
    )
    blocks = list(model.blocks)
    if param_dtype is not None:
        # The routers score in fp32 from fp32 weights (moe/model/routing.py): a unit of their own
        # that gathers them unrounded.
        fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
        for layer in model.moe_layers:
            fully_shard(layer.router, mesh=meshes.dp, mp_policy=fp32)
    for i, block in enumerate(blocks):
        # The last block is gathered again at once by the backward: keep it gathered.
        fully_shard(
            block,
            mesh=meshes.dp,
            mp_policy=mp,
            ignored_params=expert_params or None,
            reshard_after_forward=i < len(blocks) - 1,
        )
    fully_shard(model, mesh=meshes.dp, mp_policy=mp, ignored_params=expert_params or None)
    if meshes.ep > 1 and len(blocks) > 1:
        # The token exchange waits for its sizes on the host, which would hold back the next
        # block's all-gather behind it: issue it explicitly, one block ahead (torchtitan does
        # the same when EP is on).
        for prev, nxt in zip(blocks, blocks[1:], strict=False):
            prev.set_modules_to_forward_prefetch([nxt])
            nxt.set_modules_to_backward_prefetch([prev])
    return model


def expert_parameters(model: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The parameters FSDP leaves alone: the EP-sharded experts."""
    for layer in getattr(model, "moe_layers", []):
        if isinstance(layer.experts, ExpertParallelExperts):
            yield from layer.experts.parameters()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def finish_expert_gradients(model: torch.nn.Module, meshes: Meshes) -> None:
    """After the backward: an EP expert's gradient holds its EP group's tokens; sum it over
    the other groups and divide by the world size (FSDP did the same for the dense ones)."""
    for p in expert_parameters(model):
        if p.grad is None:
            continue
        g = _local(p.grad)
        if meshes.world // meshes.ep > 1:
            dist.all_reduce(g, group=meshes.dp_mod_ep_group)
        g.div_(meshes.world)


def _replicas(t: torch.Tensor, world: int) -> int:
    """On how many ranks the same local values sit (a plain tensor: on all of them)."""
    if not isinstance(t, DTensor):
        return world
    mesh = t.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The gradient norm of the whole (unsharded) model from every rank's shards, in one
    all-reduce; clips in place like torch.nn.utils.clip_grad_norm_ and returns the norm
    before clipping, where it was reduced (never read on the host: no sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    world = dist.get_world_size()
    # Summed where the gradients are (no host sync per tensor on a GPU); NCCL reduces on
    # the GPU, gloo on the CPU.
    nccl = dist.get_backend() == "nccl"
    device = (
        _local(grads[0]).device
        if grads
        else torch.device("cuda", torch.cuda.current_device())
        if nccl
        else torch.device("cpu")
    )
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        sq += _local(g).double().pow(2).sum() / _replicas(g, world)
    if not nccl:
        sq = sq.cpu()
    dist.all_reduce(sq)
    total = sq.sqrt()
    if 0 < max_norm < math.inf:
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0).to(device)
        for g in grads:
            _local(g).mul_(scale)
    return total


def sync_routing_load(model: MoETransformer, world: int) -> None:
    """Sum every router's load over ranks before `update_routing` (identical routing)."""
    if world == 1:
        return
    for layer in model.moe_layers:
        dist.all_reduce(layer.router.load_E)


def unique_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() with tied parameters once (the first name, as model_tensors)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = (t.to_local() if isinstance(t, DTensor) else t).data_ptr()
        if key in seen and t.numel() > 0:
            continue
        seen.add(key)
        out[name] = t
    return out


def full_tensors(tensors: dict[str, torch.Tensor], keep: bool = True) -> dict[str, torch.Tensor]:
    """Every DTensor gathered whole, on the CPU (every rank must call this; those with
    keep=False drop the result as they go, so only the writer holds the full copy)."""
    out = {}
    for key, t in tensors.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if keep:
            out[key] = full.to("cpu").contiguous()
    return out


@torch.no_grad()
def load_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of a whole tensor (which every rank holds) into `target`, a
    DTensor or a plain tensor: no communication."""
    if isinstance(target, DTensor):
        part = distribute_tensor(
            full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(part.to_local())
    else:
        target.copy_(full)


def on_meta(model: torch.nn.Module) -> bool:
    """True for a model built under `torch.device("meta")`: shapes only, no storage."""
    return any(p.is_meta for p in model.parameters())


@torch.no_grad()
def init_like_one_process(model: MoETransformer) -> None:
    """Fresh weights for a model sharded on the meta device, equal to what building it in one
    process gives after the same `torch.manual_seed`: the default initialisation each
    nn.Linear and nn.Embedding draws while the model is built is drawn again (a twin module
    on the CPU, one at a time), then every parameter's `reset_parameters` draw, whole, of
    which this rank keeps its part. At most one whole parameter is in memory at a time."""
    for m in model.modules():  # construction order is registration order in this model
        if isinstance(m, torch.nn.Linear):
            torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
        elif isinstance(m, torch.nn.Embedding):
            torch.nn.Embedding(m.num_embeddings, m.embedding_dim)
    adapters = getattr(model, "adapter_init", {})  # LoRA: as drawn (moe/adapters/lora.py)
    for name, p in model.named_parameters():
        if name in adapters:
            load_full(p, adapters[name])
            continue
        full = torch.ones(p.shape)  # what a norm is built with; the rest is drawn over it
        init_parameter_(name, full, model.cfg)
        load_full(p, full)


@torch.no_grad()
def load_safetensors(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Each rank reads its part of every tensor straight from a safetensors file (memory
    mapped: only the rows of its shards are read), so the model never exists whole in one
    process. Tied weights are read once; every parameter must be in the file, except the
    adapters of a LoRA stage, which take the values they were drawn with (moe/adapters/lora.py
    `adapter_init`)."""
    from safetensors import safe_open
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    adapters = getattr(model, "adapter_init", {})
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        buffers = {n for n, _ in model.named_buffers()}
        for name, t in unique_state(model).items():
            if name in adapters:
                load_full(t, adapters[name])
                continue
            if name not in keys:
                if name in buffers:
                    continue  # routing state a file may predate: keeps its default
                raise ValueError(f"{path} has no tensor {name} for the model")
            if isinstance(t, DTensor):
                shape, offset = compute_local_shape_and_global_offset(
                    t.shape, t.device_mesh, t.placements
                )
                index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                part = f.get_slice(name)[index] if all(shape) else None
                if part is not None:
                    t.to_local().copy_(part.to(t.dtype))
            else:
                t.copy_(f.get_tensor(name).to(t.dtype))
