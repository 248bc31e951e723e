"""Bad input stops with a clear error naming the file, line or field, exit code 2, and
nothing overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe.errors import InputError
from moe.sql import load_pairs
from moe.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"question": "q", "sql": "SELECT 1", "db": "d.sqlite", "schema": "t(a)"}


def test_pair_file_with_a_missing_field_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "pairs.jsonl"
    f.write_text(
        json.dumps(GOOD) + "\n" + json.dumps({"question": "q", "db": "d", "schema": "s"}) + "\n"
    )
    with pytest.raises(
        InputError, match=r"pairs.jsonl, line 2: missing or non-text field\(s\) sql"
    ):
        load_pairs(f)


def test_malformed_and_empty_pair_files(tmp_path: Path) -> None:
    f = tmp_path / "pairs.jsonl"
    f.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(InputError, match="line 2: not valid JSON"):
        load_pairs(f)
    f.write_text("\n")
    with pytest.raises(InputError, match="no SQL pairs"):
        load_pairs(f)


def test_tokenizer_that_is_not_one(tmp_path: Path) -> None:
    f = tmp_path / "tokenizer.json"
    f.write_text("{}")
    with pytest.raises(InputError, match="tokenizer.json"):
        load_tokenizer(f)


def _cli(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_digest_of_a_folder_without_checkpoints_exits_2(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "step_00000001").mkdir(parents=True)  # incomplete: no manifest
    r = _cli(["checkpoint", "digest", "ckpt"], tmp_path)
    assert r.returncode == 2 and "no valid checkpoint under ckpt" in r.stderr


def test_stage_without_its_inputs_exits_2_and_writes_nothing(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    r = _cli(["stage", "finetune_sql"], tmp_path, prefect_server)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "data/published/receipt.json is missing: run the publish stage first" in r.stderr
    assert "Traceback" not in r.stderr.split("error:")[-1]
    assert not (tmp_path / "models").exists() and not (tmp_path / "reports").exists()
