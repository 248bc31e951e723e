"""Sharded checkpoints: torch.distributed.checkpoint (DCP) on top of the tiered store.

DCP plans which rank writes which chunk of which tensor (each rank its own shards; a tensor
replicated on several ranks once) and, on restore, which chunks each rank reads for the
layout it has now: another world size or expert-parallel degree reads the same checkpoint.
This module is DCP's storage layer, so a sharded checkpoint is a checkpoint of the store
(moe/checkpoint/store.py) like any other:

- each rank encodes its chunks into its own tier files, `rNNN.L0.bin` (shared tensors),
  `rNNN.L1.bin` (hot experts), `rNNN.L2.bin` (cold experts), with the tier's codec
  (byte-grouped zstd or lzma, moe/checkpoint/tiers.py); an expert chunk is split into one
  record per expert, so hot and cold experts land in their tiers;
- each rank hashes its files; the coordinator (rank 0) receives every rank's records and
  hashes, writes state.json and the manifest (format 3) last; the store then renames the
  folder into place and applies retention; the after-save hook (offload, the multi-node
  mirror) runs after, on a thread of its own;
- across machines (no shared folder) each rank first puts its files in shared storage (the
  store's `share`: the multi-node mirror's content-addressed objects), and the manifest
  names where the files of other machines are (`locations`, as for offloaded files): the
  coordinator's folder verifies, and a restore on any machine fetches what it lacks;
- a restore verifies every hash first (a damaged shard makes the store fall back to the
  previous checkpoint), then each rank decodes only the records of the chunks it needs.

Nothing is read with pickle: DCP's metadata (each tensor's global size and chunks) is kept as
JSON in the manifest. Every record also names where it sits in the whole tensor, so one
process (world size 1, the evaluation stage, `moe-pipeline` commands) assembles whole tensors
from a sharded checkpoint without DCP (moe/checkpoint/read.py).

Saves are asynchronous when the store is (`dcp.async_save` on a gloo group of its own: the
training thread waits for the copy to host memory only); a save waits for the one before it.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
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
from moe.checkpoint.layout import STATE, rank_file, remove_stale_writes, sharded_tmp
from moe.checkpoint.manifest import (
    SHARDED_FORMAT,
    FileMeta,
    Manifest,
    TensorMeta,
    param_of,
    split_key,
    state_key,
    tensor_meta,
    write_state,
)
from moe.checkpoint.read import read_entry
from moe.checkpoint.tiers import TierPolicy, expert_counts, expert_layer, expert_tier
from moe.hashing import sha256_file

Share = Callable[[Path, str], str]  # share(path, sha256) -> location every machine reaches
FileRecord = tuple[str, int, str]  # a rank's file: sha256, bytes, shared location ("": none)


class TieredWriter(StorageWriter):
    """DCP storage writer into a store's temporary checkpoint folder (see the module doc)."""

    def __init__(
        self,
        tmp: Path,
        expert_tiers: dict[str, dict[str, list[int]]],
        tiers: TierPolicy,
        share: Share | None,
        on_finish: Callable[[list[TensorMeta], dict[str, FileRecord], Metadata], None],
    ) -> None:
        super().__init__()
        self.tmp, self.expert_tiers, self.tiers, self.share = tmp, expert_tiers, tiers, share
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
        if expert is None:
            return "L0"
        return expert_tier(self.expert_tiers, expert_layer(param_of(key)) or "", expert)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = int(plan.storage_data)
        self.tmp.mkdir(parents=True, exist_ok=True)
        handles: dict[str, Any] = {}
        results: list[WriteResult] = []
        try:
            for item in plan.items:
                results.append(self._write_item(item, planner, rank, handles))
            for f in handles.values():
                f.flush()
                os.fsync(f.fileno())
        finally:
            for f in handles.values():
                f.close()
        if results:  # the rank's files travel with its last result to the coordinator
            results[-1].storage_data["files"] = self._file_records(list(handles))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_item(
        self, item: Any, planner: SavePlanner, rank: int, handles: dict[str, Any]
    ) -> WriteResult:
        """Encode one planned chunk into this rank's tier files (opened into `handles` on
        first use): one record, or one per expert for a chunk of expert rows."""
        if item.type == WriteItemType.BYTE_IO:
            raise TypeError(
                f"{item.index.fqn}: only tensors go into a sharded checkpoint "
                "(everything else is in state.json)"
            )
        t = planner.resolve_data(item).detach().to("cpu").contiguous()
        key = item.index.fqn
        at0 = list(item.tensor_data.chunk.offsets)
        expert_rows = expert_layer(param_of(key)) is not None and t.dim() >= 2 and t.shape[0] > 0
        parts = (
            [(at0[0] + i, t[i], [at0[0] + i, *at0[1:]]) for i in range(t.shape[0])]
            if expert_rows
            else [(None, t, at0)]
        )
        records = []
        for expert, part, at in parts:
            tier = self._tier(key, expert)
            enc = encode(part.contiguous(), self.tiers.codec(tier), level=self.tiers.level(tier))
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
        return WriteResult(
            index=item.index,
            size_in_bytes=sum(r.length for r in records),
            storage_data={"records": [dataclasses.asdict(r) for r in records]},
        )

    def _file_records(self, names: list[str]) -> dict[str, FileRecord]:
        """This rank's files: sha256, size, and where they were shared (across machines)."""
        files: dict[str, FileRecord] = {}
        for n in names:
            digest, size = sha256_file(self.tmp / n), (self.tmp / n).stat().st_size
            # Across machines each rank's files go to shared storage before the coordinator
            # writes the manifest, which names them there.
            loc = self.share(self.tmp / n, digest) if self.share is not None else ""
            files[n] = (digest, size, loc)
        return files

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        records: list[TensorMeta] = []
        files: dict[str, FileRecord] = {}
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


def write_sharded_manifest(
    tmp: Path,
    step: int,
    state: dict[str, Any],
    expert_tiers: dict[str, dict[str, list[int]]],
    records: list[TensorMeta],
    files: dict[str, FileRecord],
    md: Metadata,
) -> None:
    """The coordinator's part once every rank has written its files: state.json, then the
    manifest (format 3, last) naming every rank's records and files, and where the files
    written on other machines are."""
    write_state(tmp, state)
    elsewhere = {n: f[2] for n, f in files.items() if not (tmp / n).is_file()}
    unshared = sorted(n for n, loc in elsewhere.items() if not loc)
    if unshared:
        raise RuntimeError(
            f"checkpoint step {step}: {', '.join(unshared[:3])} were written on "
            "another machine and put nowhere this one reaches (a multi-node run "
            "needs the checkpoint mirror: tasks/multinode.py)"
        )
    sizes = {n: f[:2] for n, f in files.items()}
    sizes[STATE] = (sha256_file(tmp / STATE), (tmp / STATE).stat().st_size)
    Manifest(
        step=step,
        time=time.time(),
        full_tiers=["L0", "L1", "L2"],
        experts=expert_tiers,
        expert_counts=expert_counts(expert_tiers),
        lossy=any(r.lossy for r in records),
        val_loss=state.get("val_loss"),
        tensors=records,
        files={n: FileMeta(*sizes[n]) for n in sorted(sizes)},
        format=SHARDED_FORMAT,
        dcp=metadata_json(md),
        locations=elsewhere,
    ).write(tmp)  # last


class ShardedSaves:
    """The sharded saves of one store: at most one in flight (an asynchronous one runs on a
    gloo group of its own), followed on rank 0 by its after-save hook on a thread of its own
    (not inside DCP's last collective, where every other rank waits: an upload of the
    offload or the mirror could outlast its timeout)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._pending: Any = None  # the sharded save in flight (a Future)
        self._group: Any = None  # the gloo group asynchronous sharded saves plan on
        self._hook: threading.Thread | None = None  # rank 0's after-save hook of that save

    def begin(self, step: int, share: Share | None) -> Path:
        """Wait for the previous save, clear leftovers; the folder every rank writes into."""
        self.wait()
        node_leader = share is not None and os.environ.get("LOCAL_RANK", "0") == "0"
        if dist.get_rank() == 0 or node_leader:  # another machine's leftovers: shared by now
            # Before the plan is agreed: no rank writes until rank 0 has been through this.
            remove_stale_writes(self.root)
        return sharded_tmp(self.root, step)

    def run(self, tensors: dict[str, torch.Tensor], writer: TieredWriter, background: bool) -> None:
        """Plan and write one save with DCP (returns once the shards are in host memory when
        `background`, after they are written otherwise)."""
        if background:
            if self._group is None:  # every rank saves at the same steps: same order
                self._group = dist.new_group(backend="gloo")
            pending = dcp.async_save(tensors, storage_writer=writer, process_group=self._group)
            self._pending = getattr(pending, "upload_completion", pending)
        else:
            dcp.save(tensors, storage_writer=writer)

    def after(self, hook: Callable[[Path], None], final: Path) -> None:
        """Run rank 0's after-save hook of the save that landed in `final` on its own thread."""
        self._hook = threading.Thread(
            target=hook, args=(final,), name="checkpoint-hook", daemon=True
        )
        self._hook.start()

    def wait(self) -> None:
        """Wait for the sharded save in flight, then for its after-save hook (rank 0)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            except Exception as e:
                raise RuntimeError(f"a background sharded checkpoint write failed: {e}") from e
        if self._hook is not None:
            self._hook.join()
            self._hook = None


class TieredReader(StorageReader):
    """DCP storage reader of a verified sharded checkpoint folder."""

    def __init__(self, root: Path, path: Path, records: list[TensorMeta], dcp: dict):
        super().__init__()
        self.root, self.path, self.dcp = root, path, dcp
        self.by_chunk: dict[tuple[str, tuple[int, ...]], list[TensorMeta]] = {}
        for r in records:
            assert r.chunk is not None
            self.by_chunk.setdefault((state_key(r.group, r.name), tuple(r.chunk)), []).append(r)

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
            return read_entry(self.root, self.path, records[0], None)
        out = torch.empty(sizes, dtype=dtype_from_name(records[0].dtype))
        for r in records:
            assert r.at is not None
            out[r.at[0] - offsets[0]] = read_entry(self.root, self.path, r, None)
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
