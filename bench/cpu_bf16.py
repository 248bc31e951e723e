"""A finetune step on the CPU in float32 against bf16 autocast, on this CPU.

Where the CPU has bf16 instructions (AVX512-BF16 or AMX) bf16 autocast is the faster way to
train on it; where it has not (AVX2 alone), oneDNN emulates bf16 and the same step runs
several times slower (moe/train/ranks.py warns). This measures which: the same training
step (forward, backward, AdamW) of a model folder on random rows, each dtype in turn
(A B A B ..., after one warm-up step each), medians and their ratio.

Run: `.venv/bin/python bench/cpu_bf16.py MODEL_DIR [--rows 2] [--width 256] [--rounds 3]`
(MODEL_DIR: a Hugging Face folder or one of the pipeline's models; bench/sql_real.py leaves
SmolLM2-135M in .cache/smollm2/dense). JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe.hf.model_dir import load_model_dir  # noqa: E402
from moe.train.ranks import cpu_bf16_native  # noqa: E402


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, bf16: bool) -> float:
    """Seconds for one training step on `x` (loss on its second half)."""
    y = x.clone()
    y[:, : x.shape[1] // 2] = -100
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss, aux = model(x, y, torch.ones_like(y, dtype=torch.float32), logits=False)
    (loss + aux.balance_loss).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load_model_dir(a.model, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    x = torch.randint(0, model.vocab_size, (a.rows, a.width))
    times: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for bf16 in (False, True):  # warm-up: oneDNN builds its kernels for each dtype once
        step(model, opt, x, bf16)
    for r in range(a.rounds):
        for name in times:
            times[name].append(step(model, opt, x, name == "bfloat16"))
            print(f"round {r} {name}: {times[name][-1]:.2f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "model": str(a.model), "rows": a.rows, "width": a.width, "rounds": a.rounds,
        "cpu_bf16_native": cpu_bf16_native(), "threads": torch.get_num_threads(),
        "float32_s": round(med["float32"], 3), "bfloat16_s": round(med["bfloat16"], 3),
        "bf16_vs_fp32": round(med["bfloat16"] / med["float32"], 2),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
