"""Checkpoint benchmark on a real short training run of the default model.

- Compression of the model weights, in fp32 and cast to bf16, against the raw tensor bytes:
  our byte-grouped codecs (`bg-zstd` at level 1, the hot tier's; at level 19, the cold
  tier's and the headline `ratio_*`; `bg-lzma`) next to plain zstd-3 over the raw bytes and
  `torch.save`. ZipNN publishes 1.51x on bf16 models
  (ratio 0.66); target ratio_bf16 <= 0.66.
- A series of 10 consecutive checkpoints (weights + AdamW state + RNG, every `interval` steps,
  the first full, the rest XOR deltas) against 10 raw copies: `series_ratio`, target <= 0.30.
- The training stall per save (background writer) as a fraction of the time between saves:
  `stall_fraction`, target <= 0.05; save and restore MB/s of raw state.

JSON last. Needs `data/prepared` (`moe-pipeline stage prepare` or `make demo`).
Run: `.venv/bin/python bench/checkpoint.py [--quick]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import zstandard

from moe.checkpoint.codec import encode
from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import model_tensors
from moe.data.tokens import BatchSampler, TokenStore
from moe.model.transformer import MoETransformer
from moe.train.trainer import Trainer
from tasks.config import load_config


def _raw_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _weights_ratios(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    raw = _raw_bytes(tensors)
    out: dict[str, float] = {}
    for name, codec, level in (
        ("bg-zstd-1 (hot)", "bg-zstd", 1),
        ("bg-zstd-19 (cold)", "bg-zstd", 19),
        ("bg-lzma", "bg-lzma", 0),
    ):
        out[name] = sum(len(encode(t, codec, level=level).data) for t in tensors.values()) / raw
    z = zstandard.ZstdCompressor(level=3)
    out["zstd-3"] = (
        sum(
            len(z.compress(t.contiguous().view(torch.uint8).numpy().tobytes()))
            for t in tensors.values()
        )
        / raw
    )
    buf = io.BytesIO()
    torch.save(tensors, buf)
    out["torch.save"] = buf.tell() / raw
    return {k: round(v, 4) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="interval 5 steps (50 steps in all)")
    ap.add_argument("--interval", type=int, default=0, help="steps between checkpoints")
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    a = ap.parse_args()
    if not (a.data / "meta.json").is_file():
        raise SystemExit(
            f"{a.data}/meta.json not found: run `moe-pipeline stage prepare` (or `make demo`) first"
        )
    cfg = load_config(a.params)
    interval = a.interval or (5 if a.quick else 20)
    n_ckpt = 10
    train_store = TokenStore(a.data, "train")
    torch.manual_seed(cfg.pretrain.seed)
    model = MoETransformer(cfg.model, cfg.moe, train_store.vocab_size)
    t = dataclasses.replace(
        cfg.pretrain,
        max_steps=n_ckpt * interval,
        checkpoint_every=interval,
        eval_every=10**9,
        log_every=interval,
        early_stop=dataclasses.replace(cfg.pretrain.early_stop, patience=0),
    )
    with tempfile.TemporaryDirectory() as d:
        store = CheckpointStore(
            Path(d) / "ckpt",
            max_retain=n_ckpt,
            hot_every=10**9,  # one full write, then deltas: the series the target is about
            cold_every=10**9,
            keep_best=False,
            background=True,
        )
        trainer = Trainer(
            model,
            t,
            BatchSampler(train_store, t.batch_size, cfg.model.seq_len, t.seed),
            store,
            fingerprint="bench",
            schedule="cosine",
            min_lr=t.min_lr,
            router_lr_mult=cfg.moe.router_lr_mult,
        )
        res = trainer.fit()
        store.flush()
        infos = sorted(store.info(), key=lambda i: i.step)
        assert len(infos) == n_ckpt and all(i.problem is None for i in infos), infos
        latest = infos[-1].path
        t0 = time.perf_counter()
        ck = store.load(latest)
        restore_s = time.perf_counter() - t0
        state_raw = _raw_bytes(ck.model) + _raw_bytes(ck.optimizer) + _raw_bytes(ck.rng)
        series_bytes = sum(i.bytes for i in infos)
        step_s = res.wall_s / res.steps
        stalls = store.stalls_s
        write_s = store.write_s
        first_full = infos[0].bytes / state_raw
        later = [i.bytes / state_raw for i in infos[1:]]
    weights32 = {k: v.float() for k, v in model_tensors(model).items() if v.is_floating_point()}
    weights16 = {k: v.to(torch.bfloat16) for k, v in weights32.items()}
    r32, r16 = _weights_ratios(weights32), _weights_ratios(weights16)
    out = {
        "steps": res.steps,
        "interval": interval,
        "state_raw_mb": round(state_raw / 1e6, 2),
        "ratio_bf16": r16["bg-zstd-19 (cold)"],
        "ratio_fp32": r32["bg-zstd-19 (cold)"],
        "ratio_bf16_hot": r16["bg-zstd-1 (hot)"],
        "ratio_fp32_hot": r32["bg-zstd-1 (hot)"],
        "weights_bf16": r16,
        "weights_fp32": r32,
        "full_checkpoint_ratio": round(first_full, 4),
        "delta_checkpoint_ratio_median": round(statistics.median(later), 4),
        "series_ratio": round(series_bytes / (n_ckpt * state_raw), 4),
        "step_s": round(step_s, 4),
        "stall_s_median": round(statistics.median(stalls), 4),
        "stall_fraction": round(statistics.median(stalls) / (interval * step_s), 4),
        "write_s_median": round(statistics.median(write_s), 3),
        "save_mb_s": round(state_raw / 1e6 / statistics.median(write_s), 1),
        "restore_mb_s": round(state_raw / 1e6 / restore_s, 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
