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


# ----------------------------------------------------------------- corpus inputs (data issue)

from moe.config import ConfigError, load_config  # noqa: E402
from moe.data import CorpusStats, iter_documents  # noqa: E402


def test_empty_corpus_and_undecodable_corpus(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no documents with decodable text"):
        list(iter_documents(str(empty), "text", 0, CorpusStats()))
    latin = tmp_path / "latin"
    latin.mkdir()
    (latin / "a.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(InputError, match=r"1 undecodable file\(s\) skipped"):
        list(iter_documents(str(latin), "text", 0, CorpusStats()))


def test_malformed_jsonl_line_is_named_or_skipped_and_counted(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "a"}\n{"text": oops}\n{"body": "b"}\n{"text": 3}\n{"text": "c"}\n')
    with pytest.raises(InputError, match=r"c.jsonl, line 2: not valid JSON.*on_bad_record: skip"):
        list(iter_documents(str(f), "text", 0, CorpusStats()))
    stats = CorpusStats()
    assert list(iter_documents(str(f), "text", 0, stats, on_bad_record="skip")) == ["a", "c"]
    assert stats.skipped_records == 3


def test_missing_text_field_in_jsonl_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    f.write_text('{"body": "a"}\n')
    with pytest.raises(InputError, match=r"line 1: no field 'text' \(data.text_field\)"):
        list(iter_documents(str(f), "text", 0, CorpusStats()))


def test_vocab_too_small_for_special_tokens_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"tokenizer.vocab_size = 258: must be in \[259"):
        load_config(None, ["tokenizer.vocab_size=258"])


def test_prepare_with_a_bad_corpus_exits_2_and_keeps_old_outputs(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    (tmp_path / "corpus.jsonl").write_text('{"text": "fine"}\n{broken\n')
    old = tmp_path / "data" / "prepared"
    old.mkdir(parents=True)
    (old / "meta.json").write_text('{"old": true}')
    r = _cli(["stage", "prepare", "--set", "data.source=corpus.jsonl"], tmp_path, prefect_server)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "corpus.jsonl, line 2: not valid JSON" in r.stderr
    assert (old / "meta.json").read_text() == '{"old": true}'
    assert not (tmp_path / "data" / "prepared.tmp").exists()
