"""MoE layer benchmark: grouped GEMM dispatch vs the per-expert loop, forward + backward.

Ratios are measured in the same run, interleaved (A B A B ...) after a warm-up, and reported
as medians. Run: `.venv/bin/python bench/bench_moe_layer.py [--device cuda] [--dtype bfloat16]`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe.experts import GroupedExperts, reference_moe
from moe.routing import Router


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    router = Router(a.d_model, a.experts, a.top_k).to(device)
    experts = GroupedExperts(a.experts, a.d_model, a.hidden).to(device)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(a.tokens, a.d_model, device=device, dtype=dtype, requires_grad=True)
    r = router(x.detach().float())
    experts_TK, weights_TK = r.experts_TK, r.weights_TK.detach()

    def grouped() -> None:
        experts(x, experts_TK, weights_TK).float().square().mean().backward()

    def loop() -> None:
        reference_moe(experts, x, experts_TK, weights_TK).float().square().mean().backward()

    impls = {"grouped": grouped, "loop": loop}
    times: dict[str, list[float]] = {k: [] for k in impls}
    for fn in impls.values():  # warm-up
        fn()
    for _ in range(a.repeats):
        for name, fn in impls.items():  # interleaved
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = 3 * 2 * a.tokens * a.top_k * 3 * a.d_model * a.hidden  # fwd+bwd, 3 projections
    print(
        f"device={device} dtype={a.dtype} tokens={a.tokens} d_model={a.d_model} hidden={a.hidden} experts={a.experts} top_k={a.top_k}"
    )
    for k, v in med.items():
        print(
            f"{k:8s} median {v * 1e3:8.2f} ms  {flops / v / 1e9:7.1f} GFLOP/s  {a.tokens / v:10.0f} tokens/s"
        )
    print(f"ratio loop/grouped (speed-up of grouped dispatch): {med['loop'] / med['grouped']:.2f}x")


if __name__ == "__main__":
    main()
