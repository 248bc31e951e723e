"""Reading tensors back from a checkpoint folder: one manifest record (an XOR delta decoded
against the same tensor in its base checkpoint), every tensor of a whole checkpoint (format
2: experts stacked again), every tensor of a sharded one assembled whole in one process
(format 3, without DCP: each record names where it sits in the whole tensor), and
`Checkpoint`, what a load returns. The caller verifies the folder first (integrity.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moe.checkpoint.codec import decode, dtype_from_name
from moe.checkpoint.layout import step_dir
from moe.checkpoint.manifest import (
    GROUPS,
    Manifest,
    TensorMeta,
    read_state,
    split_key,
    state_key,
)

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    state: dict[str, Any]
    lossy: list[str] = field(default_factory=list)  # tensors restored from a lossy codec
    # Written sharded (format 3): optimizer tensors are named "<parameter>.<moment>" and RNG
    # tensors "<rank>.<name>", where the plain format uses "<index>.<moment>" and "<name>".
    sharded: bool = False


def read_entry(
    root: Path, path: Path, meta: TensorMeta, base_index: dict[str, TensorMeta] | None
) -> torch.Tensor:
    """One stored tensor of the checkpoint folder `path` under the store's `root`; a delta
    reads its base's record (looked up in `base_index`, the base's tensors by key, when
    given) from the base checkpoint under `root`."""
    with open(path / meta.file, "rb") as f:
        f.seek(meta.offset)
        data = f.read(meta.length)
    if len(data) != meta.length:
        raise ValueError(f"{path / meta.file} is shorter than its manifest says")
    base_t = None
    if meta.base is not None:
        base_dir = step_dir(root, meta.base)
        if base_index is None:
            base_index = Manifest.read(base_dir).index()
        base_t = read_entry(root, base_dir, base_index[meta.key], None)
    return decode(meta.codec, meta.dtype, meta.shape, data, base=base_t)


def read_whole(root: Path, path: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of a one-process checkpoint by group (experts stacked again)."""
    base_indexes = {b: Manifest.read(step_dir(root, b)).index() for b in manifest.bases}
    parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
    for meta in manifest.tensors:
        idx = base_indexes.get(meta.base) if meta.base is not None else None
        t = read_entry(root, path, meta, idx)
        if meta.expert is None:
            out[meta.group][meta.name] = t
        else:
            parts.setdefault((meta.group, meta.name), {})[meta.expert] = t
    for (group, name), experts in parts.items():
        out[group][name] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def assemble(
    records: list[TensorMeta], dcp: dict, read: Callable[[TensorMeta], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Whole tensors from a sharded checkpoint's records, in one process: {key: tensor}."""
    out: dict[str, torch.Tensor] = {}
    for r in records:
        key = state_key(r.group, r.name)
        if key not in out:
            v = dcp[key]
            out[key] = torch.zeros(v["size"], dtype=dtype_from_name(v["dtype"]))
        part = read(r)
        assert r.at is not None
        dst = out[key]
        if r.expert is not None:
            dst = dst[r.at[0]]
            offs, shape = r.at[1:], part.shape
        else:
            offs, shape = r.at, part.shape
        for d, (o, n) in enumerate(zip(offs, shape, strict=True)):
            dst = dst.narrow(d, o, n)
        dst.copy_(part)
    return out


def read_assembled(
    root: Path, path: Path, manifest: Manifest
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of a sharded checkpoint by group, each assembled whole."""
    whole = assemble(manifest.tensors, manifest.dcp, lambda r: read_entry(root, path, r, None))
    out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
    for key, t in whole.items():
        group, name = split_key(key)
        out[group][name] = t
    return out


def read_checkpoint(root: Path, path: Path) -> Checkpoint:
    """Every tensor of the verified checkpoint `path`, whole, in this process (a sharded one
    assembled from every rank's shards), and its state."""
    manifest = Manifest.read(path)
    state = read_state(path)
    if manifest.sharded:
        out = read_assembled(root, path, manifest)
    else:
        out = read_whole(root, path, manifest)
    lossy = [m.key for m in manifest.tensors if m.lossy]
    if lossy:
        log.warning(
            "checkpoint %s holds %d tensors in a lossy codec (fp16 cold tier): restored "
            "rounded, not bit-exact",
            path,
            len(lossy),
        )
    return Checkpoint(
        path=path,
        step=manifest.step,
        model=out["model"],
        optimizer=out["optimizer"],
        rng=out["rng"],
        state=state,
        lossy=lossy,
        sharded=manifest.sharded,
    )
