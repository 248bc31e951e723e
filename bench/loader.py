"""Batch sampler throughput: windows read from the memmap against the same windows sliced
from an in-RAM copy of the tokens.

    .venv/bin/python bench/loader.py [--quick] [--data data/prepared]

Interleaved rounds after a warm-up, medians. Prints a JSON object last with ratio_vs_ram
(memmap batches/s over in-RAM batches/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from moe.data.tokens import BatchSampler, TokenStore


class _InRam:
    def __init__(self, store: TokenStore) -> None:
        self.tokens = np.array(store.tokens)  # a full copy in RAM
        self.path = store.path

    def __len__(self) -> int:
        return len(self.tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data", type=Path, default=Path("data/prepared"))
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    a = ap.parse_args()
    batches, rounds = (200, 5) if a.quick else (1000, 7)
    store = TokenStore(a.data, "train")
    samplers = {
        "memmap": BatchSampler(store, a.batch_size, a.seq_len, seed=0),
        "ram": BatchSampler(_InRam(store), a.batch_size, a.seq_len, seed=0),  # type: ignore[arg-type]
    }
    rates: dict[str, list[float]] = {k: [] for k in samplers}
    for r in range(rounds + 1):
        for name, s in samplers.items():
            t0 = time.perf_counter()
            for step in range(batches):
                s.batch_at(r * batches + step)
            if r:  # round 0 is the warm-up
                rates[name].append(batches / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(
        json.dumps(
            {
                "tokens": len(store),
                "batch_size": a.batch_size,
                "seq_len": a.seq_len,
                "batches_per_s": {k: round(v, 1) for k, v in med.items()},
                "ratio_vs_ram": round(med["memmap"] / med["ram"], 3),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
