"""Training throughput of the sharded engine on GPUs: a ~100M-active-parameter MoE (12 layers,
d_model 768, 16 experts of width 1024, top-2; 32k vocabulary) in bf16 on FSDP2 (+ expert
parallelism over the processes), the real Trainer with its checkpoints, on random tokens.

Prints tokens/s and model FLOP utilisation (training FLOPs per token from
`MoETransformer.flops_per_token`, over the GPU's dense bf16 peak: 989 TFLOP/s for an H100 or
H200 SXM unless --peak-tflops says otherwise), then a JSON line.

Run (one GPU; more with --nproc_per_node):
`python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/gpu_train.py --steps 300`
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from moe.checkpoint.store import CheckpointStore
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.config import PretrainConfig
from moe.train.trainer import Trainer

VOCAB = 32768


class RandomTokens:
    def __init__(self, batch: int, seq: int) -> None:
        self.batch, self.seq = batch, seq

    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.Generator().manual_seed(step * 97 + micro)
        x = torch.randint(0, VOCAB, (self.batch, self.seq + 1), generator=g)
        return x[:, :-1], x[:, 1:], None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="sequences per step, all ranks")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--layers", type=int, default=12)
    a = ap.parse_args()
    rank, world = D.init(timeout_s=300, device=a.device)
    torch.manual_seed(0)
    mcfg = ModelConfig(n_layer=a.layers, n_head=12, d_model=768, seq_len=a.seq, dense_hidden=3072)
    ecfg = MoEConfig(num_experts=16, top_k=2, expert_hidden=1024)
    with torch.device("meta"):
        model = MoETransformer(mcfg, ecfg, VOCAB)
    active, total = model.num_params(active_only=True), model.num_params()
    flops = model.flops_per_token()
    cfg = PretrainConfig(
        max_steps=a.steps,
        batch_size=a.batch,
        lr=3e-4,
        warmup_steps=20,
        log_every=10,
        checkpoint_every=100,
        device=a.device,
    )
    rows: list[dict] = []
    # One checkpoint folder for all ranks (each writes its shards into it).
    where = [tempfile.mkdtemp(prefix="gpu-bench-") if rank == 0 else ""]
    dist.broadcast_object_list(where, src=0)
    tmp = where[0]
    trainer = Trainer(
        model,
        cfg,
        RandomTokens(a.batch, a.seq),
        CheckpointStore(Path(tmp) / "ckpt", background=True),
        fingerprint="gpu-bench",
        schedule="cosine",
        log_fn=rows.append,
    )
    result = trainer.fit()
    trainer.checkpointer.store.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    tps = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r][2:]  # after warm-up
    tok_s = statistics.median(tps) if tps else result.tokens_per_s
    mfu = flops * tok_s / (a.peak_tflops * 1e12 * world)
    peak = torch.cuda.max_memory_allocated() if a.device == "cuda" else 0
    if rank == 0:
        gpu = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        print(
            f"{gpu} x{world}: {active / 1e6:.0f}M active / {total / 1e6:.0f}M parameters, "
            f"{tok_s:,.0f} tokens/s, MFU {mfu:.1%} (bf16, FSDP2 {result.backend}), "
            f"final loss {result.train_loss:.3f}, peak memory "
            f"{peak / 2**30:.1f} GiB"
        )
        print(
            json.dumps(
                {
                    "gpu": gpu,
                    "world": world,
                    "active_params": active,
                    "total_params": total,
                    "tokens_per_s": round(tok_s),
                    "mfu": round(mfu, 4),
                    "steps": result.steps,
                    "backend": result.backend,
                    "peak_mem_gib": round(peak / 2**30, 2),
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
