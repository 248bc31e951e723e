"""The vocabulary of a checkpoint folder: its manifest.json (`Manifest`, one `TensorMeta` per
stored tensor, one `FileMeta` per file) and state.json, the formats this version writes and
reads, the groups tensors come in, and the keys of a sharded training state.

Format 2: one process wrote every tensor whole (moe/checkpoint/whole.py); format 3: each rank
wrote its shards (moe/checkpoint/sharded.py). Both read back with moe/checkpoint/read.py.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from moe.checkpoint.layout import MANIFEST, STATE, fsync_write


def _writer() -> str:
    try:
        return f"moe-pipeline {version('moe-pipeline')}"
    except PackageNotFoundError:  # run from a source tree without an install
        return "moe-pipeline (source tree)"


WRITER = _writer()
FORMAT_VERSION = 2  # one process wrote every tensor whole
SHARDED_FORMAT = 3  # each rank its shards (moe/checkpoint/sharded.py)
READ_FORMATS = (FORMAT_VERSION, SHARDED_FORMAT)

GROUPS = ("model", "optimizer", "rng")
_KEY_GROUP = {"optim": "optimizer"}  # a sharded state key's prefix -> its group
_GROUP_KEY = {"optimizer": "optim"}  # and back


def split_key(key: str) -> tuple[str, str]:
    """A sharded state key -> (group, tensor name): "model.<fqn>", "optim.<fqn>.<moment>",
    "rng.<rank>.<name>"."""
    group, _, name = key.partition(".")
    return _KEY_GROUP.get(group, group), name


def state_key(group: str, name: str) -> str:
    """(group, tensor name) -> its sharded state key (the inverse of `split_key`)."""
    return f"{_GROUP_KEY.get(group, group)}.{name}"


def param_of(key: str) -> str:
    """The parameter a model or optimizer key belongs to ("" for RNG state)."""
    group, name = split_key(key)
    if group == "model":
        return name
    if group == "optimizer":
        return name.rsplit(".", 1)[0]
    return ""


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
        fsync_write(folder / name, json.dumps(dataclasses.asdict(self), indent=1).encode())

    def index(self) -> dict[str, TensorMeta]:
        """Tensors by key (a delta's base is looked up this way)."""
        return {t.key: t for t in self.tensors}


def read_manifest(path: Path) -> Manifest | None:
    """The folder's manifest, or None where it has none this version reads."""
    try:
        return Manifest.read(path)
    except ManifestError:
        return None


def write_state(folder: Path, state: dict[str, Any]) -> None:
    """A checkpoint folder's state.json (the JSON part of the training state), fsynced."""
    fsync_write(folder / STATE, json.dumps(state, indent=1, sort_keys=True).encode())


def read_state(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's state.json."""
    return json.loads((folder / STATE).read_text())
