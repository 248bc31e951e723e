"""The memmap token store, a resumable batch sampler, SFT batches and their mix with replay.

A split is three files, as in nanoGPT's `prepare.py` plus what a user needs to trust it:
`NAME.bin` (token ids, uint16 when the vocabulary fits, else uint32), `NAME.idx.npy`
(document start offsets, uint64) and the shared `meta.json` (dtype, vocabulary size, token
and document counts, tokenizer and source hashes). Writing streams: memory stays bounded by
one batch of documents, whatever the corpus size. The documents come from
moe/data/sources.py.
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe.errors import InputError

log = logging.getLogger(__name__)


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


# Examples best-fit decreasing at once in a packing plan: TRL sorts the whole dataset; a window
# keeps a row's examples from across the epoch (they are shuffled first) and the plan cheap.
PACK_WINDOW = 1024


class PackingPlan:
    """Each epoch's rows of packed examples, a pure function of (seed, epoch): the epoch's
    examples (a seeded permutation, or with weights a weighted draw of as many), sorted
    longest first within windows of PACK_WINDOW and placed best-fit (each in the row it
    leaves fullest, a new row when none has room), the rows shuffled and cut into steps of
    `rows` rows. Every example is in an epoch once, so no length is favoured (a plan that
    topped each step's rows up with whatever still fit would favour the short ones); a row
    or two more or fewer than the steps take is cut or left empty."""

    def __init__(
        self, lengths: np.ndarray, p: np.ndarray | None, seed: int, batch: int, max_len: int,
        row_multiple: int = 1,
    ) -> None:  # fmt: skip
        self.lengths, self.p, self.seed, self.max_len = lengths, p, seed, max_len
        self._epochs: dict[int, list[list[int]]] = {}
        # as many rows a micro-batch as hold `batch` examples in expectation (how full rows
        # get depends on the lengths: examples of 2/3 of max_len hardly share a row), at most
        # an epoch's rows (a small set), up to a multiple of the processes that split them
        planned = len(self.epoch(0))
        rows = min(planned, max(1, round(batch * planned / len(lengths))))
        self.rows = -(-rows // row_multiple) * row_multiple
        self.steps_per_epoch = max(1, planned // self.rows)

    def epoch(self, e: int) -> list[list[int]]:
        if e not in self._epochs:
            if len(self._epochs) > 2:  # an epoch's plan is only read in order
                self._epochs.pop(min(self._epochs))
            self._epochs[e] = self._plan(e)
        return self._epochs[e]

    def _plan(self, e: int) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, 7, e])
        n = len(self.lengths)
        order = rng.permutation(n) if self.p is None else rng.choice(n, size=n, p=self.p)
        rows: list[list[int]] = []
        for a in range(0, n, PACK_WINDOW):
            window = sorted(order[a : a + PACK_WINDOW].tolist(), key=lambda i: -self.lengths[i])
            room: list[tuple[int, int]] = []  # (room left, row), sorted: best fit by bisect
            for i in window:
                k = bisect.bisect_left(room, (int(self.lengths[i]), -1))
                if k == len(room):
                    rows.append([])
                    left, r = self.max_len, len(rows) - 1
                else:
                    left, r = room.pop(k)
                rows[r].append(i)
                bisect.insort(room, (left - int(self.lengths[i]), r))
        return [rows[k] for k in rng.permutation(len(rows))]

    def rows_at(self, index: int) -> list[list[int]]:
        """The rows of a micro-batch: `index` = step x micro-batches a step + micro."""
        e, k = divmod(index, self.steps_per_epoch)
        rows = self.epoch(e)[k * self.rows : (k + 1) * self.rows]
        return rows + [[] for _ in range(self.rows - len(rows))]


class SFTBatches:
    """Prompt -> response batches: loss on response tokens only, focus tokens weighted.

    An example longer than max_len + 1 tokens is refused (InputError with the numbers):
    cutting it would drop the schema without a word. Examples are drawn uniformly, or in
    proportion to their weights when those differ.

    Unpacked: one example a row, padded on the right to the step's longest (masked out).
    Packed (`packing`): `rows` rows of max_len tokens every step (one shape), each holding
    examples back to back, with `segments` numbering each token's example in its row (-1:
    the padding after the last) for the model's block-causal attention. The rows come from a
    plan per epoch (`PackingPlan`): every example once an epoch whatever its length, best-fit
    decreasing, `rows` rows a micro-batch: as many as hold its share of batch_size examples
    in expectation, up to a multiple of `row_multiple` (the processes that split the rows).
    batch_size is a step's: each of its `micro_batches` (grad_accum) draws batch_size /
    micro_batches examples (rounded up), packed or not.
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
        packing: bool = False,
        row_multiple: int = 1,
        micro_batches: int = 1,
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
        # each example's input tokens (prompt + response, less the last: the targets' shift)
        self.lengths = np.array(
            [min(len(e.prompt) + len(e.response), max_len + 1) - 1 for e in examples]
        )
        self.micro_batches = micro_batches
        # batch_size is a step's (the training sections' meaning, tasks/fit.py's count): each
        # of its micro-batches draws its share
        self.micro = max(1, -(-batch_size // micro_batches))
        self.plan: PackingPlan | None = None
        self.rows = self.micro
        if packing:
            self.plan = PackingPlan(self.lengths, self.p, seed, self.micro, max_len, row_multiple)
            self.rows = self.plan.rows

    def encode(self, ex: SFTExample) -> tuple[list[int], list[int]]:
        ids = (ex.prompt + ex.response)[-(self.max_len + 1) :]
        n_resp = min(len(ex.response), len(ids) - 1)
        targets = [-100] * (len(ids) - 1 - n_resp) + ids[len(ids) - n_resp :]
        return ids[:-1], targets

    def _draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.p is None:
            return rng.integers(0, len(self.examples), size=n)
        return rng.choice(len(self.examples), size=n, p=self.p)

    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, ...]:
        """(x, y, loss weights), and with packing each token's example (`segments`)."""
        if self.plan is not None:
            return self._packed(self.plan.rows_at(step * self.micro_batches + micro))
        rng = np.random.default_rng([self.seed, micro, step])
        picks = self._draw(rng, self.micro)
        rows = [self.encode(self.examples[i]) for i in picks]
        width = max(len(x) for x, _ in rows)
        x = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        y = torch.full((len(rows), width), -100, dtype=torch.int64)
        for r, (ids, targets) in enumerate(rows):
            x[r, : len(ids)] = torch.tensor(ids)
            y[r, : len(targets)] = torch.tensor(targets)
        return x, y, self._weights(y)

    def _weights(self, y: torch.Tensor) -> torch.Tensor:
        w = torch.ones_like(y, dtype=torch.float32)
        if self.focus.numel():
            w[torch.isin(y, self.focus)] = self.focus_weight
        return w

    def _packed(self, placed: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """The step's rows (each a list of examples) as tensors, with each token's example."""
        x = torch.full((self.rows, self.max_len), self.pad_id, dtype=torch.int64)
        y = torch.full((self.rows, self.max_len), -100, dtype=torch.int64)
        seg = torch.full((self.rows, self.max_len), -1, dtype=torch.int64)
        for r, row in enumerate(placed):
            at = 0
            for s, i in enumerate(row):
                ids, targets = self.encode(self.examples[i])
                x[r, at : at + len(ids)] = torch.tensor(ids)
                y[r, at : at + len(ids)] = torch.tensor(targets)
                seg[r, at : at + len(ids)] = s
                at += len(ids)
        return x, y, self._weights(y), seg


class MixedBatches:
    """SFT batches plus `replay.batch_size` rows of pretraining windows (replay), the
    windows as wide as that step's SFT rows: the replay rows carry loss on every token and
    never widen the batch (at the replay sampler's full width, a quarter of the rows held
    ~40% of a finetune batch's tokens in the demo; bench/RESULTS.md). Under packing the SFT
    rows are max_len wide, and so are the replay windows: each a single causal segment."""

    def __init__(self, sft: SFTBatches, replay: BatchSampler) -> None:
        self.sft, self.replay = sft, replay

    def batch_at(self, step: int, micro: int = 0) -> tuple[torch.Tensor, ...]:
        x, y, w, *packed = self.sft.batch_at(step, micro)
        rx, ry, _ = self.replay.batch_at(step, micro, seq_len=x.shape[1])
        width = max(x.shape[1], rx.shape[1])

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        out = (
            torch.cat([pad(x, self.sft.pad_id), pad(rx, self.sft.pad_id)]),
            torch.cat([pad(y, -100), pad(ry, -100)]),
            torch.cat([pad(w, 1.0), torch.ones(rx.shape[0], width)]),
        )
        if not packed:
            return out
        replay_seg = torch.zeros(rx.shape[0], width, dtype=torch.int64)
        return (*out, torch.cat([pad(packed[0], -1), replay_seg]))
