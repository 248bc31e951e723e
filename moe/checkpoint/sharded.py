"""Sharded checkpoints: torch.distributed.checkpoint (DCP) on top of the tiered store.

DCP plans which rank writes which chunk of which tensor (each rank its own shards; a tensor
replicated on several ranks once) and, on restore, which chunks each rank reads for the
layout it has now: another world size or expert-parallel degree reads the same checkpoint.
This module is DCP's storage layer, so a sharded checkpoint is a checkpoint of the store
(moe/checkpoint/store.py) like any other:

- each rank encodes its chunks into its own tier files, `rNNN.L0.bin` (shared tensors),
  `rNNN.L1.bin` (hot experts), `rNNN.L2.bin` (cold experts), with the tier's codec
  (byte-grouped zstd or lzma); an expert chunk is split into one record per expert, so hot
  and cold experts land in their tiers;
- each rank hashes its files; the coordinator (rank 0) receives every rank's records and
  hashes, writes state.json and the manifest (format 3) last, renames the folder into place
  and applies retention; the after-save hook (offload, the multi-node mirror) runs after;
- across machines (no shared folder) each rank first puts its files in shared storage (the
  store's `share`: the multi-node mirror's content-addressed objects), and the manifest
  names where the files of other machines are (`locations`, as for offloaded files): the
  coordinator's folder verifies, and a restore on any machine fetches what it lacks;
- a restore verifies every hash first (a damaged shard makes the store fall back to the
  previous checkpoint), then each rank decodes only the records of the chunks it needs.

Nothing is read with pickle: DCP's metadata (each tensor's global size and chunks) is kept as
JSON in the manifest. Every record also names where it sits in the whole tensor, so one
process (world size 1, the evaluation stage, `moe-pipeline` commands) assembles whole tensors
from a sharded checkpoint without DCP (`CheckpointStore.load`).

Saves are asynchronous when the store is (`dcp.async_save` on a gloo group of its own: the
training thread waits for the copy to host memory only); a save waits for the one before it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint import StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from moe.checkpoint.codec import dtype_from_name, dtype_name, encode
from moe.hashing import sha256_file

if TYPE_CHECKING:
    from moe.checkpoint.store import CheckpointStore, TensorMeta

SHARDED_FORMAT = 3


def split_key(key: str) -> tuple[str, str]:
    """A sharded state key -> (group, tensor name): "model.<fqn>", "optim.<fqn>.<moment>",
    "rng.<rank>.<name>"."""
    group, _, name = key.partition(".")
    return {"optim": "optimizer"}.get(group, group), name


def param_of(key: str) -> str:
    """The parameter a model or optimizer key belongs to ("" for RNG state)."""
    group, name = split_key(key)
    if group == "model":
        return name
    if group == "optimizer":
        return name.rsplit(".", 1)[0]
    return ""


def rank_file(rank: int, tier: str) -> str:
    return f"r{rank:03d}.{tier}.bin"


class TieredWriter(StorageWriter):
    """DCP storage writer into a store's temporary checkpoint folder (see the module doc)."""

    def __init__(
        self,
        store: CheckpointStore,
        tmp: Path,
        expert_tiers: dict[str, dict[str, list[int]]],
        on_finish: Callable[[list[TensorMeta], dict[str, tuple[str, int, str]], Metadata], None],
    ) -> None:
        super().__init__()
        self.store, self.tmp, self.expert_tiers = store, tmp, expert_tiers
        self.on_finish = on_finish
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def storage_meta(self) -> StorageMeta | None:
        return None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Runs on the coordinator before any rank writes: each rank learns its file prefix.
        self.tmp.mkdir(parents=True, exist_ok=True)
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def _tier(self, key: str, expert: int | None) -> str:
        from moe.checkpoint.store import expert_layer

        if expert is None:
            return "L0"
        layer = expert_layer(param_of(key)) or ""
        return "L2" if expert in set(self.expert_tiers.get(layer, {}).get("cold", [])) else "L1"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from moe.checkpoint.store import expert_layer, tensor_meta

        rank = int(plan.storage_data)
        self.tmp.mkdir(parents=True, exist_ok=True)
        store = self.store
        handles: dict[str, Any] = {}
        results: list[WriteResult] = []
        try:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise TypeError(
                        f"{item.index.fqn}: only tensors go into a sharded checkpoint "
                        "(everything else is in state.json)"
                    )
                t = planner.resolve_data(item).detach().to("cpu").contiguous()
                key = item.index.fqn
                at0 = list(item.tensor_data.chunk.offsets)
                expert_rows = (
                    expert_layer(param_of(key)) is not None and t.dim() >= 2 and t.shape[0] > 0
                )
                parts = (
                    [(at0[0] + i, t[i], [at0[0] + i, *at0[1:]]) for i in range(t.shape[0])]
                    if expert_rows
                    else [(None, t, at0)]
                )
                records = []
                for expert, part, at in parts:
                    tier = self._tier(key, expert)
                    codec = store.cold_codec if tier == "L2" else store.hot_codec
                    level = store.cold_level if tier == "L2" else store.hot_level
                    enc = encode(part.contiguous(), codec, level=level)
                    name = rank_file(rank, tier)
                    if name not in handles:
                        handles[name] = open(self.tmp / name, "wb")
                    f = handles[name]
                    offset = f.tell()
                    f.write(enc.data)
                    group, tname = split_key(key)
                    records.append(
                        tensor_meta(
                            enc,
                            key=f"{key}@{','.join(map(str, at))}",
                            group=group,
                            name=tname,
                            expert=expert,
                            tier=tier,
                            file=name,
                            offset=offset,
                            base=None,
                            at=at,
                            chunk=at0,
                        )
                    )
                results.append(
                    WriteResult(
                        index=item.index,
                        size_in_bytes=sum(r.length for r in records),
                        storage_data={"records": [dataclasses.asdict(r) for r in records]},
                    )
                )
            for f in handles.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in handles.values():
                f.close()
        files: dict[str, tuple[str, int, str]] = {}
        for n in handles:
            digest, size = sha256_file(self.tmp / n), (self.tmp / n).stat().st_size
            # Across machines each rank's files go to shared storage before the coordinator
            # writes the manifest, which names them there.
            loc = store.share(self.tmp / n, digest) if store.share is not None else ""
            files[n] = (digest, size, loc)
        if results:  # the rank's files travel with its last result to the coordinator
            results[-1].storage_data["files"] = files
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        from moe.checkpoint.store import TensorMeta

        records: list[TensorMeta] = []
        files: dict[str, tuple[str, int, str]] = {}
        for rank_results in results:
            for r in rank_results:
                records.extend(TensorMeta(**m) for m in r.storage_data["records"])
                files.update(r.storage_data.get("files", {}))
        self.on_finish(records, files, metadata)


def metadata_json(metadata: Metadata) -> dict[str, Any]:
    """DCP's metadata as JSON: every tensor's dtype, global size and chunks."""
    out: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(f"{key}: only tensors go into a sharded checkpoint")
        out[key] = {
            "dtype": dtype_name(md.properties.dtype),
            "size": list(md.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks],
        }
    return out


class TieredReader(StorageReader):
    """DCP storage reader of a verified sharded checkpoint folder."""

    def __init__(self, store: CheckpointStore, path: Path, records: list[TensorMeta], dcp: dict):
        super().__init__()
        self.store, self.path, self.dcp = store, path, dcp
        self.by_chunk: dict[tuple[str, tuple[int, ...]], list[TensorMeta]] = {}
        for r in records:
            group = {"optimizer": "optim"}.get(r.group, r.group)
            assert r.chunk is not None
            self.by_chunk.setdefault((f"{group}.{r.name}", tuple(r.chunk)), []).append(r)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = {
            key: TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype_from_name(v["dtype"])),
                size=torch.Size(v["size"]),
                chunks=[
                    ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
                    for o, s in v["chunks"]
                ],
            )
            for key, v in self.dcp.items()
        }
        return Metadata(state_dict_metadata=md)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *a: Any, **k: Any):
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def chunk(self, key: str, offsets: tuple[int, ...], sizes: list[int]) -> torch.Tensor:
        """One stored chunk, assembled from its records (one per expert for expert rows)."""
        records = self.by_chunk[(key, offsets)]
        if len(records) == 1 and records[0].expert is None:
            return self.store._read_entry(self.path, records[0], None)
        out = torch.empty(sizes, dtype=dtype_from_name(records[0].dtype))
        for r in records:
            assert r.at is not None
            out[r.at[0] - offsets[0]] = self.store._read_entry(self.path, r, None)
        return out

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        cache: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        for item in plan.items:
            idx: MetadataIndex = item.storage_index
            offsets = tuple(idx.offset or ())
            ck = (idx.fqn, offsets)
            if ck not in cache:
                sizes = next(s for o, s in self.dcp[idx.fqn]["chunks"] if tuple(o) == offsets)
                cache = {ck: self.chunk(idx.fqn, offsets, sizes)}  # chunks come in order
            src = cache[ck]
            for d, (o, n) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                src = src.narrow(d, o, n)
            target = planner.resolve_tensor(item).detach()
            target.copy_(src)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def assemble(records: list[TensorMeta], dcp: dict, read: Callable[[TensorMeta], torch.Tensor]):
    """Whole tensors from a sharded checkpoint's records, in one process: {key: tensor}."""
    out: dict[str, torch.Tensor] = {}
    for r in records:
        group = {"optimizer": "optim"}.get(r.group, r.group)
        key = f"{group}.{r.name}"
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
