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
