"""Tiered checkpoint store: every checkpoint is one consistent, verified training state.

Hierarchical (tiered) checkpoints, made safe. Tiering (moe/checkpoint/tiers.py) decides where
a tensor is stored, with which codec and how often it is written in full, never which step
it comes from:

- L0: the shared (non-expert) parameters, their optimizer state and the RNG state;
- L1: the hot experts (load >= `cold_threshold` x fair share), weights and optimizer state;
- L2: the cold experts.

Each tier is written in full every `hot_every` (L0, L1) or `cold_every` (L2) steps; between
full writes each tensor is stored as a lossless XOR delta against the same tensor in the
checkpoint that holds its last full write (one level: a delta never points at a delta).
Retention keeps the newest `max_retain`, the best by validation loss, and every checkpoint a
kept one needs as a base.

Layout: ROOT/step_00000100/{L0,L1,L2}.bin (concatenated encoded tensors, moe/checkpoint/codec.py) +
state.json + manifest.json. The manifest lists every tensor (file, offset, length, codec,
dtype, shape, base step, lossy or not), the tier of every expert, and the sha256 of every
file. A write goes to a temporary folder, every file is fsynced, the manifest is written
last, the folder is renamed into place, and `latest` is updated after. Restore verifies
every hash (the bases' too) and skips, with a warning naming it and why, a damaged or
incomplete checkpoint. Nothing is read with pickle: tensors are raw bytes described by JSON.

With `background=True` the training thread only copies the tensors to CPU memory; encoding
and writing run on a worker thread behind a bounded queue, and the stall each save causes
is measured (`stalls_s`) and logged.

`CheckpointStore` is the facade: it holds the configuration, the callers' hooks (`fetch`,
`on_saved`, `share`), the timings and the one-writer lock, and lands what its parts write
(rename into place, retention, after-save hook). The work is in the parts: whole.py and
writer.py (whole saves, in the background), sharded.py (sharded saves and restores), read.py
(loading), integrity.py (verify, latest_valid, info), offload.py (files in an object store).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from moe.checkpoint.integrity import CheckpointInfo, info, latest_valid, verify
from moe.checkpoint.layout import commit, step_dir, step_dirs
from moe.checkpoint.manifest import Manifest, TensorMeta, read_manifest, read_state
from moe.checkpoint.offload import Fetch, ensure_local, offloadable, set_locations
from moe.checkpoint.read import Checkpoint, read_checkpoint
from moe.checkpoint.retention import retain
from moe.checkpoint.sharded import (
    FileRecord,
    ShardedSaves,
    Share,
    TieredReader,
    TieredWriter,
    write_sharded_manifest,
)
from moe.checkpoint.tiers import TierPolicy
from moe.checkpoint.whole import Snapshot, WholeWriter, snapshot
from moe.checkpoint.writer import BackgroundWriter

log = logging.getLogger(__name__)


class CheckpointStore:
    """Write, verify, retain and restore tiered training checkpoints under one folder."""

    def __init__(
        self,
        root: str | Path,
        max_retain: int = 3,
        *,
        hot_every: int = 100,
        cold_every: int = 1000,
        cold_threshold: float = 0.5,
        hot_codec: str = "bg-zstd",
        cold_codec: str = "bg-zstd",
        hot_level: int = 1,
        cold_level: int = 19,
        keep_best: bool = True,
        background: bool = False,
        fetch: Fetch | None = None,
        on_saved: Callable[[Path], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.max_retain = max_retain
        self.keep_best = keep_best
        self.tiers = TierPolicy(
            hot_every=hot_every,
            cold_every=cold_every,
            cold_threshold=cold_threshold,
            hot_codec=hot_codec,
            cold_codec=cold_codec,
            hot_level=hot_level,
            cold_level=cold_level,
        )
        self.background = background
        # fetch(location, dest): bring back a file an offload moved to an object store.
        self.fetch = fetch
        # on_saved(path): called after each save lands (on the writer thread in background
        # mode); its errors are logged, never raised into training.
        self.on_saved = on_saved
        # share(path, sha256) -> location: put a file of a sharded save where every machine
        # reaches it (set for multi-node runs; None: the ranks share this folder).
        self.share: Share | None = None
        self.stalls_s: list[float] = []  # training-thread time of each save
        self.write_s: list[float] = []  # worker time of each save (encode + write)
        self._lock = threading.Lock()  # one write lands at a time
        self._whole = WholeWriter(self.root, self.tiers)
        self._writer = BackgroundWriter(self._write)
        self._sharded = ShardedSaves(self.root)

    @classmethod
    def from_config(cls, root: str | Path, cfg: Any) -> CheckpointStore:
        """A store configured by `params.yaml`'s `checkpoint` section (CheckpointConfig)."""
        return cls(
            root,
            cfg.max_retain,
            hot_every=cfg.hot_every,
            cold_every=cfg.cold_every,
            cold_threshold=cfg.cold_threshold,
            hot_codec=cfg.hot_codec,
            cold_codec=cfg.cold_codec,
            hot_level=cfg.hot_level,
            cold_level=cfg.cold_level,
            keep_best=cfg.keep_best,
            background=cfg.background,
        )

    # ------------------------------------------------------------------ listing (layout.py)

    def checkpoint_dirs(self) -> list[Path]:
        """Checkpoint folders, newest first (valid or not)."""
        return step_dirs(self.root)

    def step_dir(self, step: int) -> Path:
        return step_dir(self.root, step)

    def bases(self, path: Path) -> list[int]:
        """The steps of the checkpoints `path`'s delta-coded tiers are read against."""
        manifest = read_manifest(path)
        return manifest.bases if manifest else []

    # ------------------------------------------------------------------ saving

    def save(
        self,
        step: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        rng: dict[str, torch.Tensor],
        state: dict[str, Any],
        *,
        param_names: dict[str, str] | None = None,
        expert_load: dict[str, list[float]] | None = None,
    ) -> Path:
        """Save one training state (whole.py); returns the folder it will have.

        param_names maps an optimizer tensor's parameter index ("3" of "3.exp_avg") to the
        parameter's name, so expert optimizer state is tiered with its expert. expert_load
        maps an MoE layer prefix to each expert's load (any scale; compared to the mean).
        """
        t0 = time.perf_counter()
        self._writer.raise_failure()
        # Copy on the training thread: the next optimizer step changes the live tensors.
        snap = snapshot(model, optimizer, rng)
        job = (step, snap, json.loads(json.dumps(state)), param_names or {}, expert_load or {})
        final = self.step_dir(step)
        if self.background:
            self._writer.put(job)  # blocks while the previous save is still being written
        else:
            self._write(*job)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        log.info("checkpoint step %d: training stalled %.3fs", step, stall)
        return final

    def save_sharded(
        self,
        step: int,
        tensors: dict[str, torch.Tensor],
        state: dict[str, Any],
        *,
        expert_load: dict[str, list[float]] | None = None,
    ) -> Path:
        """Save one training state sharded (moe/checkpoint/sharded.py): every rank calls this with its
        shards (DTensors, or plain tensors, under "model.<fqn>", "optim.<fqn>.<moment>" and
        "rng.<rank>.<name>") and the same JSON `state`. Each rank writes its own files; rank 0
        writes the state and the manifest, renames the folder into place and keeps the
        retention policy. Asynchronous when the store is `background`: the call returns once
        the shards are copied to host memory, after the previous save has landed."""
        t0 = time.perf_counter()
        tmp = self._sharded.begin(step, self.share)
        expert_tiers = self.tiers.expert_tiers(expert_load or {})
        state = json.loads(json.dumps(state))
        finish = functools.partial(self._finish_sharded, t0, tmp, step, state, expert_tiers)
        writer = TieredWriter(tmp, expert_tiers, self.tiers, self.share, finish)
        self._sharded.run(tensors, writer, self.background)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        log.info("sharded checkpoint step %d: training stalled %.3fs", step, stall)
        return self.step_dir(step)

    def flush(self) -> None:
        """Wait until every queued save is on disk; raise if one failed."""
        self._sharded.wait()
        self._writer.join()
        self._writer.raise_failure()

    def close(self) -> None:
        self._sharded.wait()
        self._writer.stop()
        self._writer.raise_failure()

    # ------------------------------------------------------------------ integrity.py

    def verify(self, path: Path) -> str | None:
        """None when `path` is a complete checkpoint whose files (and bases) match their
        manifests; else why not."""
        return verify(self.root, path)

    def latest_valid(self) -> Path | None:
        """Newest checkpoint that verifies; damaged ones are skipped with a warning."""
        self.flush()
        return latest_valid(self.root)

    def info(self) -> list[CheckpointInfo]:
        """Every checkpoint folder, newest first, with its size, tiers and validity."""
        return info(self.root)

    # ------------------------------------------------------------------ offload.py

    def offloadable(self, path: Path, hot: bool) -> list[str]:
        """The files of a checkpoint folder that may live in an object store instead."""
        return offloadable(path, hot)

    def set_locations(self, path: Path, moved: dict[str, str]) -> None:
        """Record that files of `path` now live at object-store locations."""
        set_locations(path, moved)

    def ensure_local(self, path: Path) -> None:
        """Fetch back (verified) the files of `path` and its bases an offload moved away."""
        ensure_local(self.root, path, self.fetch)

    # ------------------------------------------------------------------ loading (read.py)

    def load(self, path: Path) -> Checkpoint:
        """Every tensor of a checkpoint, whole, in this process (a sharded one assembled from
        every rank's shards)."""
        self._verified(path)
        self.flush()
        return read_checkpoint(self.root, path)

    def load_sharded(self, path: Path, targets: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Read a sharded checkpoint into `targets` in place (every rank, with the tensors of
        the layout it has now: DTensors are resharded, keys as in save_sharded; each must be
        in the checkpoint, see `sharded_keys`); returns its state.json."""
        self._verified(path)
        manifest = Manifest.read(path)
        if not manifest.sharded:
            raise ValueError(f"{path} is not a sharded checkpoint (format {manifest.format})")
        reader = TieredReader(self.root, path, manifest.tensors, manifest.dcp)
        dcp.load(targets, storage_reader=reader)
        return read_state(path)

    def read_state(self, path: Path) -> tuple[Manifest, dict[str, Any]]:
        """A checkpoint's manifest and state.json, without its tensors."""
        self.ensure_local(path)
        return Manifest.read(path), read_state(path)

    def clear(self) -> None:
        self.flush()
        for p in self.checkpoint_dirs():
            shutil.rmtree(p, ignore_errors=True)
        (self.root / "latest").unlink(missing_ok=True)

    # ------------------------------------------------------------------ landing a write

    def _verified(self, path: Path) -> None:
        """Fetch what an offload moved away, then raise unless `path` verifies."""
        self.ensure_local(path)
        why = self.verify(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} failed verification: {why}")

    def _write(
        self,
        step: int,
        snap: Snapshot,
        state: dict[str, Any],
        param_names: dict[str, str],
        expert_load: dict[str, list[float]],
    ) -> None:
        """Write one whole checkpoint (whole.py) and land it; the after-save hook (offload,
        mirror) runs once it has landed. On the writer thread in background mode."""
        t0 = time.perf_counter()
        with self._lock:
            tmp, full = self._whole.write(step, snap, state, param_names, expert_load)
            final = self._land(tmp, step)
        dt = time.perf_counter() - t0
        self.write_s.append(dt)
        self._after_save(final)
        log.info(
            "checkpoint step %d written to %s in %.2fs (full tiers: %s)",
            step,
            final,
            dt,
            ",".join(sorted(full)) or "none",
        )

    def _finish_sharded(
        self,
        t0: float,
        tmp: Path,
        step: int,
        state: dict[str, Any],
        expert_tiers: dict[str, dict[str, list[int]]],
        records: list[TensorMeta],
        files: dict[str, FileRecord],
        md: Any,
    ) -> None:
        """Rank 0, once every rank has written: the manifest (sharded.py), then land it."""
        with self._lock:
            write_sharded_manifest(tmp, step, state, expert_tiers, records, files, md)
            final = self._land(tmp, step)
        self.write_s.append(time.perf_counter() - t0)
        log.info("sharded checkpoint step %d written to %s", step, final)
        if self.on_saved is not None:
            self._sharded.after(self._after_save, final)

    def _land(self, tmp: Path, step: int) -> Path:
        """Rename the finished folder into place, point `latest` at it, apply retention."""
        final = commit(self.root, tmp, step)
        retain(self.root, self.max_retain, self.keep_best)
        return final

    def _after_save(self, final: Path) -> None:
        if self.on_saved is None:
            return
        try:
            self.on_saved(final)
        except Exception as e:  # e.g. the object store is down: the next pass retries
            log.warning("after-save hook failed for %s: %s", final, e)
