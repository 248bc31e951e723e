"""Where a checkpoint's things are on disk: the names of a checkpoint folder's files, the
step folders under a store's root (naming, listing), the temporary folders of writes in
progress, and landing a finished folder durably (fsync, rename into place, `latest`).

ROOT/step_00000100/{L0,L1,L2}.bin + state.json + manifest.json (a sharded checkpoint:
rNNN.{L0,L1,L2}.bin per rank); ROOT/latest names the newest step folder; a write in progress
is ROOT/.tmp-step_00000100-<pid> (or -sharded) until it is renamed into place.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
TENSOR_FILES = ("L0.bin", "L1.bin", "L2.bin")  # the tiers' files in a checkpoint folder
STATE = "state.json"


def step_dir_name(step: int) -> str:
    """The folder name of step `step`'s checkpoint (the only place the layout says it)."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name stands for, or None for any other name."""
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else None


def step_dir(root: Path, step: int) -> Path:
    """The folder of step `step`'s checkpoint under `root`."""
    return root / step_dir_name(step)


def step_dirs(root: Path) -> list[Path]:
    """Checkpoint folders under `root`, newest first (valid or not)."""
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.glob("step_*") if p.is_dir() and step_of(p.name) is not None),
        reverse=True,
    )


def rank_file(rank: int, tier: str) -> str:
    """A rank's file of one tier in a sharded checkpoint folder."""
    return f"r{rank:03d}.{tier}.bin"


def fsync_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """fsync a folder (its entries: a rename into it is durable after this)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_writes(root: Path) -> None:
    """Remove the temporary folders a write that never finished left (a process that
    died mid-write; the store has one writer at a time)."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step_*"):
        log.info("removing an unfinished checkpoint write: %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def fresh_tmp(root: Path, step: int) -> Path:
    """An empty temporary folder for step's checkpoint (stale ones are removed)."""
    remove_stale_writes(root)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def sharded_tmp(root: Path, step: int) -> Path:
    """The temporary folder every rank of a sharded save of step `step` writes into."""
    return root / f".tmp-{step_dir_name(step)}-sharded"


def commit(root: Path, tmp: Path, step: int) -> Path:
    """Rename the finished folder into place, then point `latest` at it (both durable)."""
    fsync_dir(tmp)
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_write(root / ".latest.tmp", final.name.encode())
    os.replace(root / ".latest.tmp", root / "latest")
    fsync_dir(root)
    return final
