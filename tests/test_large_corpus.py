"""A corpus larger than the memory budget: 1 GB of text (stdlib sources repeated into JSONL
files, generated here in a temp folder) prepares with peak memory under 1 GB, because reading,
tokenizing and writing all stream."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe.data import CorpusStats, iter_documents

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

SCRIPT = """
import json, resource, sys, time
from pathlib import Path
from moe.data import CorpusStats, iter_documents, write_token_store
from moe.tokenizer import EOT, train_tokenizer
src, out = sys.argv[1], Path(sys.argv[2])
tok = train_tokenizer(iter_documents(src, "text", 20_000_000, CorpusStats()), vocab_size=4096)
stats = CorpusStats()
t0 = time.time()
counts = write_token_store(
    iter_documents(src, "text", 0, stats), lambda b: [e.ids for e in tok.encode_batch(b)],
    tok.token_to_id(EOT), tok.get_vocab_size(), out, {"val": 0.01}, seed=0,
)
print(json.dumps({"bytes": stats.bytes, "documents": stats.documents, "counts": counts,
                  "seconds": time.time() - t0, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_one_gigabyte_corpus_prepares_in_bounded_memory(tmp_path: Path) -> None:
    docs = list(iter_documents("stdlib", "text", 30_000_000, CorpusStats()))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    written, n = 0, 0
    while written < 1_000_000_000:
        with open(corpus / f"part-{n:04d}.jsonl", "w") as f:
            for d in docs[n % 7 :: 7]:  # each file a different slice, so files differ
                line = json.dumps({"text": d}) + "\n"
                f.write(line)
                written += len(line)
        n += 1
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(corpus), str(out)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["bytes"] >= 900_000_000  # text bytes (JSON escaping made the files larger)
    tokens = sum(c["tokens"] for c in result["counts"].values())
    assert (out / "train.bin").stat().st_size + (out / "val.bin").stat().st_size == 2 * tokens
    assert result["peak_rss_mb"] < 1024, result
    print(result)
