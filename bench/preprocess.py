"""Preprocessing throughput: our prepare path against the raw tokenizer (the limit) and the
nanoGPT way (`datasets.map` + concatenate into a memmap), on the same stdlib text.

    .venv/bin/python bench/preprocess.py [--quick]

Runs are interleaved (ours, limit, nanoGPT, ours, ...) after a warm-up; medians reported.
Prints a JSON object last: tokens_per_s per method, ratio_vs_limit, ratio_vs_nanogpt, and the
zstd ratio of the token file (seed 000 claims 70% smaller).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

import tasks  # noqa: F401 - offline defaults
from moe.data import CorpusStats, iter_documents, token_dtype, write_token_store
from moe.tokenizer import EOT, train_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8 MB of text, 3 repeats")
    ap.add_argument("--mb", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    a = ap.parse_args()
    mb = a.mb or (8 if a.quick else 32)
    repeats = a.repeats or (3 if a.quick else 5)
    max_bytes = mb * 1_000_000

    texts = list(iter_documents("stdlib", "text", max_bytes, CorpusStats()))
    tok = train_tokenizer(texts[: max(1, len(texts) // 4)], vocab_size=4096)
    eot = tok.token_to_id(EOT)
    vocab = tok.get_vocab_size()
    work = Path(tempfile.mkdtemp(prefix="bench-preprocess-"))

    def encode_batch(batch: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(batch)]

    def ours() -> int:
        out = work / "ours"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        docs = iter_documents("stdlib", "text", max_bytes, CorpusStats())
        counts = write_token_store(docs, encode_batch, eot, vocab, out, {"val": 0.05}, seed=0)
        return sum(c["tokens"] for c in counts.values())

    def limit() -> int:
        n = 0
        for i in range(0, len(texts), 256):
            n += sum(len(ids) + 1 for ids in encode_batch(texts[i : i + 256]))
        return n

    def nanogpt() -> int:
        # nanoGPT's data/openwebtext/prepare.py: map a per-example tokenizer over the dataset
        # with num_proc workers, then concatenate the ids into one memmap in shards.
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_dict({"text": texts})

        def process(example: dict) -> dict:
            ids = [*tok.encode(example["text"]).ids, eot]
            return {"ids": ids, "len": len(ids)}

        tokenized = ds.map(process, remove_columns=["text"], num_proc=2)
        total = int(np.sum(tokenized["len"], dtype=np.uint64))
        arr = np.memmap(work / "nanogpt.bin", dtype=token_dtype(vocab), mode="w+", shape=(total,))
        idx = 0
        shards = 16
        for i in range(shards):
            batch = tokenized.shard(num_shards=shards, index=i, contiguous=True).with_format(
                "numpy"
            )
            chunk = np.concatenate(batch["ids"]) if len(batch) else np.zeros(0)
            arr[idx : idx + len(chunk)] = chunk
            idx += len(chunk)
        arr.flush()
        return total

    methods = {"ours": ours, "limit": limit, "nanogpt": nanogpt}
    rates: dict[str, list[float]] = {k: [] for k in methods}
    tokens = {k: fn() for k, fn in methods.items()}  # warm-up (and the token counts)
    for _ in range(repeats):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            n = fn()
            rates[name].append(n / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    raw = (work / "ours" / "train.bin").read_bytes()
    comp = zstandard.ZstdCompressor(level=10, threads=-1).compress(raw)
    shutil.rmtree(work, ignore_errors=True)
    result = {
        "corpus_mb": mb,
        "tokens": tokens["ours"],
        "repeats": repeats,
        "tokens_per_s": {k: round(v) for k, v in med.items()},
        "ratio_vs_limit": round(med["ours"] / med["limit"], 3),
        "ratio_vs_nanogpt": round(med["ours"] / med["nanogpt"], 3),
        "zstd10_token_file_ratio": round(len(comp) / len(raw), 4),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
