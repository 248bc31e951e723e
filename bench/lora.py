"""Full finetuning against LoRA and QLoRA on the same imported model: what each keeps
(trainable state bytes: the trained parameters, their gradients and AdamW's two moments),
its peak training memory (live tensor storage over one steady-state step, tracked op by op;
torch's MemTracker refuses frozen parameters), its step
time (the three interleaved A B C A B C after warm-up, medians) and the bytes of one
checkpoint (the tiered store, raw codec). Then the same three methods' weights and trainable
state for OLMoE-1B-7B, Qwen3-30B-A3B and Mixtral-8x7B from their published shapes
(arithmetic: no activations), what one GPU of each default pool holds, and the bill of a
finetune_domain run on each.

The model: transformers' own Qwen3-MoE (random weights, `from_config` + `save_pretrained`),
imported with `moe-pipeline model import`'s code. JSON last.

Run: `.venv/bin/python bench/lora.py [--steps 12]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moe.adapters.config import LoraConfig
from moe.adapters.lora import expert_rank
from moe.adapters.method import apply_method, trainable_bytes
from moe.checkpoint.store import CheckpointStore
from moe.hf.importer import import_model
from moe.hf.model_dir import load_model_dir
from moe.model.config import MoEConfig
from moe.train.config import FinetuneConfig
from moe.train.memory import held_tensors, measure_peak
from moe.train.trainer import Trainer
from tasks.config import Config

METHODS = ("full", "lora", "qlora")
SEQ, BATCH, VOCAB = 128, 8, 2048


def make_hf(folder: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=SEQ,
    )
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)


class Batches:
    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor, None]:
        g = torch.Generator().manual_seed(step)
        x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return x[:, :-1], x[:, 1:], None


def trainer(imported: Path, method: str, ckpt: Path) -> Trainer:
    cfg = FinetuneConfig(
        max_steps=10_000,
        batch_size=BATCH,
        lr=1e-4,
        device="cpu",
        method=method,  # type: ignore[arg-type]
        lora=LoraConfig(rank=8, alpha=16.0),
        checkpoint_every=10_000,
    )
    model = load_model_dir(imported, dtype=torch.float32)
    apply_method(model, cfg, method)
    store = CheckpointStore(ckpt, hot_codec="raw", background=False)
    return Trainer(
        model,
        cfg,
        Batches(),
        store,
        fingerprint=method,
        schedule="linear",
        expert_warmup=False,
        base_sha256=None if method == "full" else "bench",
    )


def one_step(t: Trainer, step: int) -> None:
    x, y, _ = Batches().batch_at(step)
    _, loss, aux = t.model(x, y, logits=False)
    (loss + aux.balance_loss).backward()
    t.optimizer.step()
    t.optimizer.zero_grad(set_to_none=True)


def peak_memory(t: Trainer) -> dict[str, int]:
    """Peak live bytes over one training step, after a first (the optimizer state exists):
    weights, trainable state and activations together (moe/train/memory.py measure_peak)."""
    one_step(t, 0)
    return {"peak": measure_peak(held_tensors(t.model, t.optimizer), lambda: one_step(t, 1))}


def checkpoint_bytes(t: Trainer, folder: Path) -> int:
    path = t.checkpointer.save(None)
    t.checkpointer.store.flush()
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ---------------------------------------------------------------------- projections

# Published shapes (config.json of each release): layers, hidden, heads, kv heads, head dim,
# experts, top-k, expert hidden, dense hidden (first layers), vocab, tied embeddings.
MODELS = {
    "OLMoE-1B-7B": dict(L=16, D=2048, H=16, KV=16, Dh=128, E=64, K=8, F=1024, V=50304),
    "Qwen3-30B-A3B": dict(L=48, D=2048, H=32, KV=4, Dh=128, E=128, K=8, F=768, V=151936),
    "Mixtral-8x7B": dict(L=32, D=4096, H=32, KV=8, Dh=128, E=8, K=2, F=14336, V=32000),
}


def project(m: dict[str, int], method: str, rank: int = 8) -> dict[str, float]:
    """GB of weights and of trainable state (fp32 parameters, gradients, two moments) for
    one whole copy; LoRA on attention and routed experts at `rank` (experts: 'same')."""
    attn = m["D"] * (m["H"] + 2 * m["KV"]) * m["Dh"] + m["H"] * m["Dh"] * m["D"]
    experts = m["E"] * 3 * m["D"] * m["F"]
    router = m["E"] * m["D"]
    embed = 2 * m["V"] * m["D"]
    total = m["L"] * (attn + experts + router) + embed
    big = m["L"] * (attn + experts)  # what QLoRA quantises (the adapted projections)
    lora_attn = rank * (3 * m["D"] + m["H"] * m["Dh"] + m["KV"] * m["Dh"] * 2 + m["H"] * m["Dh"])
    lora_attn += rank * (m["H"] * m["Dh"] + m["D"])
    r = expert_rank(LoraConfig(rank=rank), m["E"])
    lora_exp = m["E"] * (2 * r * (m["D"] + 2 * m["F"]) + r * (m["F"] + m["D"]))
    adapters = m["L"] * (lora_attn + lora_exp)
    if method == "full":
        weights, trained = total * 4, total
    elif method == "lora":
        weights, trained = total * 4 + adapters * 4, adapters
    else:  # NF4: 0.5 bytes + one int8 scale per 64 + one fp32 per 256 blocks
        nf4 = 0.5 + 1 / 64 + 4 / (64 * 256)
        weights, trained = big * nf4 + (total - big) * 4 + adapters * 4, adapters
    return {
        "params_b": round(total / 1e9, 2),
        "trainable_m": round(trained / 1e6, 1),
        "weights_gb": round(weights / 1e9, 1),
        "trainable_state_gb": round(trained * 16 / 1e9, 1),
        "total_gb": round((weights + trained * 12) / 1e9, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    out: dict[str, dict] = {m: {} for m in METHODS}
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(tmp)
        make_hf(tmp_p / "hf")
        import_model(tmp_p / "hf", tmp_p / "imported", MoEConfig(), seq_len=SEQ)
        trainers = {m: trainer(tmp_p / "imported", m, tmp_p / f"ckpt-{m}") for m in METHODS}
        for m, t in trainers.items():
            out[m]["trainable_params"] = sum(
                p.numel() for p in t.model.parameters() if p.requires_grad
            )
            out[m]["trainable_state_bytes"] = trainable_bytes(t.model)
            out[m]["peak_memory"] = peak_memory(t)
            out[m]["checkpoint_bytes"] = checkpoint_bytes(t, tmp_p / f"ckpt-{m}")
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        for step in range(3 + args.steps):  # A B C A B C ..., 3 warm-up rounds
            for m, t in trainers.items():
                t0 = time.perf_counter()
                one_step(t, 10 + step)
                if step >= 3:
                    times[m].append(time.perf_counter() - t0)
        for m in METHODS:
            out[m]["step_ms"] = round(1000 * statistics.median(times[m]), 1)
    full = out["full"]
    for m in METHODS:
        o = out[m]
        o["state_ratio"] = round(o["trainable_state_bytes"] / full["trainable_state_bytes"], 4)
        o["peak_ratio"] = round(o["peak_memory"]["peak"] / full["peak_memory"]["peak"], 3)
        o["step_ratio"] = round(o["step_ms"] / full["step_ms"], 3)
        o["checkpoint_ratio"] = round(o["checkpoint_bytes"] / full["checkpoint_bytes"], 4)
        print(
            f"{m:6s} trainable {o['trainable_params']:>10,} state {o['trainable_state_bytes'] / 2**20:8.1f} MiB"
            f" peak {o['peak_memory']['peak'] / 2**20:7.1f} MiB step {o['step_ms']:7.1f} ms"
            f" checkpoint {o['checkpoint_bytes'] / 2**20:7.2f} MiB"
        )
    projections = project_all()
    print(json.dumps({"measured": out, "projected": projections}))


# Dense bf16 peak TFLOP/s of each default pool's GPU (vendor sheets) and the fraction of it
# a finetune reaches (an assumption, stated in bench/RESULTS.md: 0.35 MFU).
PEAK_TFLOPS = {"RTX 4090": 165.0, "A100": 312.0, "H100": 989.0}
MFU = 0.35
HEADROOM = 0.85  # of each GPU's memory for weights and state (the rest: activations, buffers)


def domain_tokens(cfg: Config) -> int:
    """Tokens of the default finetune_domain run: steps x (SFT rows + replay rows) x max_len."""
    f = cfg.finetune_domain
    rows = f.batch_size + max(1, round(f.batch_size * f.replay_ratio))
    return f.max_steps * rows * f.max_len


def project_all() -> dict[str, dict]:
    """Per model and method: GPUs of each default GPU pool that hold the weights and the
    trainable state (FSDP-sharded evenly, HEADROOM of each GPU), and the bill of the default
    finetune_domain run there (6 x active parameters per token for full, 4 x for adapters:
    no weight gradients of the base; at MFU of the GPU's peak)."""
    cfg = Config()
    tokens = domain_tokens(cfg)
    res: dict[str, dict] = {}
    for name, shape in MODELS.items():
        res[name] = {}
        active = (
            shape["L"]
            * (
                shape["D"] * (shape["H"] + 2 * shape["KV"]) * shape["Dh"]
                + shape["H"] * shape["Dh"] * shape["D"]
                + shape["K"] * 3 * shape["D"] * shape["F"]
            )
            + shape["V"] * shape["D"]
        )
        for method in METHODS:
            p = project(shape, method)
            flops = tokens * active * (6 if method == "full" else 4)
            pools = {}
            for pool_name, pool in cfg.pools.definitions.items():
                if not pool.gpus or not pool.gpu_memory_gib:
                    continue
                gpus = max(1, -(-p["total_gb"] * 1e9 // (pool.gpu_memory_gib * 2**30 * HEADROOM)))
                hours = flops / (gpus * PEAK_TFLOPS[pool.gpu] * 1e12 * MFU) / 3600
                pools[pool_name] = {
                    "gpus": int(gpus),
                    "hours": round(hours, 3),
                    "bill": round(hours * gpus * pool.rate, 2),
                }
            res[name][method] = {**p, "pools": pools}
            print(f"{name:14s} {method:6s} {p} {pools}")
    return res


if __name__ == "__main__":
    main()
