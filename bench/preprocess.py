"""Preprocessing throughput: our prepare path against the raw tokenizer (the limit) and the
nanoGPT way (`datasets.map` + concatenate into a memmap), on the same stdlib text.

    .venv/bin/python bench/preprocess.py [--quick]

Runs are interleaved (ours, limit, nanoGPT, ours, ...) after a warm-up; medians reported.
Prints a JSON object last: tokens_per_s per method, ratio_vs_limit, ratio_vs_nanogpt, and the
zstd ratio of the token file (a claim to check: "70% smaller").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

import tasks

tasks.offline_defaults()
from moe.data.sources import CorpusStats, iter_documents  # noqa: E402
from moe.data.tokenizer import EOT, batch_encoder, train_tokenizer  # noqa: E402
from moe.data.tokens import token_dtype, write_token_store  # noqa: E402


def nanogpt_run(texts: list[str], tok: Any, vocab: int, out: Path) -> int:
    """nanoGPT's data/openwebtext/prepare.py: map a per-example tokenizer over the dataset
    with num_proc workers, then concatenate the ids into one memmap in shards."""
    import datasets

    eot = tok.token_to_id(EOT)
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict({"text": texts})

    def process(example: dict) -> dict:
        ids = [*tok.encode(example["text"]).ids, eot]
        return {"ids": ids, "len": len(ids)}

    tokenized = ds.map(process, remove_columns=["text"], num_proc=2)
    total = int(np.sum(tokenized["len"], dtype=np.uint64))
    arr = np.memmap(out / "nanogpt.bin", dtype=token_dtype(vocab), mode="w+", shape=(total,))
    idx = 0
    shards = 16
    for i in range(shards):
        batch = tokenized.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
        chunk = np.concatenate(batch["ids"]) if len(batch) else np.zeros(0)
        arr[idx : idx + len(chunk)] = chunk
        idx += len(chunk)
    arr.flush()
    return total


def nanogpt_worker(tok_path: str, mb: int, out: str) -> None:
    from tokenizers import Tokenizer

    texts = list(iter_documents("stdlib", "text", mb * 1_000_000, CorpusStats()))
    tok = Tokenizer.from_file(tok_path)
    t0 = time.perf_counter()
    n = nanogpt_run(texts, tok, tok.get_vocab_size(), Path(out))
    print(json.dumps({"tokens": n, "seconds": time.perf_counter() - t0}))


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--nanogpt-worker":
        nanogpt_worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return
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

    encode_batch = batch_encoder(tok)  # what the prepare stage uses

    def ours() -> int:
        out = work / "ours"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        docs = iter_documents("stdlib", "text", max_bytes, CorpusStats())
        counts = write_token_store(docs, encode_batch, eot, vocab, out, {"val": 0.05}, seed=0)
        return sum(c["tokens"] for c in counts.values())

    def limit() -> int:
        # the fastest raw call, in memory, nothing written (encode_batch_fast: no offsets)
        n = 0
        for i in range(0, len(texts), 256):
            n += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts[i : i + 256]))
        return n

    tok_path = work / "tokenizer.json"
    tok.save(str(tok_path))

    def nanogpt() -> float:
        # In a fresh process each time: datasets' worker processes are forked, and after a
        # fork the tokenizer's thread pool in the forking process runs ~1.5x slower, which
        # would slow the methods measured after it in this process (measured: 0.80 -> 0.50
        # M tokens/s). The worker times only the map + concatenate.
        out = subprocess.run(
            [sys.executable, __file__, "--nanogpt-worker", str(tok_path), str(mb), str(work)],
            capture_output=True,
            text=True,
            check=True,
        )
        return float(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])

    def timed(fn: Callable[[], int]) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    tokens = {"ours": ours(), "limit": limit()}  # warm-up (and the token counts)
    assert tokens["ours"] == tokens["limit"], tokens  # the same text, the same ids
    methods = {"ours": timed(ours), "limit": timed(limit), "nanogpt": nanogpt}
    nanogpt()
    rates: dict[str, list[float]] = {k: [] for k in methods}
    names = list(methods)
    for r in range(repeats):
        # rotate the order every round (ours limit nanogpt, limit nanogpt ours, ...): no
        # method always runs right after the nanoGPT process tears its workers down
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates[name].append(tokens["limit"] / methods[name]())
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
