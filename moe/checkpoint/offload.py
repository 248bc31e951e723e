"""Checkpoint files that live in an object store: which files of a folder may be moved there
(an offload, tasks/checkpoints.py, moves them), recording where they went in the manifest,
and fetching them back, verified against the manifest's sha256, before a restore reads them.
Manifests always stay local."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

from moe.checkpoint.layout import MANIFEST, STATE, TENSOR_FILES, step_dir
from moe.checkpoint.manifest import read_manifest
from moe.hashing import sha256_file

log = logging.getLogger(__name__)

Fetch = Callable[[str, Path], None]  # fetch(location, dest): bring one file back


def offloadable(path: Path, hot: bool) -> list[str]:
    """The files of a checkpoint folder that may live in an object store instead: the
    cold tier of a checkpoint kept hot (the newest, or a base the next save diffs
    against), every tensor file and the state of any other. Manifests stay local."""
    manifest = read_manifest(path)
    names = list(manifest.files) if manifest else [*TENSOR_FILES, STATE]
    if hot:  # L2.bin, or every rank's rNNN.L2.bin in a sharded checkpoint
        names = [n for n in names if n.endswith("L2.bin")]
    else:
        names = [n for n in names if n.endswith(".bin") or n == STATE]
    return [n for n in names if (path / n).is_file()]


def set_locations(path: Path, moved: dict[str, str]) -> None:
    """Record that files of `path` now live at object-store locations (the manifest is
    rewritten atomically; the files' hashes stay as they were)."""
    manifest = read_manifest(path)
    if manifest is None:
        raise ValueError(f"{path} has no readable manifest")
    manifest.locations.update(moved)
    manifest.write(path, ".manifest.tmp")
    os.replace(path / ".manifest.tmp", path / MANIFEST)


def ensure_local(root: Path, path: Path, fetch: Fetch | None) -> None:
    """Fetch back the files of `path` (and of its bases under `root`) that an offload moved
    to an object store, verify each against the manifest's sha256, and mark them local."""
    manifest = read_manifest(path)
    if manifest is None:
        return
    for b in manifest.bases:
        ensure_local(root, step_dir(root, b), fetch)
    missing = {n: loc for n, loc in manifest.locations.items() if not (path / n).is_file()}
    if not missing:
        return
    if fetch is None:
        raise ValueError(
            f"checkpoint {path} has files in an object store ({', '.join(sorted(missing))}) "
            "and this store has no way to fetch them: pass fetch= (the training stages do)"
        )
    for name, loc in missing.items():
        if (path / name).is_file():
            continue  # another rank of this machine fetched it meanwhile
        tmp = path / f".{name}.{os.getpid()}.fetch"  # ranks of one machine fetch at once
        fetch(loc, tmp)
        want = manifest.files[name].sha256
        if sha256_file(tmp) != want:
            tmp.unlink(missing_ok=True)
            raise ValueError(
                f"{loc} (file {name} of checkpoint {path.name}) does not match its sha256: "
                "the stored copy is damaged"
            )
        os.replace(tmp, path / name)
        log.info("fetched %s of %s from %s", name, path.name, loc)
