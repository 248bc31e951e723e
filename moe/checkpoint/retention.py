"""Retention: which checkpoints stay after a save. Kept: the newest `max_retain`, the best by
validation loss (`keep_best`), every checkpoint another version wrote (not this one's to
judge) and every base checkpoint a kept one's deltas read against; the rest are deleted."""

from __future__ import annotations

import shutil
from pathlib import Path

from moe.checkpoint.layout import step_dir, step_dirs
from moe.checkpoint.manifest import Manifest, ManifestError


def retain(root: Path, max_retain: int, keep_best: bool) -> None:
    """Delete the checkpoint folders under `root` the policy does not keep."""
    dirs = step_dirs(root)
    keep = set(dirs[:max_retain])
    manifests: dict[Path, Manifest] = {}  # each read once
    for p in dirs:
        try:
            manifests[p] = Manifest.read(p)
        except ManifestError as e:
            if e.other_format:  # another version's checkpoint is not this one's to judge
                keep.add(p)
    if keep_best:
        losses = [(m.val_loss, p) for p, m in manifests.items() if m.val_loss is not None]
        if losses:
            keep.add(min(losses, key=lambda vp: vp[0])[1])
    # Never delete a base that a kept checkpoint needs.
    for p in list(keep):
        if p in manifests:
            keep.update(step_dir(root, b) for b in manifests[p].bases)
    for old in dirs:
        if old not in keep:
            shutil.rmtree(old, ignore_errors=True)
