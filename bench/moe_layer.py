"""MoE layer benchmark: our router + grouped experts against Hugging Face's Qwen3-MoE block and
against a dense SwiGLU with the same active FLOPs, forward + backward.

- `hf`: transformers' `Qwen3MoeSparseMoeBlock` with its fastest experts backend available
  here (`grouped_mm`), the same weights copied in; the outputs must match ours (parity check).
  Its `batched_mm` backend gathers a weight matrix per assignment; when that needs more memory
  than the machine has it is reported as not runnable rather than tried.
- `dense`: a SwiGLU whose hidden width is top_k x expert width: the active-FLOP limit an MoE
  layer can approach but not beat.
- `deepseek_v3`: DeepSeek-V3's layer shape (many small experts, sigmoid routing within groups,
  a shared expert) against transformers' `DeepseekV3MoE` on the same weights, whole layers.

Ratios come from one run, interleaved (ours, hf, dense, ours, ...) after a warm-up, medians.
`ratio_vs_hf` = HF time / ours (> 1: we are faster); `ratio_vs_dense` = ours / dense (the
overhead of routing, sorting, gathering and combining). The JSON object is printed last.

Run: `.venv/bin/python bench/moe_layer.py [--quick] [--device cuda]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn as nn

from moe.model.config import MoEConfig
from moe.model.transformer import MoEAux, MoELayer, SwiGLU


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _hf_block(ours: MoELayer, d_model: int, E: int, K: int, F: int, impl: str) -> nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=d_model,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        hidden_act="silu",
    )
    cfg._experts_implementation = impl
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.gate.weight)
        w1, w3, w2 = ours.experts.weights_EDF()
        # HF stores (E, out, in): gate_up = [gate; up] rows, down = (E, D, F).
        block.experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w2.transpose(1, 2))
    return block


def _available_bytes(device: torch.device | None = None) -> int:
    """Free memory where the benchmark runs: the GPU's (torch.cuda.mem_get_info), or the
    host's."""
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _time(
    fns: dict[str, Callable[[], None]], repeats: int, device: torch.device
) -> dict[str, float]:
    for fn in fns.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():  # interleaved
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run_dtype(a: argparse.Namespace, dtype: torch.dtype, tokens: int, repeats: int) -> dict:
    device = torch.device(a.device)
    D, E, K, F = a.d_model, a.experts, a.top_k, a.hidden
    torch.manual_seed(0)
    mcfg = MoEConfig(num_experts=E, top_k=K, expert_hidden=F, balancing=[])
    ours = MoELayer(D, mcfg)
    for p in ours.parameters():
        nn.init.normal_(p, std=0.02)
    hf = _hf_block(ours, D, E, K, F, "grouped_mm")
    dense = SwiGLU(D, K * F)
    for m in (ours, hf, dense):
        m.to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, D, device=device, dtype=dtype) * 0.5
    g = torch.randn(1, tokens, D, device=device, dtype=dtype)

    def zero() -> MoEAux:
        z = torch.zeros((), device=device)
        return MoEAux(balance_loss=z, aux_loss=z, z_loss=z)

    # Parity: the same weights and the same routing give the same output (to the dtype's
    # precision). Routing is compared separately: our router computes its logits in fp32, HF's
    # in the model dtype, so under bf16 near-ties can go to different experts.
    with torch.no_grad():
        x_TD = x.view(tokens, D)
        r = ours.router(x_TD)
        y_ours = ours.experts(x_TD, r.experts_TK, r.weights_TK).float()
        y_hf = hf.experts(x_TD, r.experts_TK, r.weights_TK.to(dtype)).float()
        _, _, hf_experts_TK = hf.gate(x_TD)
        same_routing = float(
            (hf_experts_TK.sort(-1).values == r.experts_TK.sort(-1).values).all(-1).float().mean()
        )
    parity = float((y_ours - y_hf).abs().max() / y_hf.abs().max().clamp_min(1e-12))

    xs = {k: x.detach().clone().requires_grad_(True) for k in ("ours", "hf", "dense")}
    fns = {
        "ours": lambda: ours(xs["ours"], zero()).backward(g),
        "hf": lambda: hf(xs["hf"]).backward(g),
        "dense": lambda: dense(xs["dense"]).backward(g),
    }
    med = _time(fns, repeats, device)
    # batched_mm materialises one (2F x D) and one (D x F) weight per assignment, plus their
    # gradients: estimate before trying.
    need = 2 * tokens * K * 3 * F * D * torch.finfo(dtype).bits // 8
    if need > 0.8 * _available_bytes(device):  # on a GPU too: 32k tokens asked for 1 TiB
        batched: str | float = (
            f"not runnable: needs ~{need / 2**30:.0f} GiB, "
            f"{_available_bytes(device) / 2**30:.0f} GiB available"
        )
    elif a.quick:
        batched = "skipped in --quick"
    else:
        hf_b = _hf_block(ours, D, E, K, F, "batched_mm").to(device=device, dtype=dtype)
        xb = x.detach().clone().requires_grad_(True)
        batched = _time({"b": lambda: hf_b(xb).backward(g)}, repeats, device)["b"] * 1e3
    flops = 3 * 2 * tokens * K * 3 * D * F  # fwd + bwd, three projections
    return {
        "tokens": tokens,
        "ours_ms": round(med["ours"] * 1e3, 2),
        "hf_grouped_mm_ms": round(med["hf"] * 1e3, 2),
        "hf_batched_mm_ms": batched,
        "dense_ms": round(med["dense"] * 1e3, 2),
        "ours_gflops": round(flops / med["ours"] / 1e9, 1),
        "ratio_vs_hf": round(med["hf"] / med["ours"], 3),
        "ratio_vs_dense": round(med["ours"] / med["dense"], 3),
        "parity_rel_err": parity,  # experts, same routing: max |ours - hf| / max |hf|
        "same_routing": same_routing,  # fraction of tokens whose top-k sets agree
    }


def _hf_deepseek_block(ours: MoELayer, D: int, m: MoEConfig) -> nn.Module:
    """transformers' DeepseekV3MoE (router with its correction bias, experts on its
    grouped_mm backend, shared expert) holding our layer's weights."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = DeepseekV3Config(
        hidden_size=D,
        moe_intermediate_size=m.expert_hidden,
        n_routed_experts=m.num_experts,
        num_experts_per_tok=m.top_k,
        n_group=m.n_group,
        topk_group=m.topk_group,
        n_shared_experts=1,
        routed_scaling_factor=m.routed_scale,
        norm_topk_prob=True,
    )
    cfg._experts_implementation = "grouped_mm"
    block = DeepseekV3MoE(cfg)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.gate.weight)
        block.gate.e_score_correction_bias.copy_(ours.router.expert_bias_E)
        w1, w3, w2 = ours.experts.weights_EDF()
        block.experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=2).transpose(1, 2))
        block.experts.down_proj.copy_(w2.transpose(1, 2))
        for ours_name, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            getattr(block.shared_experts, theirs).weight.copy_(
                getattr(ours.shared, ours_name).weight
            )
    return block


def run_deepseek(a: argparse.Namespace, dtype: torch.dtype, tokens: int, repeats: int) -> dict:
    """DeepSeek-V3's layer shape scaled to d_model (many small experts: 64 of width 64,
    top-8 within 4 of 8 groups, a routed scale, a shared expert, an aux-free bias), whole
    layers forward + backward (router, routed and shared experts) against transformers'."""
    device = torch.device(a.device)
    D = a.d_model
    torch.manual_seed(0)
    mcfg = MoEConfig(
        num_experts=64,
        top_k=8,
        expert_hidden=64,
        score_func="sigmoid",
        n_group=8,
        topk_group=4,
        routed_scale=2.5,
        shared_expert=True,
        balancing=["aux_free"],
    )
    ours = MoELayer(D, mcfg)
    for p in ours.parameters():
        nn.init.normal_(p, std=0.02)
    ours.router.expert_bias_E.normal_(0, 0.01)
    hf = _hf_deepseek_block(ours, D, mcfg)
    for m in (ours, hf):
        m.to(device=device, dtype=dtype)
    x = torch.randn(1, tokens, D, device=device, dtype=dtype) * 0.5
    g = torch.randn(1, tokens, D, device=device, dtype=dtype)

    def zero() -> MoEAux:
        z = torch.zeros((), device=device)
        return MoEAux(balance_loss=z, aux_loss=z, z_loss=z)

    with torch.no_grad():
        y_ours, y_hf = ours(x, zero()).float(), hf(x).float()
    parity = float((y_ours - y_hf).abs().max() / y_hf.abs().max().clamp_min(1e-12))
    xs = {k: x.detach().clone().requires_grad_(True) for k in ("ours", "hf")}
    med = _time(
        {
            "ours": lambda: ours(xs["ours"], zero()).backward(g),
            "hf": lambda: hf(xs["hf"]).backward(g),
        },
        repeats,
        device,
    )
    return {
        "tokens": tokens,
        "sizes": {"d_model": D, "experts": 64, "top_k": 8, "hidden": 64, "groups": "4 of 8"},
        "ours_ms": round(med["ours"] * 1e3, 2),
        "hf_grouped_mm_ms": round(med["hf"] * 1e3, 2),
        "ratio_vs_hf": round(med["hf"] / med["ours"], 3),
        "parity_rel_err": parity,  # whole layer, routing included
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="under 2 minutes on 2 CPU cores")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=0, help="0: 5 (--quick) or 11")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    repeats = a.repeats or (5 if a.quick else 11)
    out: dict[str, object] = {
        "device": a.device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "sizes": {"d_model": a.d_model, "experts": a.experts, "top_k": a.top_k, "hidden": a.hidden},
    }
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        tokens, reps = a.tokens, repeats
        note = None
        if a.device == "cpu" and dtype == torch.bfloat16 and not _fast_cpu_bf16():
            # This CPU has no bf16 matrix units: torch emulates bf16 GEMMs at ~1 GFLOP/s, so a
            # full-size step takes ~40 s per implementation. Measure at 1/8 of the tokens.
            tokens, reps = max(256, a.tokens // 8), min(repeats, 3)
            note = "bf16 GEMMs are emulated on this CPU (~1 GFLOP/s): measured at 1/8 tokens"
        key = {"float32": "fp32", "bfloat16": "bf16"}.get(name, name)
        res = run_dtype(a, dtype, tokens, reps)
        if note:
            res["note"] = note
        out[key] = res
        print(f"{key}: {res}", flush=True)
        ds = run_deepseek(a, dtype, tokens, reps)
        out[f"{key}_deepseek_v3"] = ds
        print(f"{key} DeepSeek-V3 shape: {ds}", flush=True)
    print(json.dumps(out))


def _fast_cpu_bf16() -> bool:
    a = torch.randn(512, 512, dtype=torch.bfloat16)
    a @ a
    t0 = time.perf_counter()
    a @ a
    return (2 * 512**3) / (time.perf_counter() - t0) > 20e9


if __name__ == "__main__":
    main()
