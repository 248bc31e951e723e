"""Tiered checkpoint store: every checkpoint is one consistent, verified training state.

Hierarchical (tiered) checkpoints, made safe. Tiering decides where a tensor is stored,
with which codec and how often it is written in full, never which step it comes from:

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from moe.checkpoint.codec import LOSSY, decode, encode
from moe.checkpoint.sharded import SHARDED_FORMAT
from moe.hashing import sha256_file

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


def _writer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"moe-pipeline {version('moe-pipeline')}"
    except PackageNotFoundError:  # run from a source tree without an install
        return "moe-pipeline (source tree)"


WRITER = _writer()
FORMAT_VERSION = 2  # one process wrote every tensor whole
READ_FORMATS = (
    FORMAT_VERSION,
    SHARDED_FORMAT,
)  # 3: each rank its shards (moe/checkpoint/sharded.py)


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without aliases (tied embeddings appear once), contiguous, on CPU."""
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if key in seen and t.numel() > 0:
            continue
        seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    return out


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights were saved once; routing-state buffers added since a file was written
    # keep their defaults; every parameter must match exactly.
    tied = {
        n
        for n in missing
        if n == "lm_head.weight" and getattr(model, "cfg", None) and model.cfg.tie_embeddings
    }
    buffers = {n for n, _ in model.named_buffers()}
    defaulted = sorted(n for n in missing if n in buffers)
    if defaulted:
        log.warning("tensors without these buffers (they keep their defaults): %s", defaulted)
    if set(missing) - tied - set(defaulted) or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing {sorted(set(missing) - tied - set(defaulted))}, unexpected {sorted(unexpected)}"
        )


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch optimizer state_dict -> (tensors for safetensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, pstate in state["state"].items():
        for key, value in pstate.items():
            name = f"{idx}.{key}"
            if torch.is_tensor(value):
                tensors[name] = value.detach().to("cpu").contiguous()
            else:
                scalars[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = t
    for name, v in rest["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = v
    return {"state": state, "param_groups": rest["param_groups"]}


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


GROUPS = ("model", "optimizer", "rng")
# Expert weights: 3-D parameters under `<layer>.experts.`, experts along dim 0.
_EXPERT_PARAM = re.compile(r"^(?P<layer>.+)\.experts\.[A-Za-z0-9_]+$")


def expert_layer(param_name: str) -> str | None:
    """The MoE layer prefix of an expert parameter (e.g. 'blocks.0.ffn'), else None."""
    m = _EXPERT_PARAM.match(param_name)
    return m.group("layer") if m else None


class _Entry(NamedTuple):
    """One tensor of a checkpoint to write: a whole shared tensor (expert None, tier L0) or
    one expert's slice of an expert weight or its optimizer moment (tier L1 or L2)."""

    group: str
    name: str
    expert: int | None
    tier: str
    tensor: torch.Tensor


@dataclass
class TensorMeta:
    """Where one stored tensor's bytes are (file, offset, length), how they decode (codec,
    dtype, shape; `base` is the step of the checkpoint an XOR delta reads against, None for
    a full copy) and which tensor it is (group, name, expert slice, tier)."""

    key: str
    group: str
    name: str
    expert: int | None
    tier: str
    file: str
    offset: int
    length: int
    codec: str
    dtype: str
    shape: list[int]
    base: int | None
    lossy: bool
    # Sharded checkpoints (format 3): where this record starts in the whole tensor, and the
    # offsets of the DCP chunk it is part of (an expert chunk is one record per expert).
    at: list[int] | None = None
    chunk: list[int] | None = None


def tensor_meta(enc: Any, **where: Any) -> TensorMeta:
    """The manifest record of one encoded tensor (moe/checkpoint/codec.py `Encoded`): how it decodes,
    from the encoding, and where and which tensor it is, from `where`."""
    return TensorMeta(
        length=len(enc.data),
        codec=enc.codec,
        dtype=enc.dtype,
        shape=list(enc.shape),
        lossy=enc.lossy,
        **where,
    )


@dataclass
class FileMeta:
    sha256: str
    bytes: int


class ManifestError(ValueError):
    """A checkpoint folder whose manifest.json is missing, unreadable or of another format."""

    def __init__(self, why: str, other_format: bool = False) -> None:
        super().__init__(why)
        self.other_format = other_format  # a whole checkpoint another version wrote


@dataclass
class Manifest:
    """manifest.json of a checkpoint folder: written last, so its presence means complete.

    It lists every tensor, the tiers written in full, the checkpoints deltas read against
    (`bases`), each MoE layer's hot and cold experts, the sha256 and size of every file, and
    where offloaded files live (`locations`: file -> object-store location)."""

    step: int
    tensors: list[TensorMeta]
    files: dict[str, FileMeta]
    full_tiers: list[str] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    experts: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    expert_counts: dict[str, int] = field(default_factory=dict)
    lossy: bool = False
    val_loss: float | None = None
    time: float = 0.0
    locations: dict[str, str] = field(default_factory=dict)
    format: int = FORMAT_VERSION
    # Format 3: DCP's metadata as JSON (key -> dtype, global size, chunks; moe/checkpoint/sharded.py).
    dcp: dict[str, Any] = field(default_factory=dict)
    written_by: str = field(default_factory=lambda: WRITER)  # "moe-pipeline <version>"

    @property
    def sharded(self) -> bool:
        return self.format == SHARDED_FORMAT

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of a checkpoint folder; ManifestError says why there is none."""
        path = folder / MANIFEST
        if not path.is_file():
            raise ManifestError("no manifest.json (the write did not finish)")
        try:
            raw = json.loads(path.read_bytes())
            version = raw.get("format")
        except (OSError, ValueError, RecursionError, AttributeError) as e:
            raise ManifestError(f"unreadable manifest.json ({e!r})") from e
        if version not in READ_FORMATS:
            by = raw.get("written_by") if isinstance(raw, dict) else None
            raise ManifestError(
                f"checkpoint format {version} (written by {by or 'another version of moe-pipeline'}"
                f"; this one, {WRITER}, reads formats {', '.join(map(str, READ_FORMATS))}: "
                "resume with that version, or start fresh)",
                other_format=True,
            )
        try:
            return cls(
                **{
                    **raw,
                    "step": int(raw["step"]),
                    "bases": [int(b) for b in raw.get("bases", [])],
                    "tensors": [TensorMeta(**t) for t in raw["tensors"]],
                    "files": {n: FileMeta(**f) for n, f in raw["files"].items()},
                }
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"unreadable manifest.json ({e!r})") from e

    def write(self, folder: Path, name: str = MANIFEST) -> None:
        _fsync_write(folder / name, json.dumps(dataclasses.asdict(self), indent=1).encode())

    def index(self) -> dict[str, TensorMeta]:
        """Tensors by key (a delta's base is looked up this way)."""
        return {t.key: t for t in self.tensors}


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
        fetch: Callable[[str, Path], None] | None = None,
        on_saved: Callable[[Path], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.max_retain = max_retain
        self.hot_every, self.cold_every = hot_every, cold_every
        self.cold_threshold = cold_threshold
        self.hot_codec, self.cold_codec = hot_codec, cold_codec
        self.hot_level, self.cold_level = hot_level, cold_level
        self.keep_best = keep_best
        self.background = background
        # fetch(location, dest): bring back a file an offload moved to an object store.
        self.fetch = fetch
        # on_saved(path): called after each save lands (on the writer thread in background
        # mode); its errors are logged, never raised into training.
        self.on_saved = on_saved
        # share(path, sha256) -> location: put a file of a sharded save where every machine
        # reaches it (set for multi-node runs; None: the ranks share this folder).
        self.share: Callable[[Path, str], str] | None = None
        self.stalls_s: list[float] = []  # training-thread time of each save
        self.write_s: list[float] = []  # worker time of each save (encode + write)
        self._queue: queue.Queue[tuple | None] = queue.Queue(maxsize=1)
        self._worker: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._pending: Any = None  # the sharded save in flight (a Future)
        self._dcp_group: Any = None  # the gloo group asynchronous sharded saves plan on
        self._hook: threading.Thread | None = None  # rank 0's after-save hook of that save

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

    # ------------------------------------------------------------------ listing

    def checkpoint_dirs(self) -> list[Path]:
        """Checkpoint folders, newest first (valid or not)."""
        return self._dirs()

    def _dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(
            (p for p in self.root.glob("step_*") if p.is_dir() and step_of(p.name) is not None),
            reverse=True,
        )

    def step_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def bases(self, path: Path) -> list[int]:
        """The steps of the checkpoints `path`'s delta-coded tiers are read against."""
        manifest = self._manifest(path)
        return manifest.bases if manifest else []

    def offloadable(self, path: Path, hot: bool) -> list[str]:
        """The files of a checkpoint folder that may live in an object store instead: the
        cold tier of a checkpoint kept hot (the newest, or a base the next save diffs
        against), every tensor file and the state of any other. Manifests stay local."""
        manifest = self._manifest(path)
        names = list(manifest.files) if manifest else [*TENSOR_FILES, STATE]
        if hot:  # L2.bin, or every rank's rNNN.L2.bin in a sharded checkpoint
            names = [n for n in names if n.endswith("L2.bin")]
        else:
            names = [n for n in names if n.endswith(".bin") or n == STATE]
        return [n for n in names if (path / n).is_file()]

    def _manifest(self, path: Path) -> Manifest | None:
        """The folder's manifest, or None where it has none this version reads."""
        try:
            return Manifest.read(path)
        except ManifestError:
            return None

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
        """Save one training state; returns the folder it will have.

        param_names maps an optimizer tensor's parameter index ("3" of "3.exp_avg") to the
        parameter's name, so expert optimizer state is tiered with its expert. expert_load
        maps an MoE layer prefix to each expert's load (any scale; compared to the mean).
        """
        t0 = time.perf_counter()
        self._raise_pending()
        # Copy on the training thread: the next optimizer step changes the live tensors.
        snapshot = {
            "model": {k: v.detach().to("cpu", copy=True) for k, v in model.items()},
            "optimizer": {k: v.detach().to("cpu", copy=True) for k, v in optimizer.items()},
            "rng": {k: v.detach().to("cpu", copy=True) for k, v in rng.items()},
        }
        job = (step, snapshot, json.loads(json.dumps(state)), param_names or {}, expert_load or {})
        final = self.step_dir(step)
        if self.background:
            self._ensure_worker()
            self._queue.put(job)  # blocks while the previous save is still being written
        else:
            self._write(*job)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        log.info("checkpoint step %d: training stalled %.3fs", step, stall)
        return final

    def flush(self) -> None:
        """Wait until every queued save is on disk; raise if one failed."""
        self._wait_sharded()
        if self._worker is not None:
            self._queue.join()
        self._raise_pending()

    def close(self) -> None:
        self._wait_sharded()
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
        self._raise_pending()

    def _wait_sharded(self) -> None:
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

    def _after_save(self, final: Path) -> None:
        assert self.on_saved is not None
        try:
            self.on_saved(final)
        except Exception as e:  # e.g. the object store is down: the next pass retries
            log.warning("after-save hook failed for %s: %s", final, e)

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
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from moe.checkpoint.sharded import TieredWriter, metadata_json

        t0 = time.perf_counter()
        self._wait_sharded()
        tmp = self.root / f".tmp-{step_dir_name(step)}-sharded"
        node_leader = self.share is not None and os.environ.get("LOCAL_RANK", "0") == "0"
        if dist.get_rank() == 0 or node_leader:  # another machine's leftovers: shared by now
            # Before the plan is agreed: no rank writes until rank 0 has been through this.
            self._remove_stale_writes()
        expert_tiers = self._expert_tiers(expert_load or {})
        state = json.loads(json.dumps(state))

        def finish(
            records: list[TensorMeta], files: dict[str, tuple[str, int, str]], md: Any
        ) -> None:
            with self._lock:
                _fsync_write(tmp / STATE, json.dumps(state, indent=1, sort_keys=True).encode())
                elsewhere = {n: f[2] for n, f in files.items() if not (tmp / n).is_file()}
                unshared = sorted(n for n, loc in elsewhere.items() if not loc)
                if unshared:
                    raise RuntimeError(
                        f"checkpoint step {step}: {', '.join(unshared[:3])} were written on "
                        "another machine and put nowhere this one reaches (a multi-node run "
                        "needs the checkpoint mirror: tasks/multinode.py)"
                    )
                files = {n: f[:2] for n, f in files.items()}
                files[STATE] = (sha256_file(tmp / STATE), (tmp / STATE).stat().st_size)
                Manifest(
                    step=step,
                    time=time.time(),
                    full_tiers=["L0", "L1", "L2"],
                    experts=expert_tiers,
                    expert_counts={
                        layer: len(t["hot"]) + len(t["cold"]) for layer, t in expert_tiers.items()
                    },
                    lossy=any(r.lossy for r in records),
                    val_loss=state.get("val_loss"),
                    tensors=records,
                    files={n: FileMeta(*files[n]) for n in sorted(files)},
                    format=SHARDED_FORMAT,
                    dcp=metadata_json(md),
                    locations=elsewhere,
                ).write(tmp)  # last
                final = self._commit(tmp, step)
                self._retain()
            self.write_s.append(time.perf_counter() - t0)
            log.info("sharded checkpoint step %d written to %s", step, final)
            if self.on_saved is not None:
                # Not here: this runs inside DCP's last collective, where every other rank
                # waits (an upload of the offload or the mirror could outlast its timeout).
                self._hook = threading.Thread(
                    target=self._after_save, args=(final,), name="checkpoint-hook", daemon=True
                )
                self._hook.start()

        writer = TieredWriter(self, tmp, expert_tiers, finish)
        if self.background:
            if self._dcp_group is None:  # every rank saves at the same steps: same order
                self._dcp_group = dist.new_group(backend="gloo")
            pending = dcp.async_save(tensors, storage_writer=writer, process_group=self._dcp_group)
            self._pending = getattr(pending, "upload_completion", pending)
        else:
            dcp.save(tensors, storage_writer=writer)
        stall = time.perf_counter() - t0
        self.stalls_s.append(stall)
        log.info("sharded checkpoint step %d: training stalled %.3fs", step, stall)
        return self.step_dir(step)

    def load_sharded(self, path: Path, targets: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Read a sharded checkpoint into `targets` in place (every rank, with the tensors of
        the layout it has now: DTensors are resharded, keys as in save_sharded; each must be
        in the checkpoint, see `sharded_keys`); returns its state.json."""
        import torch.distributed.checkpoint as dcp

        from moe.checkpoint.sharded import TieredReader

        self.ensure_local(path)
        why = self.verify(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} failed verification: {why}")
        manifest = Manifest.read(path)
        if not manifest.sharded:
            raise ValueError(f"{path} is not a sharded checkpoint (format {manifest.format})")
        dcp.load(targets, storage_reader=TieredReader(self, path, manifest.tensors, manifest.dcp))
        return json.loads((path / STATE).read_text())

    def read_state(self, path: Path) -> tuple[Manifest, dict[str, Any]]:
        """A checkpoint's manifest and state.json, without its tensors."""
        self.ensure_local(path)
        return Manifest.read(path), json.loads((path / STATE).read_text())

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"a background checkpoint write failed: {err}") from err

    def _ensure_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
            self._worker.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            except BaseException as e:  # reported on the next save() or flush()
                log.error("checkpoint write failed: %s", e)
                self._error = e
            finally:
                self._queue.task_done()

    def _tiers(
        self, group: str, name: str, t: torch.Tensor, param_names: dict[str, str]
    ) -> str | None:
        """The expert layer a tensor belongs to (split along dim 0), else None (L0)."""
        if group == "model":
            pname = name
        elif group == "optimizer":
            idx = name.split(".", 1)[0]
            pname = param_names.get(idx, "")
        else:
            return None
        layer = expert_layer(pname)
        return layer if layer is not None and t.dim() >= 2 else None

    def _last_full(self) -> dict[str, Manifest]:
        """Per tier: the manifest of the newest valid checkpoint that wrote it in full."""
        out: dict[str, Manifest] = {}
        for path in self._dirs():
            m = self._manifest(path)
            if m is None or m.sharded:  # deltas read against whole tensors only
                continue
            for tier in m.full_tiers:
                if tier not in out and self.verify(path) is None:
                    out[tier] = m
            if len(out) == 3:
                break
        return out

    def _write(
        self,
        step: int,
        snapshot: dict[str, dict[str, torch.Tensor]],
        state: dict[str, Any],
        param_names: dict[str, str],
        expert_load: dict[str, list[float]],
    ) -> None:
        """Write one checkpoint: into a temporary folder, the tensors tier by tier, the state,
        the manifest last; then rename it into place, point `latest` at it and apply the
        retention policy. The after-save hook (offload, mirror) runs once it has landed."""
        t0 = time.perf_counter()
        with self._lock:
            tmp = self._fresh_tmp(step)
            last_full = self._last_full()
            full = self._full_tiers(step, last_full)
            expert_tiers = self._expert_tiers(expert_load)
            entries = self._entries(snapshot, param_names, expert_tiers)
            tensors_meta = self._write_tensors(tmp, entries, full, last_full)
            _fsync_write(tmp / STATE, json.dumps(state, indent=1, sort_keys=True).encode())
            Manifest(
                step=step,
                time=time.time(),
                full_tiers=sorted(full),
                bases=sorted({m.base for m in tensors_meta if m.base is not None}),
                experts=expert_tiers,
                expert_counts={
                    layer: len(t["hot"]) + len(t["cold"]) for layer, t in expert_tiers.items()
                },
                lossy=any(m.lossy for m in tensors_meta),
                val_loss=state.get("val_loss"),
                tensors=tensors_meta,
                files={
                    p.name: FileMeta(sha256_file(p), p.stat().st_size)
                    for p in sorted(tmp.iterdir())
                },
            ).write(tmp)  # last
            final = self._commit(tmp, step)
            self._retain()
        dt = time.perf_counter() - t0
        self.write_s.append(dt)
        if self.on_saved is not None:
            try:
                self.on_saved(final)
            except Exception as e:  # e.g. the object store is down: the next pass retries
                log.warning("after-save hook failed for %s: %s", final, e)
        log.info(
            "checkpoint step %d written to %s in %.2fs (full tiers: %s)",
            step,
            final,
            dt,
            ",".join(sorted(full)) or "none",
        )

    def _remove_stale_writes(self) -> None:
        """Remove the temporary folders a write that never finished left (a process that
        died mid-write; the store has one writer at a time)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-step_*"):
            log.info("removing an unfinished checkpoint write: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)

    def _fresh_tmp(self, step: int) -> Path:
        """An empty temporary folder for step's checkpoint (stale ones are removed)."""
        self._remove_stale_writes()
        tmp = self.root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
        tmp.mkdir()
        return tmp

    def _full_tiers(self, step: int, last_full: dict[str, Manifest]) -> set[str]:
        """The tiers written in full this time (the others as deltas where that pays): a tier
        never written in full, or whose last full write is its interval ago."""
        every = {"L0": self.hot_every, "L1": self.hot_every, "L2": self.cold_every}
        return {
            tier
            for tier in ("L0", "L1", "L2")
            if tier not in last_full or step - last_full[tier].step >= every[tier]
        }

    def _expert_tiers(self, expert_load: dict[str, list[float]]) -> dict[str, dict[str, list[int]]]:
        """Hot and cold experts per layer: cold below cold_threshold of the layer's mean load."""
        tiers: dict[str, dict[str, list[int]]] = {}
        for layer, load in expert_load.items():
            mean = sum(load) / max(1, len(load))
            cold = {e for e, v in enumerate(load) if mean > 0 and v < self.cold_threshold * mean}
            tiers[layer] = {
                "hot": [e for e in range(len(load)) if e not in cold],
                "cold": sorted(cold),
            }
        return tiers

    def _entries(
        self,
        snapshot: dict[str, dict[str, torch.Tensor]],
        param_names: dict[str, str],
        expert_tiers: dict[str, dict[str, list[int]]],
    ) -> list[_Entry]:
        """Every tensor to write and its tier: shared tensors in L0, each expert's slice of an
        expert weight (and its optimizer moments) in L1 if hot, L2 if cold."""
        entries: list[_Entry] = []
        for group in GROUPS:
            for name, t in snapshot[group].items():
                layer = self._tiers(group, name, t, param_names)
                if layer is None:
                    entries.append(_Entry(group, name, None, "L0", t))
                    continue
                cold = set(expert_tiers.get(layer, {}).get("cold", []))
                for e in range(t.shape[0]):
                    entries.append(_Entry(group, name, e, "L2" if e in cold else "L1", t[e]))
        return entries

    def _write_tensors(
        self,
        tmp: Path,
        entries: list[_Entry],
        full: set[str],
        last_full: dict[str, Manifest],
    ) -> list[TensorMeta]:
        """Encode every entry into its tier's file; returns their manifest records."""
        base_index: dict[int, dict[str, TensorMeta]] = {}  # base step -> its tensors by key
        tensors_meta: list[TensorMeta] = []
        handles = {tier: open(tmp / f"{tier}.bin", "wb") for tier in ("L0", "L1", "L2")}
        try:
            for group, name, e, tier, t in entries:
                key = f"{group}/{name}" + ("" if e is None else f"[{e}]")
                codec, base_t, base_step = self._choose(key, tier, t, full, last_full, base_index)
                level = self.cold_level if tier == "L2" else self.hot_level
                enc = encode(t, codec, base=base_t, level=level)
                if base_t is not None:
                    # A delta only where it pays: after a large update (high lr) the XOR is
                    # as random as the tensor.
                    full_enc = encode(t, self._full_codec(tier), level=level)
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

    def _commit(self, tmp: Path, step: int) -> Path:
        """Rename the finished folder into place, then point `latest` at it (both durable)."""
        _fsync_dir(tmp)
        final = self.step_dir(step)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_write(self.root / ".latest.tmp", final.name.encode())
        os.replace(self.root / ".latest.tmp", self.root / "latest")
        _fsync_dir(self.root)
        return final

    def _full_codec(self, tier: str) -> str:
        return self.cold_codec if tier == "L2" else self.hot_codec

    def _choose(
        self,
        key: str,
        tier: str,
        t: torch.Tensor,
        full: set[str],
        last_full: dict[str, Manifest],
        base_index: dict[int, dict[str, TensorMeta]],
    ) -> tuple[str, torch.Tensor | None, int | None]:
        """(codec, base tensor, base step) for one entry."""
        full_codec = self._full_codec(tier)
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
        base_dir = self.step_dir(base_step)
        if not (base_dir / meta.file).is_file():
            return full_codec, None, None  # the base was offloaded: write in full
        base_t = self._read_entry(base_dir, meta, None)
        return "xor-zstd", base_t, base_step

    # ------------------------------------------------------------------ retention

    def _retain(self) -> None:
        dirs = self._dirs()
        keep = set(dirs[: self.max_retain])
        manifests: dict[Path, Manifest] = {}  # each read once
        for p in dirs:
            try:
                manifests[p] = Manifest.read(p)
            except ManifestError as e:
                if e.other_format:  # another version's checkpoint is not this one's to judge
                    keep.add(p)
        if self.keep_best:
            losses = [(m.val_loss, p) for p, m in manifests.items() if m.val_loss is not None]
            if losses:
                keep.add(min(losses, key=lambda vp: vp[0])[1])
        # Never delete a base that a kept checkpoint needs.
        for p in list(keep):
            if p in manifests:
                keep.update(self.step_dir(b) for b in manifests[p].bases)
        for old in dirs:
            if old not in keep:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ integrity

    def verify(self, path: Path, _depth: int = 0) -> str | None:
        """None when `path` is a complete checkpoint whose files (and bases) match their
        manifests; else why not."""
        try:
            manifest = Manifest.read(path)
        except ManifestError as e:
            return str(e)
        files, locations = manifest.files, manifest.locations
        root = path.resolve()
        for name, meta in files.items():
            f = (path / name).resolve()
            if f.parent != root:
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
                base = self.step_dir(b)
                why = self.verify(base, _depth=1) if base.is_dir() else "it is missing"
                if why is not None:
                    return f"its base checkpoint {base.name} is not usable: {why}"
        return None

    def latest_valid(self) -> Path | None:
        """Newest checkpoint that verifies; damaged ones are skipped with a warning."""
        self.flush()
        for path in self._dirs():
            why = self.verify(path)
            if why is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, why)
        return None

    # ------------------------------------------------------------------ loading

    def _read_entry(
        self, path: Path, meta: TensorMeta, base_index: dict[str, TensorMeta] | None
    ) -> torch.Tensor:
        with open(path / meta.file, "rb") as f:
            f.seek(meta.offset)
            data = f.read(meta.length)
        if len(data) != meta.length:
            raise ValueError(f"{path / meta.file} is shorter than its manifest says")
        base_t = None
        if meta.base is not None:
            base_dir = self.step_dir(meta.base)
            if base_index is None:
                base_index = Manifest.read(base_dir).index()
            base_t = self._read_entry(base_dir, base_index[meta.key], None)
        return decode(meta.codec, meta.dtype, meta.shape, data, base=base_t)

    def ensure_local(self, path: Path) -> None:
        """Fetch back the files of `path` (and of its bases) that an offload moved to an
        object store, verify each against the manifest's sha256, and mark them local."""
        manifest = self._manifest(path)
        if manifest is None:
            return
        for b in manifest.bases:
            self.ensure_local(self.step_dir(b))
        missing = {n: loc for n, loc in manifest.locations.items() if not (path / n).is_file()}
        if not missing:
            return
        if self.fetch is None:
            raise ValueError(
                f"checkpoint {path} has files in an object store ({', '.join(sorted(missing))}) "
                "and this store has no way to fetch them: pass fetch= (the training stages do)"
            )
        for name, loc in missing.items():
            if (path / name).is_file():
                continue  # another rank of this machine fetched it meanwhile
            tmp = path / f".{name}.{os.getpid()}.fetch"  # ranks of one machine fetch at once
            self.fetch(loc, tmp)
            want = manifest.files[name].sha256
            if sha256_file(tmp) != want:
                tmp.unlink(missing_ok=True)
                raise ValueError(
                    f"{loc} (file {name} of checkpoint {path.name}) does not match its sha256: "
                    "the stored copy is damaged"
                )
            os.replace(tmp, path / name)
            log.info("fetched %s of %s from %s", name, path.name, loc)

    def set_locations(self, path: Path, moved: dict[str, str]) -> None:
        """Record that files of `path` now live at object-store locations (the manifest is
        rewritten atomically; the files' hashes stay as they were)."""
        manifest = self._manifest(path)
        if manifest is None:
            raise ValueError(f"{path} has no readable manifest")
        manifest.locations.update(moved)
        manifest.write(path, ".manifest.tmp")
        os.replace(path / ".manifest.tmp", path / MANIFEST)

    def load(self, path: Path) -> Checkpoint:
        """Every tensor of a checkpoint, whole, in this process (a sharded one assembled from
        every rank's shards)."""
        self.ensure_local(path)
        why = self.verify(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} failed verification: {why}")
        self.flush()
        manifest = Manifest.read(path)
        state = json.loads((path / STATE).read_text())
        if manifest.sharded:
            out = self._assembled(path, manifest)
        else:
            out = self._whole(path, manifest)
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

    def _whole(self, path: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of a one-process checkpoint by group (experts stacked again)."""
        base_indexes = {b: Manifest.read(self.step_dir(b)).index() for b in manifest.bases}
        parts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
        out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
        for meta in manifest.tensors:
            idx = base_indexes.get(meta.base) if meta.base is not None else None
            t = self._read_entry(path, meta, idx)
            if meta.expert is None:
                out[meta.group][meta.name] = t
            else:
                parts.setdefault((meta.group, meta.name), {})[meta.expert] = t
        for (group, name), experts in parts.items():
            out[group][name] = torch.stack([experts[e] for e in sorted(experts)])
        return out

    def _assembled(self, path: Path, manifest: Manifest) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of a sharded checkpoint by group, each assembled whole."""
        from moe.checkpoint.sharded import assemble, split_key

        whole = assemble(manifest.tensors, manifest.dcp, lambda r: self._read_entry(path, r, None))
        out: dict[str, dict[str, torch.Tensor]] = {g: {} for g in GROUPS}
        for key, t in whole.items():
            group, name = split_key(key)
            out[group][name] = t
        return out

    def info(self) -> list[CheckpointInfo]:
        """Every checkpoint folder, newest first, with its size, tiers and validity."""
        rows = []
        for path in self._dirs():
            # A folder without a manifest this version reads is listed with its problem.
            m = self._manifest(path) or Manifest(step=step_of(path.name) or 0, tensors=[], files={})
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
                    problem=self.verify(path),
                    remote={n: loc for n, loc in m.locations.items() if not (path / n).is_file()},
                    ranks=len({n.split(".")[0] for n in m.files if n.endswith(".bin")})
                    if m.sharded
                    else 0,
                )
            )
        return rows

    def clear(self) -> None:
        self.flush()
        for p in self._dirs():
            shutil.rmtree(p, ignore_errors=True)
        (self.root / "latest").unlink(missing_ok=True)
