"""Contract of the configuration (moe/config.py, moe/<part>/config.py) and `moe-pipeline params check`: one source of configuration;
every bad key, type or value is named with its path, exits 2, and touches nothing."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from moe.config import ConfigError
from tasks.config import Config, default_yaml, load_config

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_shipped_params_equal_embedded_default() -> None:
    # params.yaml lists every knob (so DVC can track them) and repeats the embedded default.
    assert load_config(ROOT / "params.yaml") == Config()
    assert yaml.safe_load((ROOT / "params.yaml").read_text()) == yaml.safe_load(default_yaml())


def test_override_parses_scientific_notation_and_nested_dicts() -> None:
    cfg = load_config(ROOT / "params.yaml", ["pretrain.lr=3e-4", "pools.stages.pretrain=cpu"])
    assert cfg.pretrain.lr == pytest.approx(3e-4)
    assert cfg.pools.stages["pretrain"] == "cpu"
    assert cfg.pools.stages["evaluate"] == "gpu-4090"  # one entry changed, the others kept


@pytest.mark.parametrize(
    ("data", "key", "fragment"),
    [
        ({"pretrain": {"lrr": 0.1}}, "pretrain.lrr", "unknown key"),
        ({"bogus": {}}, "bogus", "unknown key"),
        ({"moe": {"num_experts": 4, "top_k": 5}}, "moe.top_k", "must be <= moe.num_experts (4)"),
        (
            {"moe": {"dropless": False, "capacity_factor": 0.0}},
            "moe.capacity_factor",
            "must be > 0 when moe.dropless is false",
        ),
        ({"moe": {"balancing": ["aux_loss", "aux_free2"]}}, "moe.balancing[1]", "one of"),
        ({"moe": {"balancing": ["z_loss", "z_loss"]}}, "moe.balancing", "names a method twice"),
        ({"pretrain": {"lr": 0.0}}, "pretrain.lr", "must be > 0"),
        ({"pretrain": {"lr": -1e-3, "min_lr": 0.0}}, "pretrain.lr", "must be > 0"),
        ({"pretrain": {"max_steps": 0}}, "pretrain.max_steps", "must be >= 1"),
        ({"pretrain": {"lr": "fast"}}, "pretrain.lr", "expected a number"),
        ({"pretrain": {"max_steps": 1.5}}, "pretrain.max_steps", "expected an integer"),
        ({"model": {"tie_embeddings": "yes"}}, "model.tie_embeddings", "expected true or false"),
        ({"pretrain": {"dtype": "fp8"}}, "pretrain.dtype", "one of"),
        (
            {"pools": {"stages": {"pretrain": "gpu-b200"}}},
            "pools.stages.pretrain",
            "not a pool defined",
        ),
        ({"storage": {"backend": "s3"}}, "storage.bucket", "needs a bucket"),
        ({"pools": {"definitions": {"cpu": 5}}}, "pools.definitions.cpu", "expected a mapping"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, data: dict, key: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, data))
    lines = [p for p in err.value.problems if p.startswith(key + " ")]
    assert lines, err.value.problems
    assert fragment in lines[0]
    assert "params.yaml, line" in lines[0]  # the file and line are named


def test_all_problems_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, {"pretrain": {"lr": 0, "max_steps": 0}, "moe": {"top_k": 99}}))
    paths = {p.split(" ")[0] for p in err.value.problems}
    assert {"pretrain.lr", "pretrain.max_steps", "moe.top_k"} <= paths


def test_override_errors_say_they_came_from_set() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["pretrain.max_steps=abc"])
    assert "pretrain.max_steps = 'abc': expected an integer (from --set)" in str(err.value)
    with pytest.raises(ConfigError):
        load_config(None, ["no_equals_sign"])


def test_the_old_train_section_is_told_to_be_renamed(tmp_path: Path) -> None:
    """A params file from before the rename (`train:`) is told what to rename, with its
    line; its values are still checked under the new name, so nothing else goes unreported."""
    old = tmp_path / "params.yaml"
    old.write_text("model:\n  n_layer: 2\ntrain:\n  max_steps: 0\n")
    with pytest.raises(ConfigError) as err:
        load_config(old)
    assert err.value.problems == [
        "train: this section is now named pretrain, after its stage: rename `train:` to "
        f"`pretrain:` (and --set train.KEY to --set pretrain.KEY) ({old}, line 3)",
        f"pretrain.max_steps = 0: must be >= 1 ({old}, line 4)",
    ]
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.max_steps=5"])
    assert err.value.problems[0].startswith("train.max_steps: this section is now named pretrain")
    assert err.value.problems[0].endswith("(from --set)")
    # Beside today's pretrain: section, the old name's values are still checked
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "params.yaml", ["train.lr=0"])
    assert err.value.problems[1] == "pretrain.lr = 0.0: must be > 0 (from --set)"


def _bounded_fields(section: object, path: str) -> list[tuple[str, tuple, str]]:
    """(key path, (ge, gt, le, lt) or None for a pattern, note) of every field declared with
    knob(), nested ones and mappings of sections (pools.definitions.<pool>) included."""
    out = []
    for f in dataclasses.fields(section):
        value, key = getattr(section, f.name), f"{path}.{f.name}" if path else f.name
        if "bounds" in f.metadata or "pattern" in f.metadata:
            out.append((key, f.metadata.get("bounds"), f.metadata["note"]))
        elif dataclasses.is_dataclass(value):
            out += _bounded_fields(value, key)
        elif isinstance(value, dict):
            for k, v in value.items():
                if dataclasses.is_dataclass(v):
                    out += _bounded_fields(v, f"{key}.{k}")
    return out


def _just_outside(
    ge: float | None, gt: float | None, le: float | None, lt: float | None
) -> dict[str, float]:
    """A value just outside each side the range declares: {"low": ..., "high": ...}."""
    out = {}
    if ge is not None or gt is not None:
        out["low"] = ge - 1 if ge is not None else gt
    if le is not None or lt is not None:
        out["high"] = le + 1 if le is not None else lt
    return out


def test_every_declared_range_is_enforced_with_its_key_and_file_line(tmp_path: Path) -> None:
    """Each knob's range or pattern (declared on the field, checked by one path) refuses a
    value just outside it, on each side it declares (one report for all the lower sides,
    one for all the upper), naming the key path, the range and the line."""
    fields = _bounded_fields(Config(), "")
    keys = [k for k, _, _ in fields]
    assert len(keys) > 100 and "pools.definitions.gpu-h100.price_per_hour" in keys
    assert {"pretrain.device", "evaluate.device", "multinode.namespace"} <= set(keys)
    probes: dict[str, dict[str, object]] = {"low": {}, "high": {}}
    for key, bounds, _ in fields:
        # a pattern field (device, namespace) gets a string no pattern matches
        sides = {"low": "Not A/Match"} if bounds is None else _just_outside(*bounds)
        for side, bad in sides.items():
            probes[side][key] = bad
    assert "checkpoint.hot_level" in probes["high"]  # level 30 must not pass
    assert len(probes["high"]) > 15
    for side, expected in probes.items():
        raw: dict = {}
        for key, bad in expected.items():
            node = raw
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = bad
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, raw))
        problems = {p.split(" = ")[0]: p for p in err.value.problems}
        for key in expected:
            assert key in problems, f"{key} = {expected[key]} ({side} side) was accepted"
            assert " must be " in problems[key] and "params.yaml, line" in problems[key], problems[
                key
            ]


def test_not_a_mapping_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "p.yaml"
    p.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(p)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"pretrain": {"unknown_knob": 1}}, "pretrain.unknown_knob"),
        ({"moe": {"num_experts": 2, "top_k": 3}}, "moe.top_k"),
        ({"pretrain": {"lr": -0.1, "min_lr": 0.0}}, "pretrain.lr"),
        ({"pretrain": {"batch_size": "many"}}, "pretrain.batch_size"),
    ],
)
def test_cli_check_exits_2_naming_the_key(tmp_path: Path, data: dict, key: str) -> None:
    r = _cli("params", "check", "--params", str(write(tmp_path, data)), cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert key in r.stderr


def test_cli_stage_with_bad_params_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "data" / "prepared"
    out.mkdir(parents=True)
    (out / "meta.json").write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    write(tmp_path, {"data": {"val_fraction": 2.0}})
    r = _cli("stage", "prepare", cwd=tmp_path)
    assert r.returncode == 2
    assert "data.val_fraction" in r.stderr
    assert (out / "meta.json").read_text() == "{}"
    after = {p for p in tmp_path.rglob("*") if p.is_file()}
    assert after == set(before) | {tmp_path / "params.yaml"}


def test_cli_check_ok(tmp_path: Path) -> None:
    r = _cli("params", "check", "--params", str(ROOT / "params.yaml"), cwd=tmp_path)
    assert r.returncode == 0 and "OK" in r.stdout


def _prepare_again(prepared: Path, question: str) -> None:
    """What prepare leaves: its data, and its lineage record's digest of it."""
    from tasks.lineage import content_hash

    (prepared / "sql_domain_test.jsonl").write_text(json.dumps({"question": question}) + "\n")
    record = {"outputs": {"prepared": {"path": "data/prepared", "sha256": content_hash(prepared)}}}
    (prepared / "lineage.json").write_text(json.dumps(record))


def _publish(prepared: Path) -> dict[str, str]:
    """The receipt publish writes for the data in `prepared` (tasks/archive.py's digests)."""
    from tasks.archive import _file_manifest, _version
    from tasks.lineage import folder_digest

    files = _file_manifest(prepared)
    receipt = {
        "name": "demo",
        "version": _version(files),
        "prepared_sha256": folder_digest({k: f["sha256"] for k, f in files.items()}),
    }
    (prepared.parent / "published" / "receipt.json").write_text(json.dumps(receipt))
    return receipt


def _prepared_and_published(root: Path) -> Path:
    """data/prepared as prepare leaves it, data/published/receipt.json as publish leaves it
    for that data, and a pretrained model folder: what a finetune stage reads."""
    prepared = root / "data" / "prepared"
    prepared.mkdir(parents=True)
    (prepared / "meta.json").write_text('{"vocab_size": 64}')
    (prepared / "tokenizer.json").write_text("{}")
    _prepare_again(prepared, "old")
    (root / "data" / "published").mkdir(parents=True)
    _publish(prepared)
    for stage in ("pretrain", "finetune_sql", "finetune_domain"):
        (root / "models" / stage).mkdir(parents=True)
        (root / "models" / stage / "model.safetensors").write_bytes(b"weights")
    return prepared


def test_a_stage_never_reads_a_publish_that_the_prepared_data_has_left_behind(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`prepare` ran again (another test set) and publish did not: a stage that reads the
    published data stops before any compute (exit 2) naming both digests and the command;
    `run --stages` that prepares without publishing says publish is left out. Nothing is
    written. (The stages are asked in this process, the `run` in a real one.) The check
    compares prepare's and publish's recorded digests: no prepared file is hashed."""
    import moe.hashing
    from flows.cli import main
    from tasks.lineage import content_hash

    prepared = _prepared_and_published(tmp_path)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    published = json.loads((tmp_path / "data/published/receipt.json").read_text())["version"]
    _prepare_again(prepared, "new")
    now = content_hash(prepared)

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} was hashed at a stage's start")

    monkeypatch.setattr(moe.hashing, "sha256_file", no_hashing)
    for module in ("tasks.archive", "tasks.lineage"):
        monkeypatch.setattr(f"{module}.sha256_file", no_hashing)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with monkeypatch.context() as mp:
        mp.chdir(tmp_path)
        from flows import stages

        def started(**_: object) -> None:
            raise AssertionError("the stage's flow started: the check let stale data through")

        for name in stages.STAGE_FLOWS:  # in this process, a stage let through fails at once
            mp.setitem(stages.STAGE_FLOWS, name, started)
        for stage in ("finetune_sql", "finetune_domain", "evaluate"):
            capsys.readouterr()
            code = main(["stage", stage])
            err = capsys.readouterr().err
            assert code == 2, err
            assert published in err and "moe-pipeline stage publish" in err, err
            assert now[:16] in err
    r = _cli("run", "--stages", "prepare", "finetune_domain", "evaluate", cwd=tmp_path)
    assert r.returncode == 2 and "Add publish to --stages" in r.stderr, r.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # published again (the receipt names what is on disk): the check lets the stage start
    monkeypatch.undo()
    receipt = _publish(prepared)
    from flows.stage import read_published

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        mp.setattr("tasks.archive.sha256_file", no_hashing)
        assert read_published(load_config("params.yaml", []))["version"] == receipt["version"]
        # a GPU worker under dispatch: deployments holds only what prepare hands off (meta,
        # params, lineage): the same two digests are compared
        (prepared / "tokenizer.json").unlink()
        (prepared / "sql_domain_test.jsonl").write_text('{"question": "elsewhere"}\n')
        assert read_published(load_config("params.yaml", []))["name"] == "demo"
        # a worker with no prepare record at all reads the receipt as it is, and says so
        (prepared / "lineage.json").unlink()
        logger = logging.getLogger("flows.stages")  # Prefect's config may not propagate it
        mp.setattr(logger, "handlers", [*logger.handlers, caplog.handler])
        with caplog.at_level(logging.INFO, logger="flows.stages"):
            assert read_published(load_config("params.yaml", []))["name"] == "demo"
        assert "does not apply" in caplog.text
