"""Contract of moe/checkpoint.py: atomic, verified checkpoints; damaged ones are skipped;
nothing outside the folder is read; retention keeps the newest N."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from moe.checkpoint import CheckpointStore, flatten_optimizer, unflatten_optimizer, weights_digest


def _save(store: CheckpointStore, step: int) -> Path:
    t = {"w": torch.full((3,), float(step))}
    return store.save(
        step, t, {"0.exp_avg": torch.zeros(3)}, {"torch": torch.get_rng_state()}, {"step": step}
    )


def test_round_trip_and_retention(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep_last=2)
    for s in (1, 2, 3):
        _save(store, s)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    ck = store.load(store.latest_valid())
    assert ck.step == 3 and torch.equal(ck.model["w"], torch.full((3,), 3.0))
    assert (tmp_path / "latest").read_text() == "step_00000003"


def test_damaged_newest_is_skipped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, keep_last=3)
    _save(store, 1)
    newest = _save(store, 2)
    with open(newest / "model.safetensors", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    with caplog.at_level(logging.WARNING):
        assert store.latest_valid().name == "step_00000001"
    assert "step_00000002" in caplog.text and "sha256" in caplog.text


def test_incomplete_write_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    broken = tmp_path / "step_00000005"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"partial")  # no manifest: the write died
    assert store.latest_valid().name == "step_00000001"


def test_manifest_naming_outside_file_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = _save(store, 1)
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = {"sha256": "0", "bytes": 0}
    (path / "manifest.json").write_text(json.dumps(m))
    assert "outside the checkpoint folder" in store.verify(path)
    assert store.latest_valid() is None


def test_optimizer_state_round_trip() -> None:
    p = torch.nn.Parameter(torch.randn(4))
    opt = torch.optim.AdamW([p], lr=0.1)
    p.grad = torch.randn(4)
    opt.step()
    tensors, rest = flatten_optimizer(opt.state_dict())
    json.dumps(rest)  # the non-tensor part is plain JSON
    opt2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone())], lr=0.1)
    opt2.load_state_dict(unflatten_optimizer(tensors, json.loads(json.dumps(rest))))
    for k in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt2.state_dict()["state"][0][k], opt.state_dict()["state"][0][k])


def test_digest_depends_on_values_and_names() -> None:
    a = {"x": torch.zeros(2), "y": torch.ones(2)}
    assert weights_digest(a) == weights_digest(dict(reversed(a.items())))
    assert weights_digest(a) != weights_digest({"x": torch.zeros(2), "y": torch.zeros(2)})
