"""Contract of moe/data/sources.py, moe/data/tokens.py, moe/data/tokenizer.py and
moe/sql/sets.py: corpora read as documents, token stores round-trip with their meta, splits
are by document, batches are a pure function of (seed, step), SFT batches put the loss on
responses only, and every SQL pair runs on its database."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.data.sources import CorpusStats, iter_documents
from moe.data.tokenizer import EOT, load_tokenizer, train_tokenizer
from moe.data.tokens import (
    BatchSampler,
    MixedBatches,
    SFTBatches,
    SFTExample,
    TokenStore,
    token_dtype,
    write_token_store,
)
from moe.errors import InputError


def _store(
    tmp_path: Path, docs: list[list[int]], vocab: int = 100, val_fraction: float = 0.25
) -> dict:
    counts = write_token_store(
        iter(map(str, range(len(docs)))),
        lambda batch: [docs[int(b)] for b in batch],
        0,
        vocab,
        tmp_path,
        {"val": val_fraction},
        seed=1,
        batch_docs=3,
    )
    meta = {"dtype": str(token_dtype(vocab)), "vocab_size": vocab, "splits": counts}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    return counts


def test_token_store_round_trip_and_split_by_document(tmp_path: Path) -> None:
    docs = [[i + 1] * (i + 2) for i in range(20)]
    counts = _store(tmp_path, docs)
    assert counts["val"]["documents"] == 5  # exactly 25% of 20 documents, systematic sample
    assert counts["train"]["documents"] + counts["val"]["documents"] == 20
    train, val = TokenStore(tmp_path, "train"), TokenStore(tmp_path, "val")
    all_tokens = np.concatenate([train.tokens, val.tokens])
    assert sorted(all_tokens.tolist()) == sorted(sum(([*d, 0] for d in docs), []))
    idx = np.load(tmp_path / "val.idx.npy")
    assert len(idx) == 5 and idx[0] == 0
    # each held-out document is whole: its tokens are one value followed by the EOT 0
    first_doc = val.tokens[idx[0] : idx[1]]
    assert len(set(first_doc[:-1].tolist())) == 1 and first_doc[-1] == 0


def test_dtype_follows_vocabulary() -> None:
    assert token_dtype(65536) == np.uint16
    assert token_dtype(65537) == np.uint32


def test_damaged_store_is_refused(tmp_path: Path) -> None:
    _store(tmp_path, [[1, 2, 3]] * 8)
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(ValueError, match="damaged"):
        TokenStore(tmp_path, "train")


def test_batches_are_a_pure_function_of_step(tmp_path: Path) -> None:
    _store(tmp_path, [list(range(1, 50))] * 8)
    s1 = BatchSampler(TokenStore(tmp_path, "train"), 4, 8, seed=3)
    s2 = BatchSampler(TokenStore(tmp_path, "train"), 4, 8, seed=3)
    x1, y1, _ = s1.batch_at(7)
    x2, y2, _ = s2.batch_at(7)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(s1.batch_at(8)[0], x1)
    assert not torch.equal(s1.batch_at(7, micro=1)[0], x1)


def test_sft_batches_mask_prompt_and_weight_focus_tokens() -> None:
    ex = SFTExample(prompt=[5, 6, 7], response=[8, 9, 1])
    b = SFTBatches(
        [ex], batch_size=2, max_len=16, seed=0, pad_id=2, focus_ids={9}, focus_weight=3.0
    )
    x, y, w = b.batch_at(0)
    assert x[0].tolist() == [5, 6, 7, 8, 9]
    assert y[0].tolist() == [-100, -100, 8, 9, 1]  # loss on the response (and its end token) only
    assert w[0].tolist() == [1.0, 1.0, 1.0, 3.0, 1.0]
    # too long: refused with its numbers, never cut (tests/test_sql.py), and exactly
    # max_len + 1 tokens still fits (inputs and targets are max_len wide)
    fits = SFTBatches([SFTExample(list(range(10, 14)), [8, 9, 1])], 1, 6, 0, 2)
    x, y, _ = fits.batch_at(0)
    assert x.shape[1] == 6 and y[0, -3:].tolist() == [8, 9, 1]
    with pytest.raises(InputError, match="longer than max_len=6"):
        SFTBatches([SFTExample(list(range(10, 15)), [8, 9, 1])], 1, 6, 0, 2)


def test_stdlib_corpus_skips_undecodable_and_caps(tmp_path: Path, monkeypatch) -> None:
    # A standard library of our own: two sources, one Latin-1 (like test/encoded_modules),
    # installed packages (pruned) and a file that is not Python.
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text("import os\n")
    (tmp_path / "pkg" / "b.py").write_text("x = 'b' * 200\n")
    (tmp_path / "pkg" / "latin.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    (tmp_path / "site-packages" / "c.py").write_text("installed = True\n")
    (tmp_path / "notes.txt").write_text("not python\n")
    monkeypatch.setattr("moe.data.sources.stdlib_root", lambda: tmp_path)
    stats = CorpusStats()
    docs = list(iter_documents("stdlib", "text", 0, stats))
    assert docs == ["import os\n", "x = 'b' * 200\n"]
    assert stats.skipped_undecodable == 1 and stats.skipped_files == ["pkg/latin.py"]
    assert stats.documents == 2 and stats.bytes == sum(len(d) for d in docs)
    # The cap: whole documents only, and never more bytes than asked (one at least).
    capped = CorpusStats()
    assert list(iter_documents("stdlib", "text", 12, capped)) == ["import os\n"]
    assert capped.bytes == 10 and capped.sha256 != stats.sha256


def test_local_jsonl_corpus_through_datasets(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"doc {i}"}) for i in range(5)))
    docs = list(iter_documents(str(f), "body", 0, CorpusStats()))
    assert docs == [f"doc {i}" for i in range(5)]
    with pytest.raises(InputError, match="text_field"):
        list(iter_documents(str(f), "text", 0, CorpusStats()))


def test_parquet_and_json_corpora_through_datasets(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"text": ["alpha doc", "beta doc"], "n": [1, 2]}), tmp_path / "c.parquet"
    )
    assert list(iter_documents(str(tmp_path / "c.parquet"), "text", 0, CorpusStats())) == [
        "alpha doc",
        "beta doc",
    ]
    (tmp_path / "c.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    assert list(iter_documents(str(tmp_path / "c.json"), "text", 0, CorpusStats())) == [
        "one",
        "two",
    ]
    # a folder of both: every file's documents, in path order
    folder = tmp_path / "mixed"
    folder.mkdir()
    shutil.copy(tmp_path / "c.json", folder / "a.json")
    shutil.copy(tmp_path / "c.parquet", folder / "b.parquet")
    stats = CorpusStats()
    assert list(iter_documents(str(folder), "text", 0, stats)) == [
        "one",
        "two",
        "alpha doc",
        "beta doc",
    ]
    assert stats.documents == 4
    with pytest.raises(InputError, match="text_field"):
        list(iter_documents(str(tmp_path / "c.parquet"), "body", 0, CorpusStats()))


def test_missing_source_and_offline_hub_fail_clearly() -> None:
    with pytest.raises(InputError, match="no such file"):
        list(iter_documents("./nope.txt", "text", 0, CorpusStats()))
    with pytest.raises(InputError, match="offline"):
        list(iter_documents("someone/some-dataset", "text", 0, CorpusStats()))


def test_a_long_text_file_is_cut_into_bounded_documents_at_paragraph_breaks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moe.data.sources as data

    monkeypatch.setattr(data, "READ_BLOCK", 7)  # blocks end inside multi-byte characters
    paragraphs = [f"Paragraph {i}: café, naïve, 東京. " * (1 + i % 5) for i in range(60)]
    text = "\n\n".join(paragraphs) + "\n"
    f = tmp_path / "book.txt"
    f.write_text(text)
    docs = list(data.text_file_documents(f, doc_max_bytes=300))
    assert "".join(docs) == text  # nothing lost, nothing repeated
    assert len(docs) > 10 and all(len(d) <= 300 for d in docs)
    assert all(d.endswith("\n\n") for d in docs[:-1])  # every cut at a paragraph break
    # A file that fits is one document, as before.
    assert list(data.text_file_documents(f, doc_max_bytes=len(text))) == [text]
    # One line with no break and no space: cut at the limit itself.
    f.write_text("x" * 1000)
    assert [len(d) for d in data.text_file_documents(f, doc_max_bytes=300)] == [300, 300, 300, 100]


def test_a_folder_of_system_documentation_is_a_corpus(tmp_path: Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, p in enumerate(sorted(Path("/usr/share/doc").glob("*/copyright"))[:200]):
        (folder / f"{i:03d}-{p.parent.name}.txt").write_bytes(p.read_bytes())
    stats = CorpusStats()
    docs = list(iter_documents(str(folder), "text", 0, stats, encoding="utf-8"))
    assert stats.documents == len(docs) >= 150 and all(len(d) <= 16_384 for d in docs)
    assert stats.documents + stats.skipped_undecodable >= len(list(folder.iterdir()))


def test_tokenizer_trains_locally_and_round_trips(tmp_path: Path) -> None:
    tok = train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300)
    tok.save(str(tmp_path / "t.json"))
    tok = load_tokenizer(tmp_path / "t.json")
    text = "def g(y):\n    return y\n"
    assert tok.decode(tok.encode(text).ids) == text
    assert tok.token_to_id(EOT) is not None


def test_replay_split_is_held_back_from_training(tmp_path: Path) -> None:
    docs = [[i + 1] * 3 for i in range(40)]
    counts = write_token_store(
        iter(map(str, range(40))),
        lambda b: [docs[int(x)] for x in b],
        0,
        100,
        tmp_path,
        {"val": 0.1, "replay": 0.05},
        seed=0,
    )
    assert counts["val"]["documents"] == 4 and counts["replay"]["documents"] == 2
    assert sum(c["documents"] for c in counts.values()) == 40
    values = {
        name: set(np.fromfile(tmp_path / f"{name}.bin", dtype=np.uint16).tolist()) - {0}
        for name in counts
    }
    assert not values["replay"] & values["train"] and not values["val"] & values["train"]


def test_mixed_batches_add_replay_rows_with_full_loss(tmp_path: Path) -> None:
    _store(tmp_path, [list(range(1, 60))] * 8)
    sft = SFTBatches([SFTExample([5, 6], [7, 1])], batch_size=3, max_len=8, seed=0, pad_id=2)
    mixed = MixedBatches(sft, BatchSampler(TokenStore(tmp_path, "train"), 2, 8, seed=0))
    x, y, w = mixed.batch_at(0)
    # The replay windows are as wide as the step's SFT rows (3 tokens), never wider...
    assert x.shape == (5, 3) and y.shape == (5, 3) and w.shape == (5, 3)
    assert (y[3:] != -100).all()  # replay rows: loss on every token
    # ...and they are the starts of the windows the sampler draws at full width.
    full_x, _, _ = BatchSampler(TokenStore(tmp_path, "train"), 2, 8, seed=0).batch_at(0)
    assert torch.equal(x[3:], full_x[:, :3])
    # A wider SFT batch (an 8-token example) gets replay windows of 7.
    sft = SFTBatches([SFTExample([5, 6, 7, 8], [9, 10, 11, 1])], 3, max_len=8, seed=0, pad_id=2)
    x, y, _ = MixedBatches(sft, BatchSampler(TokenStore(tmp_path, "train"), 2, 8, 0)).batch_at(0)
    assert x.shape == (5, 7) and (y[3:] != -100).all()


def test_fast_batch_encoder_gives_the_same_ids_as_encode_batch() -> None:
    from moe.data.sources import CorpusStats, iter_documents
    from moe.data.tokenizer import batch_encoder, train_tokenizer

    texts = list(iter_documents("stdlib", "text", 300_000, CorpusStats()))
    tok = train_tokenizer(texts, vocab_size=512)
    assert batch_encoder(tok)(texts) == [e.ids for e in tok.encode_batch(texts)]
