"""The memory plan under bf16 autocast against a measured step (issue 52, item 6).

A GPU computes under bf16 autocast; this runs the same step under the CPU's bf16 autocast and
tracks every live storage op by op (moe/train/memory.py `measure_peak`), for full
finetuning, LoRA (its frozen base held in bf16, as a GPU stage holds it) and QLoRA, at three
model sizes (8 x 64 tokens, vocabulary 512). It prints, per case, the measured peak, the
plan a GPU stage makes (`amp=True`) over it, and the plan that counted every tensor at 2
bytes (what tasks/fit.py did before) over it. The CPU's autocast is not CUDA's: the
figure to hold the plan to is `torch.cuda.max_memory_allocated` (bench/gpu_peer.py).

Run: `.venv/bin/python bench/plan_amp.py`. JSON last.
"""

from __future__ import annotations

import json

import torch

from moe.adapters.config import LoraConfig
from moe.adapters.lora import add_adapters, hold_base_in, quantize_base
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.train.memory import (
    activation_bytes,
    held_tensors,
    measure_peak,
    peak_bytes,
    state_bytes,
)

SIZES = ((64, 2, 4), (128, 4, 8), (256, 2, 16))  # width, layers, experts
VOCAB, ROWS, SEQ = 512, 8, 64


def case(width: int, layers: int, experts: int, method: str) -> dict[str, float]:
    cfg = ModelConfig(n_layer=layers, d_model=width, n_head=4, seq_len=SEQ, dense_hidden=2 * width)
    mcfg = MoEConfig(num_experts=experts, top_k=2, expert_hidden=width)
    lcfg = LoraConfig(rank=8, alpha=16.0)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = MoETransformer(cfg, mcfg, VOCAB)
    if method != "full":
        add_adapters(model, lcfg, seed=0)
    if method == "qlora":
        quantize_base(model, 64)
    if method == "lora":
        hold_base_in(model, torch.bfloat16)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, aux = model(x, x, logits=False)
            total = loss + aux.balance_loss
        total.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists
    measured = measure_peak(held_tensors(model, opt), step)
    amp = peak_bytes(
        state_bytes(cfg, mcfg, VOCAB, method, lcfg, amp=True),
        activation_bytes(cfg, mcfg, VOCAB, ROWS, SEQ, 1.0, 2, amp=True),
    )
    flat = peak_bytes(
        state_bytes(cfg, mcfg, VOCAB, method, lcfg),
        activation_bytes(cfg, mcfg, VOCAB, ROWS, SEQ, 1.0, 2),
    )
    return {
        "measured_mb": measured / 1e6,
        "plan_over_measured": amp / measured,
        "two_bytes_over_measured": flat / measured,
    }


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    out = {}
    for width, layers, experts in SIZES:
        for method in ("full", "lora", "qlora"):
            row = {k: round(v, 3) for k, v in case(width, layers, experts, method).items()}
            out[f"{width}x{layers}x{experts}/{method}"] = row
            print(f"d {width:3d}, {layers} layers, {experts:2d} experts, {method:5s}: {row}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
