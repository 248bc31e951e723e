"""Hand-off through the object store between working folders that share nothing, and the
skip of a stage whose params, code and inputs are unchanged (tasks/handoff.py, up_to_date)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from flows.stages import STAGES_BY_NAME
from moe.errors import InputError
from tasks.config import load_config
from tasks.handoff import pull_inputs, push_outputs
from tasks.lineage import StageRecord, up_to_date
from tests.conftest import ROOT


@pytest.fixture
def cwd(tmp_path: Path) -> Iterator[Path]:
    old = Path.cwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(old)


def stage_outputs(cfg, stage: str) -> list[Path]:
    """What the stage's declaration hands off (flows/stages.py)."""
    return STAGES_BY_NAME[stage].handoff(cfg)


def _fake_pretrain(folder: Path) -> None:
    (folder / "models/pretrain/checkpoints/step_1").mkdir(parents=True)
    (folder / "models/pretrain/checkpoints/step_1/x.bin").write_bytes(b"big")
    (folder / "models/pretrain/model.safetensors").write_bytes(b"weights" * 100)
    (folder / "models/pretrain/lineage.json").write_text("{}")
    (folder / "reports").mkdir()
    (folder / "reports/pretrain.json").write_text('{"steps": 3}')


def test_outputs_travel_verified_and_only_once(cwd: Path) -> None:
    store = cwd / "bucket"
    cfg = load_config(None, [f"storage.root={store}"])
    a, b = cwd / "machine-a", cwd / "machine-b"
    a.mkdir(), b.mkdir()
    os.chdir(a)
    _fake_pretrain(a)
    files = {p.as_posix() for p in stage_outputs(cfg, "pretrain")}
    assert "models/pretrain/model.safetensors" in files and "reports/pretrain.json" in files
    assert not any("checkpoints" in f for f in files)  # checkpoints stay on the pool's disk
    push_outputs.fn(cfg, "pretrain", "run1", stage_outputs(cfg, "pretrain"))
    os.chdir(b)
    assert pull_inputs.fn(cfg, "x", "run1", upto=["pretrain"]) == len(files)
    assert (b / "models/pretrain/model.safetensors").read_bytes() == b"weights" * 100
    assert pull_inputs.fn(cfg, "x", "run1", upto=["pretrain"]) == 0  # present and verified

    # a damaged object is refused and the local copy is left as it was
    (b / "models/pretrain/model.safetensors").write_bytes(b"stale")
    obj = store / "runs/run1/pretrain/files/models/pretrain/model.safetensors"
    obj.write_bytes(b"tampered")
    with pytest.raises(ValueError, match="does not match the manifest"):
        pull_inputs.fn(cfg, "x", "run1", upto=["pretrain"])
    assert (b / "models/pretrain/model.safetensors").read_bytes() == b"stale"

    # an upstream stage that never handed off is named
    with pytest.raises(InputError, match="finetune_sql stage of run run1 has not finished"):
        pull_inputs.fn(cfg, "x", "run1", upto=["finetune_sql"])


def test_a_manifest_cannot_write_outside_the_working_folder(cwd: Path) -> None:
    store = cwd / "bucket"
    cfg = load_config(None, [f"storage.root={store}"])
    m = store / "runs/r/pretrain/manifest.json"
    m.parent.mkdir(parents=True)
    m.write_text(json.dumps({"files": {"../../etc/evil": {"sha256": "0" * 64}}}))
    with pytest.raises(InputError, match="not a relative path inside the store"):
        pull_inputs.fn(cfg, "x", "r", upto=["pretrain"])
    with pytest.raises(InputError, match="may not contain"):
        push_outputs.fn(cfg, "pretrain", "a/b", [])


def test_up_to_date_follows_params_inputs_and_outputs(cwd: Path) -> None:
    (cwd / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    for dep in ("moe/train/trainer.py", "tasks/training.py", "moe/model/transformer.py"):
        (cwd / dep).parent.mkdir(parents=True, exist_ok=True)
        (cwd / dep).write_text((ROOT / dep).read_text())
    cfg = load_config(None, [f"storage.root={cwd / 'bucket'}"])
    receipt = cwd / "data/published/receipt.json"
    receipt.parent.mkdir(parents=True)
    receipt.write_text('{"version": "v1"}')
    _fake_pretrain(cwd)
    out = Path("models/pretrain")
    inputs = {"receipt": Path("data/published/receipt.json")}
    outputs = stage_outputs(cfg, "pretrain")
    StageRecord(cfg, "pretrain", out).write(
        inputs, {"model": out / "model.safetensors"}, {"stop_reason": "max_steps"}
    )
    assert up_to_date(cfg, "pretrain", out, inputs, outputs) is not None
    # another stage's params do not matter; this stage's do
    other = load_config(None, [f"storage.root={cwd / 'bucket'}", "finetune_sql.lr=1e-5"])
    assert up_to_date(other, "pretrain", out, inputs, outputs) is not None
    mine = load_config(None, [f"storage.root={cwd / 'bucket'}", "pretrain.lr=1e-2"])
    assert up_to_date(mine, "pretrain", out, inputs, outputs) is None
    # a changed input, a changed output, changed code: the stage runs
    receipt.write_text('{"version": "v2"}')
    assert up_to_date(cfg, "pretrain", out, inputs, outputs) is None
    receipt.write_text('{"version": "v1"}')
    (out / "model.safetensors").write_bytes(b"edited")
    assert up_to_date(cfg, "pretrain", out, inputs, outputs) is None
    (out / "model.safetensors").write_bytes(b"weights" * 100)
    assert up_to_date(cfg, "pretrain", out, inputs, outputs) is not None
    (cwd / "moe/train/trainer.py").write_text("# changed\n")
    assert up_to_date(cfg, "pretrain", out, inputs, outputs) is None


def test_a_budget_stopped_stage_is_not_skipped(cwd: Path) -> None:
    cfg = load_config(None, [f"storage.root={cwd / 'bucket'}"])
    _fake_pretrain(cwd)
    out = Path("models/pretrain")
    StageRecord(cfg, "pretrain", out).write(
        {}, {"model": out / "model.safetensors"}, {"stop_reason": "cost budget reached"}
    )
    assert up_to_date(cfg, "pretrain", out, {}, stage_outputs(cfg, "pretrain")) is None


def test_a_project_folder_of_its_own_compares_the_code_a_stage_ran(
    cwd: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`moe-pipeline run` in a folder without dvc.yaml (a project of the user's own): the
    package's dvc.yaml names each stage's code, so a stage whose code changed runs again
    there too (it was skipped: no dvc.yaml, nothing compared), and the record names the
    package's commit, not "unknown"."""
    import shutil
    import subprocess

    from tasks import lineage

    assert not (cwd / "dvc.yaml").exists()
    deps = lineage.code_deps("pretrain")
    assert "moe/recipes/pretrain.py" in deps, deps
    assert set(lineage.code_deps("prepare")) >= {"moe/sql/generator.py", "moe/sql/roles.py"}
    if (ROOT / ".git").exists():  # a checkout (CI's is); a copy without git says MOE_CODE_COMMIT
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert lineage.code_version()["commit"] == head
    pkg = cwd / "pkg"  # the package as another version of it: its pretrain code copied
    for rel in deps:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, pkg / rel)
    shutil.copy(ROOT / "dvc.yaml", pkg / "dvc.yaml")
    monkeypatch.setattr(lineage, "PACKAGE_ROOT", pkg)
    cfg = load_config(None, [f"storage.root={cwd / 'bucket'}"])
    _fake_pretrain(cwd)
    out = Path("models/pretrain")
    StageRecord(cfg, "pretrain", out).write({}, {"model": out / "model.safetensors"}, {})
    assert up_to_date(cfg, "pretrain", out, {}, stage_outputs(cfg, "pretrain")) is not None
    changed = pkg / "moe/recipes/pretrain.py"
    changed.write_text(changed.read_text() + "\n# another version\n")
    assert up_to_date(cfg, "pretrain", out, {}, stage_outputs(cfg, "pretrain")) is None
