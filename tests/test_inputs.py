"""Bad input stops with a clear error naming the file, line or field, exit code 2, and
nothing overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe.data.tokenizer import load_tokenizer
from moe.errors import InputError
from moe.sql.records import load_pairs
from tests.conftest import cli_env, pipeline_cli

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
    return pipeline_cli(args, cwd, cli_env(env), timeout=300)


def test_digest_of_a_folder_without_checkpoints_exits_2(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "step_00000001").mkdir(parents=True)  # incomplete: no manifest
    r = _cli(["checkpoint", "digest", "ckpt"], tmp_path)
    assert r.returncode == 2 and "no valid checkpoint under ckpt" in r.stderr


def test_stage_without_its_inputs_exits_2_and_writes_nothing(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    r = _cli(["stage", "finetune_sql"], tmp_path, prefect_server)
    assert r.returncode == 2, r.stderr[-2000:]
    assert (
        "stage finetune_sql needs data/published/receipt.json, which is missing: run the "
        "publish stage first" in r.stderr
    )
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "models").exists() and not (tmp_path / "reports").exists()


# ----------------------------------------------------------------- corpus inputs (data issue)

from moe.config import ConfigError  # noqa: E402
from moe.data.sources import CorpusStats, iter_documents  # noqa: E402
from tasks.config import load_config  # noqa: E402


def test_empty_corpus_and_undecodable_corpus(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="no documents with text"):
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
    # The error reached the flow (line 2 is past what the pre-flight check reads): Prefect
    # logs it as one line, without the engine's traceback.
    assert "Encountered exception during execution" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert (old / "meta.json").read_text() == '{"old": true}'
    assert not (tmp_path / "data" / "prepared.tmp").exists()


def test_prepare_with_bad_sql_pairs_exits_2_naming_each_and_keeps_old_outputs(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    import sqlite3

    db = tmp_path / "shop.sqlite"
    con = sqlite3.connect(db)
    con.execute("CREATE TABLE item (id INTEGER PRIMARY KEY, kind TEXT, price INT)")
    con.executemany("INSERT INTO item VALUES (?, ?, ?)", [(i, "ab"[i % 2], i) for i in range(40)])
    con.commit()
    con.close()
    before = db.read_bytes()
    (tmp_path / "pairs.jsonl").write_text(
        '{"question": "How many items?", "sql": "SELECT count(*) FROM item"}\n'
        '{"question": "Cheap ones?", "sql": "SELECT id FROM items WHERE price < 3"}\n'
        '{"question": "Kinds?", "sql": "SELECT DISTINCT kind FROM item"}\n'
        '{"question": "", "sql": "SELECT 1"}\n'
    )
    old = tmp_path / "data" / "prepared"
    old.mkdir(parents=True)
    (old / "meta.json").write_text('{"old": true}')
    sets = ["data.max_bytes=200000", "tokenizer.vocab_size=512"]
    sets += [f"data.sql_domain_database={db}", "data.sql_domain_pairs=pairs.jsonl"]
    sets += ["data.sql_generic_pairs=400", "data.sql_domain_train_pairs=60"]  # tiny_params'
    r = _cli(["stage", "prepare", *sum((["--set", x] for x in sets), [])], tmp_path, prefect_server)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "2 bad SQL pair(s) in the domain's pairs" in out
    assert "pairs.jsonl, line 2: the SQL does not run on domain.sqlite" in out
    assert "no such table: items" in out
    assert "pairs.jsonl, line 4: missing or empty field(s) question" in out
    assert "Traceback" not in out
    assert (old / "meta.json").read_text() == '{"old": true}'
    assert not (tmp_path / "data" / "prepared.tmp").exists()
    # skipped and counted instead, and the user's database is only read
    r = _cli(
        ["stage", "prepare", *sum((["--set", x] for x in [*sets, "data.on_bad_record=skip"]), [])],
        tmp_path,
        prefect_server,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    meta = json.loads((old / "meta.json").read_text())["sql"]
    assert meta["skipped_records"] == 2 and meta["counts"]["domain_test"] == 1
    assert meta["sources"]["domain_database"] == str(db)
    assert db.read_bytes() == before


# ------------------------------------------------- bad input before any flow: one line, exit 2


def _bad_corpus(kind: str, root: Path) -> str:
    """A corpus of one broken kind under `root`; returns the data.source value."""
    if kind == "missing":
        return "no/such/corpus"
    if kind == "hub-offline":
        return "nosuch/corpus"  # the Hub is offline in tests: HF_HUB_OFFLINE=1 (conftest)
    src = root / "corpus"
    src.mkdir()
    if kind == "binary-only":
        (src / "weights.bin").write_bytes(os.urandom(4096))
        (src / "blob.txt").write_bytes(b"\xff\xfe\x00" + os.urandom(4096))
    elif kind == "unreadable":
        # A file every read of which fails (EIO), even for root: /proc/self/mem at offset 0.
        (src / "notes.txt").symlink_to("/proc/self/mem")
    elif kind == "not-utf8-file":
        (src / "book.txt").write_bytes("café au lait\n".encode("latin-1"))
        return str(src / "book.txt")
    return str(src)


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "data.source 'no/such/corpus': no such file or folder"),
        ("hub-offline", "nosuch/corpus is no local file or folder, and could not load the"),
        ("empty", "no documents with text"),
        ("binary-only", "1 undecodable file(s) skipped"),
        ("unreadable", "notes.txt (cannot be read (Input/output error))"),
        ("not-utf8-file", "book.txt: not utf-8 text: undecodable byte at line 1 (byte offset 3)"),
    ],
)
def test_a_bad_corpus_is_one_message_exit_2_and_nothing_written(
    tmp_path: Path, kind: str, message: str
) -> None:
    source = _bad_corpus(kind, tmp_path)
    r = _cli(["stage", "prepare", "--set", f"data.source={source}"], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: ") and message in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "Beginning flow run" not in r.stdout + r.stderr  # stopped before the flow started
    assert not (tmp_path / "data").exists()


def test_a_not_utf8_file_reads_with_data_encoding(tmp_path: Path) -> None:
    f = tmp_path / "book.txt"
    f.write_bytes("café au lait\n".encode("latin-1"))
    assert list(iter_documents(str(f), "text", 0, CorpusStats(), encoding="latin-1")) == [
        "café au lait\n"
    ]
    with pytest.raises(ConfigError, match=r"data.encoding = 'klingon': not a known text encoding"):
        load_config(None, ["data.encoding=klingon"])


def test_a_changed_upstream_model_is_refused_before_the_stage_runs(tmp_path: Path) -> None:
    """An upstream output that no longer has the hash its stage's lineage record holds."""
    (tmp_path / "data/published").mkdir(parents=True)
    (tmp_path / "data/published/receipt.json").write_text("{}")
    model = tmp_path / "models/pretrain/model.safetensors"
    model.parent.mkdir(parents=True)
    model.write_bytes(b"the weights pretrain wrote")
    record = {
        "outputs": {"model": {"path": "models/pretrain/model.safetensors", "sha256": "0" * 64}}
    }
    (model.parent / "lineage.json").write_text(json.dumps(record))
    r = _cli(["stage", "finetune_sql"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "needs models/pretrain/model.safetensors, which changed since the pretrain stage" in (
        r.stderr
    )
    assert not (tmp_path / "models/finetune_sql").exists()


# ----------------------------------------------------------------------- bad params files


def _check(tmp_path: Path, text: bytes | str, *sets: str) -> subprocess.CompletedProcess:
    f = tmp_path / "params.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    args = ["params", "check", "--params", "params.yaml"]
    for s in sets:
        args += ["--set", s]
    return _cli(args, tmp_path)


def test_a_params_file_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    r = _check(tmp_path, "pretrain:\n  lr: 0.001  # café\n".encode("latin-1"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not UTF-8 text: byte 0xe9 at line 2" in r.stderr


def test_a_params_file_that_is_not_a_mapping(tmp_path: Path) -> None:
    r = _check(tmp_path, "- train\n- lr\n")
    assert r.returncode == 2 and "the top level must be a mapping of sections, got list" in r.stderr


def test_yaml_aliases_are_refused_at_once(tmp_path: Path) -> None:
    # Nine levels of nine aliases each: 9**9 (387 million) items if expanded.
    lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]
    r = _check(tmp_path, "\n".join(lines) + "\n")  # the subprocess timeout is the hang guard
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "alias *l0 is not allowed in a params file" in r.stderr and "line 2" in r.stderr


def test_a_key_given_twice_names_both_lines(tmp_path: Path) -> None:
    r = _check(tmp_path, "pretrain:\n  lr: 0.001\n  max_steps: 5\n  lr: 0.002\n")
    assert r.returncode == 2
    assert "key 'lr' is given twice in one mapping (lines 2 and 4)" in r.stderr


def _float_knobs() -> list[str]:
    """The dotted path of every float field of the configuration."""
    import dataclasses
    import typing

    from tasks.config import Config

    found = []

    def walk(obj: object, prefix: str) -> None:
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            elif hints[f.name] is float:
                found.append(prefix + f.name)

    walk(Config(), "")
    return found


def test_every_float_knob_refuses_inf_and_nan(tmp_path: Path) -> None:
    knobs = _float_knobs()
    assert len(knobs) > 30 and "pretrain.lr" in knobs and "cost.budget" in knobs
    for bad in ("inf", "-.inf", ".nan"):
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"{k}={bad}" for k in knobs])
        for k in knobs:
            assert f"{k} = " in str(e.value) and "must be a finite number" in str(e.value), k
    r = _check(tmp_path, "pretrain:\n  lr: .inf\n")
    assert r.returncode == 2 and "pretrain.lr = inf: must be a finite number" in r.stderr
    assert "(params.yaml, line 2)" in r.stderr


# ------------------------------------------------------------------ real corpora just work


def _system_text(limit: int) -> bytes:
    """Text this project did not write: the licenses and copyright files Debian ships."""
    files = sorted(Path("/usr/share/common-licenses").glob("*"))
    files += sorted(Path("/usr/share/doc").glob("*/copyright"))
    out = bytearray()
    for p in files:
        if p.is_file() and len(out) < limit:
            out += p.read_bytes() + b"\n\n"
    return bytes(out)


def test_a_single_book_file_prepares_with_every_split(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """nanoGPT's way: the whole corpus in one text file (here ~1.4 MB of the licenses and
    copyright notices the system ships). It is cut into documents at paragraph breaks, so
    train, val and replay all get some."""
    import yaml

    from tests.conftest import tiny_params

    (tmp_path / "book.txt").write_bytes(_system_text(1_400_000))
    params = tiny_params()
    params["data"].update(source="book.txt", max_bytes=0)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = _cli(["stage", "prepare"], tmp_path, prefect_server)
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((tmp_path / "data/prepared/meta.json").read_text())
    assert meta["documents"] >= 60, meta
    for split in ("train", "val", "replay"):
        assert meta["splits"][split]["documents"] >= 2, meta["splits"]


def test_pipeline_input_errors_are_input_errors(tmp_path: Path, monkeypatch) -> None:
    """What a user can get wrong when starting the pipeline is an InputError (exit code 2 on
    the CLI, no retry): an unknown stage, a dispatch mode, a store other machines cannot
    reach."""
    from flows.pipeline import pipeline

    monkeypatch.chdir(tmp_path)  # the embedded default params; nothing to overwrite here
    with pytest.raises(InputError, match="unknown stage"):
        pipeline.fn(stages=["pretrain", "distill"])
    with pytest.raises(InputError, match="dispatch must be"):
        pipeline.fn(stages=["prepare"], dispatch="cluster")
    with pytest.raises(InputError, match="relative root"):
        pipeline.fn(stages=["prepare"], dispatch="deployments")
    assert list(tmp_path.iterdir()) == []


def test_importing_tasks_changes_no_environment() -> None:
    """The offline defaults are applied by the entry points (the flows package), not as a side
    effect of importing the task library."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "DO_NOT_TRACK")}
    code = (
        "import os, tasks.storage, tasks.pretraining;"
        "print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('DO_NOT_TRACK'));"
        "import flows;"
        "print(os.environ.get('HF_HUB_OFFLINE'), os.environ.get('DO_NOT_TRACK'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    assert out[:2] == ["None None", "1 1"]
