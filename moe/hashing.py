"""A file's sha256: how checkpoints, published datasets, hand-offs and lineage records name
content. Its own module so that code which only hashes files (publishing data) does not
depend on the checkpoint store."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    """A file's sha256, read in chunks (hashlib's file_digest)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def weights_files_digest(folder: Path) -> str:
    """One sha256 for a model folder's weights: over each safetensors file's name and
    sha256, in name order (a sharded checkpoint, or our one-file model folder)."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f"{f.name}:{sha256_file(f)}\n".encode())
    return h.hexdigest()
