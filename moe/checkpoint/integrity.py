"""Integrity: whether a checkpoint folder is complete and undamaged (every file, and every
base checkpoint its deltas read against, matches its manifest's sha256), the newest one that
is, and the report of every folder (size, tiers, experts, validity) `checkpoint ls` prints.
A damaged or incomplete checkpoint is skipped with a warning naming it and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from moe.checkpoint.layout import step_dir, step_dirs, step_of
from moe.checkpoint.manifest import Manifest, ManifestError, read_manifest
from moe.hashing import sha256_file

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    bytes: int
    tiers: dict[str, int]  # tier -> bytes
    experts: dict[str, dict[str, list[int]]]  # MoE layer -> {"hot": [...], "cold": [...]}
    deltas: int  # tensors stored as deltas
    bases: list[int]  # steps this checkpoint needs
    lossy: bool
    problem: str | None  # None = valid
    remote: dict[str, str] = field(default_factory=dict)  # file -> object-store location
    ranks: int = 0  # the processes a sharded checkpoint's files come from (0: one, whole)


def verify(root: Path, path: Path, _depth: int = 0) -> str | None:
    """None when `path` is a complete checkpoint whose files (and bases, under `root`) match
    their manifests; else why not."""
    try:
        manifest = Manifest.read(path)
    except ManifestError as e:
        return str(e)
    files, locations = manifest.files, manifest.locations
    folder = path.resolve()
    for name, meta in files.items():
        f = (path / name).resolve()
        if f.parent != folder:
            return f"manifest names a file outside the checkpoint folder: {name!r}"
        if not f.is_file():
            if name in locations:
                continue  # offloaded: its hash is checked when it is fetched back
            return f"{name} is missing"
        if sha256_file(f) != meta.sha256:
            return f"{name} does not match its sha256 (damaged)"
    for t in manifest.tensors:
        if t.file not in files:
            return f"tensor {t.key} names a file the manifest does not list: {t.file!r}"
    if _depth == 0:
        for b in manifest.bases:
            base = step_dir(root, b)
            why = verify(root, base, _depth=1) if base.is_dir() else "it is missing"
            if why is not None:
                return f"its base checkpoint {base.name} is not usable: {why}"
    return None


def latest_valid(root: Path) -> Path | None:
    """Newest checkpoint under `root` that verifies; damaged ones are skipped with a warning."""
    for path in step_dirs(root):
        why = verify(root, path)
        if why is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, why)
    return None


def info(root: Path) -> list[CheckpointInfo]:
    """Every checkpoint folder under `root`, newest first, with its size, tiers and validity."""
    rows = []
    for path in step_dirs(root):
        # A folder without a manifest this version reads is listed with its problem.
        m = read_manifest(path) or Manifest(step=step_of(path.name) or 0, tensors=[], files={})
        tiers: dict[str, int] = {}
        for t in m.tensors:
            tiers[t.tier] = tiers.get(t.tier, 0) + t.length
        rows.append(
            CheckpointInfo(
                path=path,
                step=m.step,
                bytes=sum(f.bytes for f in m.files.values()),
                tiers=tiers,
                experts=m.experts,
                deltas=sum(1 for t in m.tensors if t.base is not None),
                bases=m.bases,
                lossy=m.lossy,
                problem=verify(root, path),
                remote={n: loc for n, loc in m.locations.items() if not (path / n).is_file()},
                ranks=len({n.split(".")[0] for n in m.files if n.endswith(".bin")})
                if m.sharded
                else 0,
            )
        )
    return rows
