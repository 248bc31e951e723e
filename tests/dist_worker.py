"""Worker for tests/test_distributed.py, launched by torchrun (gloo, CPU).

`python -m torch.distributed.run --standalone --nproc_per_node N tests/dist_worker.py MODE OUT`

MODE step: one training step on rows [rank*b, (rank+1)*b) of a fixed global batch; rank 0
           writes the loss and the full (gathered) state to OUT.
MODE ckpt: restore OUT/ckpt_w1 (written at world size 1) sliced for this rank, gather it back
           and check it equals the checkpoint; then train one step and write a checkpoint at
           this world size to OUT/ckpt_wN.
MODE die:  rank 1 exits hard in the middle of the first step; rank 0 must fail, not hang.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from moe import distributed as D
from moe.checkpoint import (
    CheckpointStore,
    flatten_optimizer,
    model_tensors,
    unflatten_optimizer,
)
from moe.config import ModelConfig, MoEConfig
from moe.model import MoETransformer

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 64


def build() -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=SEQ, dense_hidden=64),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32, balancing=["aux_free", "z_loss"]),
        VOCAB,
    )


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)


def param_names(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    flat = [p for g in opt.param_groups for p in g["params"]]
    out = {}
    for i, p in enumerate(flat):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{i}.{k}"] = names[id(p)]
    return out


def step(model: MoETransformer, opt: torch.optim.Optimizer, rank: int, world: int) -> float:
    rows = GLOBAL_BATCH // world
    idx = batch()[rank * rows : (rank + 1) * rows]
    model.set_routing_step(1000, 0.5)
    _, loss, aux = model(idx, idx)
    (loss + aux.balance_loss).backward()
    D.sync_gradients(model, world)
    D.clip_grad_norm(model, 1.0, world)
    opt.step()
    opt.zero_grad()
    D.sync_routing_load(model, world)
    model.update_routing(1)
    total = (loss + aux.balance_loss).detach().reshape(1)
    if world > 1:
        torch.distributed.all_reduce(total)
    return float(total) / world


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    rank, world = D.init(timeout_s=20, device="cpu")  # gloo on CPU tensors, GPU or not
    model = D.shard_experts(build(), rank, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if mode == "step":
        loss = step(model, opt, rank, world)
        full = D.full_state(model_tensors(model), world, {})
        if rank == 0:
            save_file(full, str(out / f"step_w{world}.safetensors"))
            (out / f"step_w{world}.json").write_text(json.dumps({"loss": loss}))
    elif mode == "ckpt":
        store = CheckpointStore(out / "ckpt_w1")
        ck = store.load(store.latest_valid())
        # Build the optimizer state first (one step), then overwrite it from the checkpoint.
        step(model, opt, rank, world)
        names = param_names(model, opt)
        model.load_state_dict(D.local_slice(ck.model, rank, world, {}), strict=False)
        opt.load_state_dict(
            unflatten_optimizer(
                D.local_slice(ck.optimizer, rank, world, names), ck.state["optimizer"]
            )
        )
        back = D.full_state(model_tensors(model), world, {})
        for k, v in ck.model.items():
            assert torch.equal(back[k], v), f"rank {rank}: {k} differs after restore"
        opt_t, _ = flatten_optimizer(opt.state_dict())
        back_opt = D.full_state(opt_t, world, names)
        for k, v in ck.optimizer.items():
            assert torch.equal(back_opt[k], v), f"rank {rank}: optimizer {k} differs"
        step(model, opt, rank, world)
        full = D.full_state(model_tensors(model), world, {})
        opt_t, rest = flatten_optimizer(opt.state_dict())
        full_opt = D.full_state(opt_t, world, names)
        if rank == 0:
            CheckpointStore(out / f"ckpt_w{world}").save(
                2, full, full_opt, {}, {"step": 2, "optimizer": rest}
            )
    elif mode == "die":
        if rank == 1:
            os._exit(3)  # a machine that disappears: no exception, no goodbye
        step(model, opt, rank, world)
    if world > 1:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
