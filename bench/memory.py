"""What one rank holds, and what a save costs in host memory, at world size 1 and 2, on the
sharded engine (FSDP2 + expert parallelism, moe/train/distributed.py) against the replicated
engine it replaced (every rank the whole dense model and its AdamW state, a flat all-reduce
of the dense gradients, every rank gathering the whole state at each save).

Each configuration runs in its own processes (torchrun, gloo, 2 processes for world 2):

- `state`: bytes this rank holds in parameters, gradients (after the backward, before they
  are cleared) and AdamW moments: what the sharding saves, exactly (local shards counted).
- `save`: the rise of the process's peak resident memory during one synchronous save
  (`/proc/self/clear_refs` resets the peak first), over the whole state's size (fp32
  parameters + moments). The sharded save encodes its own shards; the replicated engine
  gathered every expert and moment on every rank first.
- `step`: median time of a training step after a warm-up.

The baseline is the analytic one: one rank's shard of the world-1 state (1/world of it).
With `--replaced COMMIT` the replicated engine is measured beside it too, launched
alternately (A B A B ...) from that commit's `moe/distributed.py` (`git show`, run from a
temporary module; ae9b444 is the last commit that has it): it needs the repository's history
and that file's imports, which later moves broke, so it is not the default.

The JSON object printed last has `per_rank_state_ratio` (world 2 over world 1, sharded;
target <= 0.6, one shard: 0.5), `save_host_ratio` (peak host memory of a world-2 save over
the full state; target: one rank's shard, about 0.5), `one_shard` (the analytic figure),
`step_time_ratio` (world 2 over world 1), and with `--replaced` the same for that engine.

Run: `.venv/bin/python bench/memory.py [--quick]`. Per-rank formulas for 1B, 7B and 30B MoEs
on 8 GPUs follow from the measured bytes per parameter (see bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REPLACED = "ae9b444"  # the last commit with the replicated engine (then moe/distributed.py)


def _config(quick: bool):
    from moe.model.config import ModelConfig, MoEConfig

    d = 192 if quick else 256
    return (
        ModelConfig(n_layer=4, n_head=4, d_model=d, seq_len=128, dense_hidden=4 * d),
        MoEConfig(num_experts=8, top_k=2, expert_hidden=2 * d, balancing=["aux_free", "z_loss"]),
        4096,
    )


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """Hand freed heap back to the system (glibc keeps it resident, and a save reusing it
    would not show), then reset the peak resident size to the current one."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def _nbytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def worker(engine: str, quick: bool, steps: int, out: Path) -> None:
    import torch.distributed as dist

    from moe.checkpoint.store import CheckpointStore
    from moe.model.transformer import MoETransformer

    torch.manual_seed(0)
    mcfg, ecfg, vocab = _config(quick)
    model = MoETransformer(mcfg, ecfg, vocab)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = 0
    if world > 1:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
    if engine == "replaced":
        spec = importlib.util.spec_from_file_location("replaced_engine", out / "replaced.py")
        R = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(R)
        R.shard_experts(model, rank, world)
    elif world > 1:
        from moe.train import distributed as D

        meshes = D.make_meshes(torch.device("cpu"), D.expert_degree(0, world, ecfg.num_experts))
        D.parallelize(model, meshes)
        for layer in model.moe_layers:
            layer.aux_grad_scale = 1.0
    # Each engine's optimizer as its trainer builds it (moe/train/optim.py build_optimizer): the
    # fused kernel, over DTensor shards or whole tensors (figures before be91c05: foreach/per tensor).
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    batch = 8 // world
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (8, mcfg.seq_len + 1), generator=g)[
        rank * batch : (rank + 1) * batch
    ]
    times, held = [], {}
    for step in range(steps):
        t0 = time.perf_counter()
        _, loss, aux = model(x[:, :-1], x[:, 1:], logits=False)
        (loss + aux.balance_loss).backward()
        if world > 1 and engine == "replaced":
            R.sync_gradients(model, world)
            R.clip_grad_norm(model, 1.0, world)
        elif world > 1:
            D.finish_expert_gradients(model, meshes)
            D.clip_grad_norm(list(model.parameters()), 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 0:
            held = {
                "params": sum(_nbytes(p) for p in model.parameters()),
                "grads": sum(_nbytes(p.grad) for p in model.parameters() if p.grad is not None),
                "moments": sum(
                    _nbytes(v) for st in opt.state.values() for k, v in st.items() if k != "step"
                ),
            }
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    # One synchronous save, its peak host memory measured from a reset.
    store = CheckpointStore(out / f"ckpt-{engine}-{world}", background=False, hot_level=1)
    names = {id(p): n for n, p in model.named_parameters()}
    import gc

    gc.collect()
    _reset_peak()
    before = _vm("VmRSS")
    if engine == "replaced":
        from moe.checkpoint.tensors import flatten_optimizer, model_tensors

        opt_t, rest = flatten_optimizer(opt.state_dict())
        flat = [p for grp in opt.param_groups for p in grp["params"]]
        opt_names = {k: names[id(flat[int(k.split(".")[0])])] for k in opt_t}
        full_m = R.full_state(model_tensors(model), world, {})
        full_o = R.full_state(opt_t, world, opt_names)
        if rank == 0:
            store.save(1, full_m, full_o, {}, {"step": 1, "optimizer": rest})
    elif world > 1:
        tensors = {f"model.{k}": v for k, v in D.unique_state(model).items()}
        for p, st in opt.state.items():
            for k, v in st.items():
                tensors[f"optim.{names[id(p)]}.{k}"] = v
        tensors[f"rng.{rank}.torch"] = torch.get_rng_state()
        store.save_sharded(1, tensors, {"step": 1})
    else:
        from moe.checkpoint.tensors import flatten_optimizer, model_tensors

        opt_t, rest = flatten_optimizer(opt.state_dict())
        store.save(1, model_tensors(model), opt_t, {}, {"step": 1, "optimizer": rest})
    save_rise = _vm("VmHWM") - before
    # The same save as training makes it: asynchronous (a copy to host memory first, then
    # the writes on a thread), waited for.
    async_rise = 0
    if engine == "sharded":
        store = CheckpointStore(out / f"ckpt-async-{world}", background=True, hot_level=1)
        gc.collect()
        _reset_peak()
        before = _vm("VmRSS")
        if world > 1:
            store.save_sharded(2, tensors, {"step": 2})
        else:
            store.save(2, model_tensors(model), opt_t, {}, {"step": 2, "optimizer": rest})
        store.flush()
        async_rise = _vm("VmHWM") - before
    n_params = sum(p.numel() for p in MoETransformer(mcfg, ecfg, vocab).parameters())
    row = {
        "engine": engine,
        "world": world,
        "rank": rank,
        "held": held,
        "save_rise": save_rise,
        "async_save_rise": async_rise,
        "full_state": n_params * 12,  # fp32 parameters + two fp32 moments
        "n_params": n_params,
        "step_s": statistics.median(times[2:]) if len(times) > 2 else times[-1],
    }
    (out / f"{engine}-{world}-{rank}.json").write_text(json.dumps(row))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _launch(engine: str, world: int, quick: bool, steps: int, out: Path) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, 2 // world))}
    args = [__file__, "--worker", engine, "--steps", str(steps), "--out", str(out)]
    args += ["--quick"] if quick else []
    if world == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={world}", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{engine} at world {world} failed:\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{engine}-{world}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3, help="A B rounds of the world-2 step time")
    ap.add_argument(
        "--replaced", metavar="COMMIT", help=f"also the replicated engine of COMMIT ({REPLACED})"
    )
    ap.add_argument("--worker", choices=["sharded", "replaced"])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker, a.quick, a.steps, a.out)
        return
    engines = ("sharded", "replaced") if a.replaced else ("sharded",)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        if a.replaced:
            src = subprocess.run(
                ["git", "show", f"{a.replaced}:moe/distributed.py"],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if src.returncode:
                sys.exit(f"--replaced needs that commit's moe/distributed.py: {src.stderr.strip()}")
            (out / "replaced.py").write_text(src.stdout)
        one = _launch("sharded", 1, a.quick, a.steps, out)[0]
        rows: dict[str, list[dict]] = {e: [] for e in engines}
        for _ in range(a.rounds):  # interleaved: A B A B ...
            for engine in engines:
                rows[engine].append(_launch(engine, 2, a.quick, a.steps, out))
    total1 = sum(one["held"].values())

    def per_rank(engine: str) -> float:
        return max(sum(r["held"].values()) for r in rows[engine][0]) / total1

    def save_ratio(engine: str) -> float:
        return max(r["save_rise"] for r in rows[engine][0]) / one["full_state"]

    def step(engine: str) -> float:
        return statistics.median(max(r["step_s"] for r in launch) for launch in rows[engine])

    for engine in engines:
        for r in rows[engine][0]:
            print(
                f"{engine:8s} world 2 rank {r['rank']}: params {r['held']['params'] / 2**20:.1f} MiB, "
                f"grads {r['held']['grads'] / 2**20:.1f} MiB, moments {r['held']['moments'] / 2**20:.1f} MiB; "
                f"save +{r['save_rise'] / 2**20:.1f} MiB host"
            )
    print(
        f"world 1: {one['n_params'] / 1e6:.1f}M parameters, held {total1 / 2**20:.1f} MiB, "
        f"save +{one['save_rise'] / 2**20:.1f} MiB host, full state {one['full_state'] / 2**20:.1f} MiB"
    )
    result = {
        "n_params": one["n_params"],
        "one_shard": 0.5,
        "per_rank_state_ratio": round(per_rank("sharded"), 3),
        "save_host_ratio": round(save_ratio("sharded"), 3),
        "world1_save_host_ratio": round(one["save_rise"] / one["full_state"], 3),
        "async_save_host_ratio": round(
            max(r["async_save_rise"] for r in rows["sharded"][0]) / one["full_state"], 3
        ),
        "world1_async_save_host_ratio": round(one["async_save_rise"] / one["full_state"], 3),
        "step_s_world1": round(one["step_s"], 4),
        "step_s_sharded_world2": round(step("sharded"), 4),
        "step_time_ratio": round(step("sharded") / one["step_s"], 3),
    }
    if a.replaced:
        result |= {
            "replaced_per_rank_state_ratio": round(per_rank("replaced"), 3),
            "replaced_save_host_ratio": round(save_ratio("replaced"), 3),
            "step_s_replaced_world2": round(step("replaced"), 4),
            "replaced_step_time_ratio": round(step("sharded") / step("replaced"), 3),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
