"""Corpus ingestion, the memmap token store, and a resumable batch sampler.

A split is three files, as in nanoGPT's `prepare.py` plus what a user needs to trust it:
`NAME.bin` (token ids, uint16 when the vocabulary fits, else uint32), `NAME.idx.npy`
(document start offsets, uint64) and the shared `meta.json` (dtype, vocabulary size, token
and document counts, tokenizer and source hashes). Writing streams: memory stays bounded by
one batch of documents, whatever the corpus size.
"""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
import logging
import math
import os
import random
import sysconfig
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from moe.errors import InputError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = {".txt", ".md", ".py", ".sql", ".rst"}
TABLE_SUFFIXES = {".json": "json", ".parquet": "parquet"}  # read through HF datasets
DOC_MAX_BYTES = 16_384  # data.doc_max_bytes: a longer text file is cut into documents


# --------------------------------------------------------------------------- corpus


@dataclass
class CorpusStats:
    documents: int = 0
    bytes: int = 0
    skipped_undecodable: int = 0
    skipped_records: int = 0  # malformed JSONL lines skipped (data.on_bad_record: skip)
    skipped_files: list[str] = field(default_factory=list)
    sha256: str = ""  # over the documents read, in order


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _stdlib_documents(stats: CorpusStats) -> Iterator[str]:
    """The Python standard library's own sources (every machine with Python has them)."""
    root = stdlib_root()
    found = []
    # os.walk pruned of installed packages: ~4x faster than Path.rglob over the whole tree
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages")]
        found += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    files = sorted(Path(f) for f in found)  # Path order, as before: the corpus is unchanged
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library folder {root}")
    for p in files:
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            # e.g. test/encoded_modules/ holds Latin-1 and Shift-JIS sources on purpose.
            stats.skipped_undecodable += 1
            stats.skipped_files.append(str(p.relative_to(root)))
            continue
        yield text


def _file_documents(
    source: Path,
    text_field: str,
    on_bad_record: str,
    stats: CorpusStats,
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> Iterator[str]:
    files = sorted(f for f in source.rglob("*") if f.is_file()) if source.is_dir() else [source]
    for f in files:
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _jsonl_documents(f, text_field, on_bad_record, stats)
        elif suffix in TABLE_SUFFIXES:
            yield from _hf_documents(TABLE_SUFFIXES[suffix], str(f), text_field)
        elif suffix in TEXT_SUFFIXES:
            problem = _undecodable(f, encoding)
            if problem is None:
                yield from text_file_documents(f, encoding, doc_max_bytes)
            elif source.is_dir():  # one bad file in a folder: skipped, counted and named
                stats.skipped_undecodable += 1
                stats.skipped_files.append(f"{f} ({problem})")
            else:
                raise InputError(f"data.source {f}: {problem}")
        elif not source.is_dir():
            raise InputError(
                f"data.source {source}: unsupported file type {suffix!r}; use .txt/.md/.py, .jsonl/.json or .parquet"
            )


READ_BLOCK = 1 << 20  # text files are read in blocks of this size: memory does not grow with lines


def _undecodable(path: Path, encoding: str) -> str | None:
    """Why `path` cannot be read as `encoding` text (file, byte offset and line), or None.
    A streaming pass, so that a file that fails half-way is refused before any of it is used."""
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    offset, line = 0, 1
    try:
        with open(path, "rb") as fh:
            while block := fh.read(READ_BLOCK):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as e:
                    at = offset + max(e.start, 0)
                    line += block[: max(e.start, 0)].count(b"\n")
                    return (
                        f"not {encoding} text: undecodable byte at line {line} (byte offset {at});"
                        " set data.encoding to the file's encoding (e.g. latin-1, cp1252) or"
                        " convert it to UTF-8"
                    )
                offset += len(block)
                line += block.count(b"\n")
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return f"not {encoding} text: the file ends inside a character; set data.encoding"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def text_file_documents(
    path: Path, encoding: str = "utf-8", doc_max_bytes: int = DOC_MAX_BYTES
) -> Iterator[str]:
    """A text file as documents of at most ~doc_max_bytes characters, read in blocks.

    A file that fits is one document (a source file, a short article). A longer one, such as a
    whole book in one `input.txt`, is cut at paragraph breaks (a blank line) into documents of
    up to doc_max_bytes, so that it splits into train/val/replay; a paragraph longer than that
    is cut at its last line break or space before the limit, and text with neither (one huge
    line) at the limit itself. Memory stays bounded by one block plus one document whatever
    the line lengths."""
    decoder = codecs.getincrementaldecoder(encoding)("strict")
    buf = ""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(READ_BLOCK)
            buf += decoder.decode(block, final=not block)
            while len(buf) > doc_max_bytes:
                cut = _cut(buf, doc_max_bytes)
                yield buf[:cut]
                buf = buf[cut:]
            if not block:
                break
    if buf.strip():
        yield buf


def _cut(text: str, limit: int) -> int:
    """Where to end a document of at most `limit` characters: after the last paragraph break,
    else the last line break, else the last space, else at the limit."""
    for sep in ("\n\n", "\n", " "):
        at = text.rfind(sep, limit // 4, limit)
        if at > 0:
            return at + len(sep)
    return limit


def _jsonl_documents(
    path: Path, text_field: str, on_bad_record: str, stats: CorpusStats
) -> Iterator[str]:
    """One document per JSONL line. Read here rather than through `datasets` so that a bad
    line is reported by number (or skipped and counted) instead of failing the whole file."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
                if not isinstance(row, dict) or text_field not in row:
                    raise KeyError(f"no field {text_field!r} (data.text_field)")
                text = row[text_field]
                if not isinstance(text, str):
                    raise TypeError(f"field {text_field!r} is {type(text).__name__}, not text")
            except (
                ValueError,
                KeyError,
                TypeError,
            ) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if on_bad_record == "skip":
                    stats.skipped_records += 1
                    continue
                why = e.args[0] if isinstance(e, (KeyError, TypeError)) else f"not valid JSON ({e})"
                raise InputError(
                    f"{path}, line {i}: {why}; fix the line or set data.on_bad_record: skip"
                ) from e
            if text:
                yield text


def _hf_documents(
    builder: str, data_files: str | None, text_field: str, hub_id: str | None = None
) -> Iterator[str]:
    """Rows of a Hugging Face `datasets` source; one document per row's text field."""
    import datasets  # heavy import, only when needed

    datasets.disable_progress_bars()
    try:
        if hub_id is not None:
            ds = datasets.load_dataset(hub_id, split="train", streaming=True)
        else:
            ds = datasets.load_dataset(
                builder, data_files=data_files, split="train", streaming=True
            )
    except Exception as e:  # noqa: BLE001 - datasets raises many types; we re-raise with context
        offline = (
            os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        )
        hint = (
            " (the Hugging Face Hub is offline here: set HF_HUB_OFFLINE=0 where it is reachable)"
            if offline
            else ""
        )
        local = " is no local file or folder, and" if hub_id else ":"
        raise InputError(
            f"data.source {hub_id or data_files}{local} could not load the dataset{hint}: {e}"
        ) from e
    for i, row in enumerate(ds):
        if text_field not in row:
            raise InputError(
                f"data.text_field {text_field!r} is not a column of {hub_id or data_files} (row {i} has {sorted(row)})"
            )
        text = row[text_field]
        if isinstance(text, str) and text:
            yield text


def iter_documents(
    source: str,
    text_field: str,
    max_bytes: int,
    stats: CorpusStats,
    on_bad_record: str = "error",
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> Iterator[str]:
    """Documents of `source` ("stdlib", a local file/folder, or a hub dataset id), capped."""
    if source == "stdlib":
        it = _stdlib_documents(stats)
    elif Path(source).exists():
        it = _file_documents(
            Path(source), text_field, on_bad_record, stats, encoding, doc_max_bytes
        )
    elif source.count("/") == 1 and not source.startswith((".", "/", "~")):
        it = _hf_documents("", None, text_field, hub_id=source)
    else:
        raise InputError(
            f"data.source {source!r}: no such file or folder (nor a hub dataset id like owner/name)"
        )
    h = hashlib.sha256()
    try:
        for text in it:
            raw = text.encode("utf-8")
            if max_bytes and stats.bytes + len(raw) > max_bytes and stats.documents:
                break
            h.update(raw)
            h.update(b"\0")
            stats.documents += 1
            stats.bytes += len(raw)
            yield text
    finally:  # also when the reader stops early
        stats.sha256 = h.hexdigest()
    if stats.documents == 0:
        skipped = f"; skipped: {'; '.join(stats.skipped_files[:3])}" if stats.skipped_files else ""
        raise InputError(
            f"data.source {source!r}: no documents with text (read .txt/.md/.py/.sql/.rst,"
            f" .jsonl/.json and .parquet files; {stats.skipped_undecodable} undecodable file(s)"
            f" skipped{skipped})"
        )


def check_source(
    source: str,
    text_field: str = "text",
    on_bad_record: str = "error",
    encoding: str = "utf-8",
    doc_max_bytes: int = DOC_MAX_BYTES,
) -> None:
    """Raise InputError unless `source` yields at least one document: what prepare checks
    before its flow starts (missing, empty, binary-only or unreadable corpora)."""
    if source == "stdlib":
        return
    docs = iter_documents(
        source, text_field, 1, CorpusStats(), on_bad_record, encoding, doc_max_bytes
    )
    try:
        next(docs, None)  # reads up to the first document, or raises naming what is wrong
    finally:
        docs.close()


# --------------------------------------------------------------------------- token store


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class TokenWriter:
    """Appends documents' token ids to NAME.bin and their offsets to NAME.idx.npy."""

    def __init__(self, out_dir: Path, name: str, dtype: np.dtype) -> None:
        self.path = out_dir / f"{name}.bin"
        self.idx_path = out_dir / f"{name}.idx.npy"
        self.dtype = dtype
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self.offsets: list[int] = []
        self.tokens = 0

    def add(self, ids: list[int], end_id: int) -> None:
        """Append one document's ids followed by the end-of-text id."""
        self.add_many([ids], end_id)

    def add_many(self, docs: list[list[int]], end_id: int) -> None:
        """Append documents, each followed by the end-of-text id, in one write: one array
        built from all the lists at once costs far less than one per document."""
        if not docs:
            return
        lengths = np.fromiter((len(d) + 1 for d in docs), dtype=np.int64, count=len(docs))
        starts = self.tokens + np.concatenate(([0], np.cumsum(lengths[:-1])))
        total = int(lengths.sum())
        arr = np.empty(total, dtype=self.dtype)
        ends = np.cumsum(lengths) - 1
        mask = np.ones(total, dtype=bool)
        mask[ends] = False
        arr[mask] = np.fromiter(
            itertools.chain.from_iterable(docs), dtype=self.dtype, count=total - len(docs)
        )
        arr[ends] = end_id
        self.offsets.extend(starts.tolist())
        arr.tofile(self._f)
        self.tokens += total

    def close(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        np.save(self.idx_path, np.asarray(self.offsets, dtype=np.uint64))


def write_token_store(
    docs: Iterator[str],
    encode_batch: Callable[[list[str]], list[list[int]]],
    eot_id: int,
    vocab_size: int,
    out_dir: Path,
    holdout: dict[str, float],
    seed: int,
    batch_docs: int = 256,
    progress: Callable[[int], None] | None = None,
    batch_bytes: int = 8 << 20,
) -> dict[str, dict[str, int]]:
    """Tokenize `docs` into a `train` memmap and one memmap per held-out split (e.g.
    {"val": 0.05, "replay": 0.05}), splitting by document. Returns counts per split."""
    dtype = token_dtype(vocab_size)
    fractions = {name: f for name, f in holdout.items() if f > 0}
    writers = {name: TokenWriter(out_dir, name, dtype) for name in ("train", *fractions)}
    # Systematic sampling with a seeded offset per split: document i goes to split s when the
    # running count i * f_s + u_s crosses an integer, so each split gets floor-or-ceil(n * f_s)
    # documents spread evenly over the corpus, in one pass without knowing n. A document picked
    # by two splits goes to the first one listed.
    rng = random.Random(seed)
    offsets = {name: rng.random() for name in fractions}
    index = 0
    batch: list[str] = []
    pending = 0  # bytes in `batch`: memory is bounded by batch_bytes, not by document count

    def split_of(i: int) -> str:
        for name, f in fractions.items():
            if math.floor((i + 1) * f + offsets[name]) > math.floor(i * f + offsets[name]):
                return name
        return "train"

    def write(encoded: list[list[int]]) -> None:
        nonlocal index
        by_split: dict[str, list[list[int]]] = {name: [] for name in writers}
        for ids in encoded:
            by_split[split_of(index)].append(ids)
            index += 1
        for name, docs_ in by_split.items():
            writers[name].add_many(docs_, eot_id)
        if progress:
            progress(len(encoded))

    # Encode batch k+1 on a worker thread (tokenizers releases the GIL and spreads a batch over
    # all cores) while this thread reads documents and writes batch k: two batches in flight.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize") as pool:
        in_flight: Future[list[list[int]]] | None = None
        for doc in docs:
            batch.append(doc)
            pending += len(doc)
            if len(batch) >= batch_docs or pending >= batch_bytes:
                if in_flight is not None:
                    write(in_flight.result())
                in_flight = pool.submit(encode_batch, batch)
                batch, pending = [], 0
        if batch:
            if in_flight is not None:
                write(in_flight.result())
            in_flight = pool.submit(encode_batch, batch)
        if in_flight is not None:
            write(in_flight.result())
    for w in writers.values():
        w.close()
    counts = {
        name: {"tokens": w.tokens, "documents": len(w.offsets)} for name, w in writers.items()
    }
    for name, c in counts.items():
        if c["tokens"] == 0:
            raise InputError(
                f"the {name} split is empty: {index} documents are too few for the held-out"
                f" fractions {fractions}; give a larger corpus (or a larger data.max_bytes),"
                " smaller fractions, or a smaller data.doc_max_bytes (a long text file is cut"
                " into documents of at most that many characters)"
            )
    return counts


class TokenStore:
    """Read side: a memmap of one split, verified against meta.json."""

    def __init__(self, data_dir: str | Path, split: str) -> None:
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        if not meta_path.is_file():
            raise InputError(f"{meta_path} is missing: run the prepare stage first")
        self.meta = json.loads(meta_path.read_text())
        self.dtype = np.dtype(self.meta["dtype"])
        self.path = data_dir / f"{split}.bin"
        # One mapping per store (re-creating np.memmap per batch leaks, nanoGPT issue #244),
        # viewed as a plain ndarray: slicing an np.memmap subclass costs ~2x more per batch.
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r").view(np.ndarray)
        expected = self.meta["splits"][split]["tokens"]
        if len(self.tokens) != expected:
            raise InputError(
                f"{self.path}: {len(self.tokens)} tokens, meta.json says {expected}: the data is damaged"
            )
        self.vocab_size = int(self.meta["vocab_size"])

    def __len__(self) -> int:
        return len(self.tokens)


class BatchSampler:
    """Random windows of seq_len + 1 tokens, a pure function of (seed, step, micro).

    There is no hidden position: a checkpoint's step *is* the sampler state, so a resumed run
    sees the very batches an uninterrupted one would.
    """

    def __init__(self, store: TokenStore, batch_size: int, seq_len: int, seed: int) -> None:
        if len(store) <= seq_len + 1:
            raise InputError(
                f"{store.path}: {len(store)} tokens is too few for model.seq_len={seq_len}"
            )
        self.store, self.batch_size, self.seq_len, self.seed = store, batch_size, seq_len, seed

    def batch_at(
        self, step: int, micro: int = 0, seq_len: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """Windows of `seq_len` tokens (default: the sampler's own; shorter ones come from the
        same starts, so a batch is still a function of the step alone)."""
        S = min(seq_len or self.seq_len, self.seq_len)
        rng = np.random.default_rng([self.seed, micro, step])
        starts = rng.integers(0, len(self.store) - self.seq_len - 1, size=self.batch_size)
        # One vectorised gather of the (B, S + 1) windows.
        rows = self.store.tokens[starts[:, None] + np.arange(S + 1)].astype(np.int64)
        t = torch.from_numpy(rows)
        return t[:, :-1], t[:, 1:], None


@dataclass
class SFTExample:
    prompt: list[int]
    response: list[int]
    weight: float = 1.0  # how often it is drawn relative to the others


class SFTBatches:
    """Prompt -> response batches: loss on response tokens only, focus tokens weighted.

    An example longer than max_len + 1 tokens is refused (InputError with the numbers):
    cutting it would drop the schema without a word. Examples are drawn uniformly, or in
    proportion to their weights when those differ. Padding is on the right and masked out.
    """

    def __init__(
        self,
        examples: list[SFTExample],
        batch_size: int,
        max_len: int,
        seed: int,
        pad_id: int,
        focus_ids: set[int] | None = None,
        focus_weight: float = 1.0,
    ) -> None:
        if not examples:
            raise InputError("no finetuning examples")
        longest = max(len(ex.prompt) + len(ex.response) for ex in examples)
        if longest > max_len + 1:
            over = sum(len(ex.prompt) + len(ex.response) > max_len + 1 for ex in examples)
            raise InputError(
                f"{over} finetuning example(s) longer than max_len={max_len} (the longest"
                f" {longest - 1} tokens): raise the stage's max_len (and model.seq_len) to at"
                f" least {longest - 1}, or prepare the data again for these lengths"
            )
        weights = np.array([ex.weight for ex in examples], dtype=np.float64)
        self.p = None if np.all(weights == weights[0]) else weights / weights.sum()
        self.examples, self.batch_size, self.max_len, self.seed = (
            examples,
            batch_size,
            max_len,
            seed,
        )
        self.pad_id = pad_id
        self.focus = torch.tensor(sorted(focus_ids or ()), dtype=torch.int64)
        self.focus_weight = focus_weight

    def encode(self, ex: SFTExample) -> tuple[list[int], list[int]]:
        ids = (ex.prompt + ex.response)[-(self.max_len + 1) :]
        n_resp = min(len(ex.response), len(ids) - 1)
        targets = [-100] * (len(ids) - 1 - n_resp) + ids[len(ids) - n_resp :]
        return ids[:-1], targets

    def batch_at(
        self, step: int, micro: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, micro, step])
        if self.p is None:
            picks = rng.integers(0, len(self.examples), size=self.batch_size)
        else:
            picks = rng.choice(len(self.examples), size=self.batch_size, p=self.p)
        rows = [self.encode(self.examples[i]) for i in picks]
        width = max(len(x) for x, _ in rows)
        x = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        y = torch.full((len(rows), width), -100, dtype=torch.int64)
        for r, (ids, targets) in enumerate(rows):
            x[r, : len(ids)] = torch.tensor(ids)
            y[r, : len(targets)] = torch.tensor(targets)
        w = torch.ones_like(y, dtype=torch.float32)
        if self.focus.numel():
            w[torch.isin(y, self.focus)] = self.focus_weight
        return x, y, w


class MixedBatches:
    """SFT batches plus `replay.batch_size` rows of pretraining windows (replay), the
    windows as wide as that step's SFT rows: the replay rows carry loss on every token and
    never widen the batch (at the replay sampler's full width, a quarter of the rows held
    ~40% of a finetune batch's tokens in the demo; bench/RESULTS.md)."""

    def __init__(self, sft: SFTBatches, replay: BatchSampler) -> None:
        self.sft, self.replay = sft, replay

    def batch_at(
        self, step: int, micro: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, y, w = self.sft.batch_at(step, micro)
        rx, ry, _ = self.replay.batch_at(step, micro, seq_len=x.shape[1])
        width = max(x.shape[1], rx.shape[1])

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        return (
            torch.cat([pad(x, self.sft.pad_id), pad(rx, self.sft.pad_id)]),
            torch.cat([pad(y, -100), pad(ry, -100)]),
            torch.cat([pad(w, 1.0), torch.ones(rx.shape[0], width)]),
        )
