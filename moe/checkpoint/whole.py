"""Writing a whole checkpoint (format 2: one process wrote every tensor whole) into a
temporary folder, ready to be renamed into place.

Every tensor goes to its tier's file (moe/checkpoint/tiers.py): a shared tensor whole in L0,
an expert weight (and its optimizer moments) as one record per expert in L1 (hot) or L2
(cold). Each tier is written in full every `hot_every` (L0, L1) or `cold_every` (L2) steps;
between full writes each tensor is stored as a lossless XOR delta against the same tensor in
the checkpoint that holds its last full write (one level: a delta never points at a delta),
where that is smaller. Then state.json, every file fsynced, and the manifest last.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moe.checkpoint.codec import LOSSY, encode
from moe.checkpoint.integrity import verify
from moe.checkpoint.layout import fresh_tmp, step_dir, step_dirs
from moe.checkpoint.manifest import (
    GROUPS,
    FileMeta,
    Manifest,
    TensorMeta,
    read_manifest,
    tensor_meta,
    write_state,
)
from moe.checkpoint.read import read_entry
from moe.checkpoint.tiers import TIERS, TierPolicy, expert_counts, expert_tier, tensor_layer
from moe.hashing import sha256_file

Snapshot = dict[str, dict[str, torch.Tensor]]  # group -> tensor name -> CPU copy


class _Entry(NamedTuple):
    """One tensor of a checkpoint to write: a whole shared tensor (expert None, tier L0) or
    one expert's slice of an expert weight or its optimizer moment (tier L1 or L2)."""

    group: str
    name: str
    expert: int | None
    tier: str
    tensor: torch.Tensor


def snapshot(
    model: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor], rng: dict[str, torch.Tensor]
) -> Snapshot:
    """CPU copies of the tensors to save, taken on the training thread (the next optimizer
    step changes the live tensors)."""
    return {
        "model": {k: v.detach().to("cpu", copy=True) for k, v in model.items()},
        "optimizer": {k: v.detach().to("cpu", copy=True) for k, v in optimizer.items()},
        "rng": {k: v.detach().to("cpu", copy=True) for k, v in rng.items()},
    }


def entries(
    snap: Snapshot, param_names: dict[str, str], expert_tiers: dict[str, dict[str, list[int]]]
) -> list[_Entry]:
    """Every tensor to write and its tier: shared tensors in L0, each expert's slice of an
    expert weight (and its optimizer moments) in L1 if hot, L2 if cold."""
    out: list[_Entry] = []
    for group in GROUPS:
        for name, t in snap[group].items():
            layer = tensor_layer(group, name, t, param_names)
            if layer is None:
                out.append(_Entry(group, name, None, "L0", t))
                continue
            for e in range(t.shape[0]):
                out.append(_Entry(group, name, e, expert_tier(expert_tiers, layer, e), t[e]))
    return out


class WholeWriter:
    """Writes whole checkpoints of the store at `root` with the tier policy `tiers`."""

    def __init__(self, root: Path, tiers: TierPolicy) -> None:
        self.root, self.tiers = root, tiers

    def write(
        self,
        step: int,
        snap: Snapshot,
        state: dict[str, Any],
        param_names: dict[str, str],
        expert_load: dict[str, list[float]],
    ) -> tuple[Path, set[str]]:
        """Write one checkpoint into a fresh temporary folder: the tensors tier by tier, the
        state, the manifest last. Returns the folder and the tiers written in full."""
        tmp = fresh_tmp(self.root, step)
        last_full = self.last_full()
        full = self.tiers.full_tiers(step, last_full)
        expert_tiers = self.tiers.expert_tiers(expert_load)
        todo = entries(snap, param_names, expert_tiers)
        tensors_meta = self.write_tensors(tmp, todo, full, last_full)
        write_state(tmp, state)
        Manifest(
            step=step,
            time=time.time(),
            full_tiers=sorted(full),
            bases=sorted({m.base for m in tensors_meta if m.base is not None}),
            experts=expert_tiers,
            expert_counts=expert_counts(expert_tiers),
            lossy=any(m.lossy for m in tensors_meta),
            val_loss=state.get("val_loss"),
            tensors=tensors_meta,
            files={
                p.name: FileMeta(sha256_file(p), p.stat().st_size) for p in sorted(tmp.iterdir())
            },
        ).write(tmp)  # last
        return tmp, full

    def last_full(self) -> dict[str, Manifest]:
        """Per tier: the manifest of the newest valid checkpoint that wrote it in full."""
        out: dict[str, Manifest] = {}
        for path in step_dirs(self.root):
            m = read_manifest(path)
            if m is None or m.sharded:  # deltas read against whole tensors only
                continue
            for tier in m.full_tiers:
                if tier not in out and verify(self.root, path) is None:
                    out[tier] = m
            if len(out) == 3:
                break
        return out

    def write_tensors(
        self,
        tmp: Path,
        todo: list[_Entry],
        full: set[str],
        last_full: dict[str, Manifest],
    ) -> list[TensorMeta]:
        """Encode every entry into its tier's file; returns their manifest records."""
        base_index: dict[int, dict[str, TensorMeta]] = {}  # base step -> its tensors by key
        tensors_meta: list[TensorMeta] = []
        handles = {tier: open(tmp / f"{tier}.bin", "wb") for tier in TIERS}
        try:
            for group, name, e, tier, t in todo:
                key = f"{group}/{name}" + ("" if e is None else f"[{e}]")
                codec, base_t, base_step = self.choose(key, tier, t, full, last_full, base_index)
                level = self.tiers.level(tier)
                enc = encode(t, codec, base=base_t, level=level)
                if base_t is not None:
                    # A delta only where it pays: after a large update (high lr) the XOR is
                    # as random as the tensor.
                    full_enc = encode(t, self.tiers.codec(tier), level=level)
                    if len(full_enc.data) <= len(enc.data):
                        enc, base_step = full_enc, None
                f = handles[tier]
                offset = f.tell()
                f.write(enc.data)
                tensors_meta.append(
                    tensor_meta(
                        enc,
                        key=key,
                        group=group,
                        name=name,
                        expert=e,
                        tier=tier,
                        file=f"{tier}.bin",
                        offset=offset,
                        base=base_step,
                    )
                )
            for f in handles.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in handles.values():
                f.close()
        return tensors_meta

    def choose(
        self,
        key: str,
        tier: str,
        t: torch.Tensor,
        full: set[str],
        last_full: dict[str, Manifest],
        base_index: dict[int, dict[str, TensorMeta]],
    ) -> tuple[str, torch.Tensor | None, int | None]:
        """(codec, base tensor, base step) for one entry."""
        full_codec = self.tiers.codec(tier)
        if tier in full or tier not in last_full:
            return full_codec, None, None
        manifest = last_full[tier]
        base_step = manifest.step
        if base_step not in base_index:  # built once per base, not once per tensor
            base_index[base_step] = manifest.index()
        meta = base_index[base_step].get(key)
        if (
            meta is None
            or meta.base is not None
            or meta.codec in LOSSY
            or meta.dtype != str(t.dtype).removeprefix("torch.")
            or list(meta.shape) != list(t.shape)
        ):
            return full_codec, None, None  # no lossless full copy to diff against
        base_dir = step_dir(self.root, base_step)
        if not (base_dir / meta.file).is_file():
            return full_codec, None, None  # the base was offloaded: write in full
        base_t = read_entry(self.root, base_dir, meta, None)
        return "xor-zstd", base_t, base_step
