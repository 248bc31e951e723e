"""The refusal of a file we were given: an InputError that names the file or folder at fault,
shared by every module of moe/hf that reads a checkpoint."""

from __future__ import annotations

from pathlib import Path

from moe.errors import InputError


def refuse(path: Path, why: str) -> InputError:
    """InputError("<path>: <why>"), for the caller to raise."""
    return InputError(f"{path}: {why}")
