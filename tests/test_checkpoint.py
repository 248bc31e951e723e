"""Contract of moe/checkpoint/store.py: tiered, verified checkpoints. Every restorable checkpoint is
one bit-exact training state (deltas included, across retention); damaged or half-written ones
are skipped naming why; nothing outside the folder is read; hot/cold tiers follow the load;
the lossy fp16 cold tier says so."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe.checkpoint.manifest import WRITER
from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import flatten_optimizer, unflatten_optimizer, weights_digest
from tests.conftest import read_line

E, D, F = 4, 8, 16


def _state(step: int) -> tuple[dict, dict, dict, dict]:
    """A small model/optimizer state that drifts a little each step, like training."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, D, generator=g)
    experts = torch.randn(E, D, F, generator=g)
    drift = 1e-3 * step
    model = {
        "embed.weight": w + drift,
        "blocks.0.ffn.experts.w13_EDG": experts + drift,
        "blocks.0.ffn.router.expert_bias_E": torch.full((E,), drift),
    }
    optimizer = {
        "0.exp_avg": torch.full((D, D), drift),
        "0.step": torch.tensor(float(step)),
        "1.exp_avg": (experts * drift).clone(),
        "1.step": torch.tensor(float(step)),
    }
    rng = {"torch": torch.get_rng_state()}
    return model, optimizer, rng, {"step": step, "val_loss": 5.0 - 0.1 * step}


NAMES = {"0": "embed.weight", "1": "blocks.0.ffn.experts.w13_EDG"}
LOAD = {"blocks.0.ffn": [100.0, 90.0, 5.0, 105.0]}  # expert 2 is cold


def _save(store: CheckpointStore, step: int, val_loss: float | None = None) -> Path:
    model, opt, rng, state = _state(step)
    if val_loss is not None:
        state["val_loss"] = val_loss
    return store.save(step, model, opt, rng, state, param_names=NAMES, expert_load=LOAD)


def _assert_equal_state(ck, step: int) -> None:
    model, opt, _, state = _state(step)
    assert ck.step == step and ck.state == state
    for k, v in model.items():
        assert torch.equal(ck.model[k], v), k
    for k, v in opt.items():
        assert torch.equal(ck.optimizer[k], v), k


def test_round_trip_bit_exact_with_deltas_across_retention(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, max_retain=2, hot_every=3, cold_every=6, keep_best=False)
    for s in range(1, 9):
        _save(store, s)
    kept = sorted(int(p.name[5:]) for p in tmp_path.glob("step_*"))
    # Newest two (7, 8) plus the bases they need: L0/L1 were full at 7 (1, 4, 7), L2 at 7
    # (1, 7): so nothing else. Step 8 is a delta against 7.
    assert kept == [7, 8]
    info = {i.step: i for i in store.info()}
    assert info[8].deltas > 0 and info[8].bases == [7]
    for s in kept:
        _assert_equal_state(store.load(tmp_path / f"step_{s:08d}"), s)
    assert (tmp_path / "latest").read_text() == "step_00000008"


def test_retention_keeps_the_newest_and_their_bases(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, max_retain=1, hot_every=100, cold_every=100)
    for s in (1, 2, 3):
        _save(store, s)
    kept = sorted(int(p.name[5:]) for p in tmp_path.glob("step_*"))
    assert kept == [1, 3]  # 3 newest (and best: val_loss falls), 1 is its base
    _assert_equal_state(store.load(store.latest_valid()), 3)


@pytest.mark.parametrize("keep_best", [True, False])
def test_retention_keeps_the_best_when_it_is_not_the_newest(
    tmp_path: Path, keep_best: bool
) -> None:
    # Every checkpoint full (hot_every=1), so no step is kept as another's base.
    store = CheckpointStore(tmp_path, max_retain=2, hot_every=1, cold_every=1, keep_best=keep_best)
    for step, loss in ((1, 5.0), (2, 3.0), (3, 4.0), (4, 4.5), (5, 4.2)):
        _save(store, step, val_loss=loss)
    kept = sorted(int(p.name[5:]) for p in tmp_path.glob("step_*"))
    assert kept == ([2, 4, 5] if keep_best else [4, 5])  # step 2 has the lowest loss
    if keep_best:
        state = store.load(tmp_path / "step_00000002")
        assert state.step == 2 and state.state["val_loss"] == 3.0


def test_tiers_follow_expert_load(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, cold_threshold=0.5, cold_codec="bg-lzma")
    path = _save(store, 1)
    m = json.loads((path / "manifest.json").read_text())
    assert m["experts"]["blocks.0.ffn"] == {"hot": [0, 1, 3], "cold": [2]}
    assert m["expert_counts"] == {"blocks.0.ffn": 4}
    tiers = {t["key"]: t["tier"] for t in m["tensors"]}
    assert tiers["model/blocks.0.ffn.experts.w13_EDG[2]"] == "L2"
    assert tiers["model/blocks.0.ffn.experts.w13_EDG[0]"] == "L1"
    assert tiers["optimizer/1.exp_avg[2]"] == "L2"  # optimizer state goes with its expert
    assert tiers["model/embed.weight"] == "L0"
    assert tiers["model/blocks.0.ffn.router.expert_bias_E"] == "L0"
    codecs = {t["key"]: t["codec"] for t in m["tensors"]}
    assert codecs["model/blocks.0.ffn.experts.w13_EDG[2]"] == "bg-lzma"  # cold codec


def test_flipped_byte_fails_verify_and_restore_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = CheckpointStore(tmp_path, max_retain=3)
    _save(store, 1)
    newest = _save(store, 2)
    with open(newest / "L1.bin", "r+b") as f:
        f.seek(5)
        b = f.read(1)
        f.seek(5)
        f.write(bytes([b[0] ^ 0x01]))
    assert "L1.bin does not match its sha256" in store.verify(newest)
    with caplog.at_level(logging.WARNING):
        assert store.latest_valid().name == "step_00000001"
    assert "step_00000002" in caplog.text and "L1.bin" in caplog.text


def test_a_damaged_base_invalidates_its_deltas(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, max_retain=3, hot_every=100, cold_every=100)
    base = _save(store, 1)
    delta = _save(store, 2)
    with open(base / "L0.bin", "r+b") as f:
        f.write(b"\x00\x00\x00")
    assert "base checkpoint step_00000001" in store.verify(delta)
    assert store.latest_valid() is None


def test_incomplete_write_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    broken = tmp_path / "step_00000005"
    broken.mkdir()
    (broken / "L0.bin").write_bytes(b"partial")  # no manifest: the write died
    assert store.latest_valid().name == "step_00000001"


def test_a_manifest_this_version_cannot_read_is_named_and_skipped(tmp_path: Path) -> None:
    """Another format, a missing field and a corrupt manifest each say why; restore falls
    back to the newest checkpoint this version reads, and `info` still lists them."""
    store = CheckpointStore(tmp_path)
    good = _save(store, 1)
    for step, edit in (
        (2, lambda m: {**m, "format": 1}),
        (3, lambda m: {k: v for k, v in m.items() if k != "tensors"}),
        (4, lambda m: {**m, "files": {"L0.bin": {"sha": "x"}}}),
    ):
        path = _save(store, step)
        m = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps(edit(m)))
    why = {i.step: i.problem for i in store.info()}
    assert why[2] == (
        f"checkpoint format 1 (written by {WRITER}; this one, {WRITER}, reads formats 2, 3: "
        "resume with that version, or start fresh)"
    )
    m = json.loads((store.step_dir(2) / "manifest.json").read_text())
    m["written_by"] = "moe-pipeline 0.0.9"
    (store.step_dir(2) / "manifest.json").write_text(json.dumps(m))
    assert "written by moe-pipeline 0.0.9; this one" in store.verify(store.step_dir(2))
    assert why[3].startswith("unreadable manifest.json (KeyError('tensors')")
    assert why[4].startswith("unreadable manifest.json (TypeError(")
    assert why[1] is None and store.latest_valid() == good
    assert store.load(good).step == 1
    for junk in (b"\xff\xfe not utf-8", b"[" * 100_000, b"null"):  # never a crash
        (tmp_path / "step_00000003" / "manifest.json").write_bytes(junk)
        assert store.verify(tmp_path / "step_00000003").startswith("unreadable manifest.json")
    for step in (5, 6, 7, 8):  # retention never deletes what another version wrote
        _save(store, step)
    assert (tmp_path / "step_00000002").is_dir() and not (tmp_path / "step_00000004").exists()


def test_process_killed_mid_save_leaves_previous_restorable(tmp_path: Path) -> None:
    """A real process writes step 1, then is SIGKILLed while writing a large step 2."""
    # The child announces the moment it is inside step 2's write (after its first tier file
    # is encoded) and then waits there: the kill lands mid-write on any CPU, fast or slow.
    script = textwrap.dedent(
        f"""
        import sys, time, torch
        import moe.checkpoint.whole as C
        from moe.checkpoint.store import CheckpointStore
        store = CheckpointStore({str(tmp_path)!r}, cold_codec="bg-lzma")
        store.save(1, {{"w": torch.ones(4)}}, {{}}, {{}}, {{"step": 1}})
        print("saved", flush=True)
        real_encode = C.encode
        def encode_then_wait(*a, **k):
            out = real_encode(*a, **k)
            print("writing", flush=True)
            time.sleep(600)
            return out
        C.encode = encode_then_wait
        big = {{"blocks.0.ffn.experts.w": torch.randn(4, 64, 64)}}
        store.save(2, big, {{}}, {{}}, {{"step": 2}},
                   expert_load={{"blocks.0.ffn": [0.0, 0.0, 0.0, 1.0]}})
        print("finished", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=Path.cwd()
    )
    try:
        assert read_line(proc, timeout=120) == "saved"
        assert read_line(proc, timeout=120) == "writing"
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert list(tmp_path.glob(".tmp-step_00000002-*"))  # it died mid-write
    store = CheckpointStore(tmp_path)
    path = store.latest_valid()
    assert path is not None and path.name == "step_00000001"
    assert torch.equal(store.load(path).model["w"], torch.ones(4))


def test_manifest_naming_outside_file_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = _save(store, 1)
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["../../etc/passwd"] = {"sha256": "0", "bytes": 0}
    (path / "manifest.json").write_text(json.dumps(m))
    assert "outside the checkpoint folder" in store.verify(path)
    assert store.latest_valid() is None


def test_fp16_cold_tier_is_flagged_lossy(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStore(tmp_path, cold_codec="fp16-zstd")
    path = _save(store, 1)
    m = json.loads((path / "manifest.json").read_text())
    assert m["lossy"] is True
    lossy = {t["key"] for t in m["tensors"] if t["lossy"]}
    assert "model/blocks.0.ffn.experts.w13_EDG[2]" in lossy  # the cold expert
    assert not any("[0]" in k or "embed" in k for k in lossy)  # hot and shared stay exact
    with caplog.at_level(logging.WARNING):
        ck = store.load(path)
    assert "lossy" in caplog.text and ck.lossy
    assert [i.lossy for i in store.info()] == [True]


def test_the_background_writer_writes_after_save_has_returned(tmp_path: Path) -> None:
    """save() copies the tensors and returns; the encode and write happen on the writer
    thread afterwards. Checked by events, not by comparing two timings: the write is held
    at a gate the test opens only once save() has returned, and it must run off the
    training thread (a synchronous write would fail that at once)."""
    import threading

    store = CheckpointStore(tmp_path, background=True, cold_codec="bg-lzma")
    gate, writers = threading.Event(), []
    real_write = store._writer.write

    def gated_write(*job: object) -> None:
        writers.append(threading.current_thread())
        assert threading.current_thread() is not threading.main_thread(), "written inline"
        gate.wait()  # opened by the test after save() returned
        real_write(*job)

    store._writer.write = gated_write
    big = {"blocks.0.ffn.experts.w": torch.randn(8, 64, 256)}
    load = {"blocks.0.ffn": [0.0] * 7 + [1.0]}
    path = store.save(1, big, {}, {}, {"step": 1}, expert_load=load)
    assert not path.exists()  # save() returned; nothing is on disk yet
    big["blocks.0.ffn.experts.w"].add_(1.0)  # the next optimizer step changes the tensor
    gate.set()
    store.flush()
    assert [t.name for t in writers] == ["checkpoint-writer"]
    saved = store.load(store.latest_valid()).model["blocks.0.ffn.experts.w"]
    assert torch.equal(saved + 1.0, big["blocks.0.ffn.experts.w"])  # the copy taken at save()
    store.close()


def test_background_write_error_surfaces(tmp_path: Path) -> None:
    root = tmp_path / "file-not-dir"
    root.write_text("")
    store = CheckpointStore(root, background=True)
    store.save(1, {"w": torch.ones(2)}, {}, {}, {"step": 1})
    with pytest.raises(RuntimeError, match="background checkpoint write failed"):
        store.flush()


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


def test_cli_ls_verify_restore_export(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from safetensors.torch import load_file

    from flows.cli import main

    root = tmp_path / "model"
    store = CheckpointStore(root / "checkpoints", max_retain=3, hot_every=100)
    for s in (1, 2, 3):
        _save(store, s)
    assert main(["checkpoint", "ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.count("valid") == 3 and "deltas=" in out and "cold=1" in out
    assert main(["checkpoint", "verify", str(root)]) == 0
    assert (
        main(["checkpoint", "restore", str(root), "--step", "2", "--out", str(tmp_path / "a")]) == 0
    )
    model, *_ = _state(2)
    restored = load_file(str(tmp_path / "a"))
    assert all(torch.equal(restored[k], v) for k, v in model.items())
    assert main(["checkpoint", "export", str(root), "--out", str(tmp_path / "b.safetensors")]) == 0
    assert torch.equal(
        load_file(str(tmp_path / "b.safetensors"))["embed.weight"], _state(3)[0]["embed.weight"]
    )
    capsys.readouterr()
    # Damage step 3: verify fails naming it; restoring it is refused with the valid steps.
    with open(root / "checkpoints" / "step_00000003" / "L0.bin", "r+b") as f:
        f.write(b"\xff")
    assert main(["checkpoint", "verify", str(root)]) == 1
    assert "INVALID: L0.bin does not match" in capsys.readouterr().out
    assert (
        main(["checkpoint", "restore", str(root), "--step", "3", "--out", str(tmp_path / "c")]) == 2
    )
    err = capsys.readouterr().err
    assert "step 3" in err and "valid steps: 2, 1" in err
    assert not (tmp_path / "c").exists()
    assert main(["checkpoint", "ls", str(tmp_path / "nothing")]) == 2


def test_a_written_save_is_not_held_until_the_next_one() -> None:
    """The background writer drops a save's host copy once it is written: it must not sit in
    the idle worker (1.5 GB of SmolLM2's state held from one save to the next)."""
    import gc
    import weakref

    from moe.checkpoint.writer import BackgroundWriter

    written = []
    writer = BackgroundWriter(lambda step, snap: written.append(step))
    snap = torch.zeros(1000)
    alive = weakref.ref(snap)
    writer.put((1, snap))
    del snap
    writer.join()
    gc.collect()
    assert written == [1] and alive() is None
    writer.stop()
