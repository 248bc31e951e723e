"""Data + expert parallel training on real process groups: torchrun, gloo, 2 CPU processes
(tests/dist_worker.py), checked against the same computation at world size 1 in this process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_file_bytes
from safetensors.torch import load_file

from moe.checkpoint import CheckpointStore, flatten_optimizer, model_tensors
from moe.config import ModelConfig, MoEConfig, PretrainConfig
from tasks.config import Config
from tests import dist_worker as W
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _torchrun(
    mode: str, out: Path, nproc: int = 2, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(ROOT / "tests" / "dist_worker.py"),
            mode,
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


def _world1(steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, float]:
    model = W.build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = 0.0
    for _ in range(steps):
        loss = W.step(model, opt, 0, 1)
    return model, opt, loss


def test_one_step_at_world_2_equals_world_1(tmp_path: Path) -> None:
    proc = _torchrun("step", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model, _, loss = _world1()
    got = json.loads((tmp_path / "step_w2.json").read_text())["loss"]
    assert got == pytest.approx(loss, rel=1e-5)
    full = load_file(str(tmp_path / "step_w2.safetensors"))
    ref = model_tensors(model)
    assert set(full) == set(ref)
    assert full["blocks.0.ffn.experts.w13_EDG"].shape[0] == 4  # every expert, global ids
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    # The aux-free bias moved the same way on both (all-reduced load).
    assert not torch.equal(ref["blocks.0.ffn.router.expert_bias_E"], torch.zeros(4))


def test_checkpoints_cross_world_sizes(tmp_path: Path) -> None:
    # Written at world size 1 ...
    model, opt, _ = _world1()
    opt_t, rest = flatten_optimizer(opt.state_dict())
    CheckpointStore(tmp_path / "ckpt_w1").save(
        1, model_tensors(model), opt_t, {}, {"step": 1, "optimizer": rest}
    )
    # ... restored at world size 2 (the worker checks the gathered state equals it), trained
    # one more step there and written at world size 2 ...
    proc = _torchrun("ckpt", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    store = CheckpointStore(tmp_path / "ckpt_w2")
    ck = store.load(store.latest_valid())
    assert ck.model["blocks.1.ffn.experts.w2_EFD"].shape[0] == 4
    # ... restored at world size 1: equal to two steps at world size 1.
    ref, ref_opt, _ = _world1(steps=2)
    restored = W.build()
    restored.load_state_dict(ck.model, strict=False)
    for k, v in model_tensors(ref).items():
        torch.testing.assert_close(model_tensors(restored)[k], v, rtol=1e-5, atol=1e-6, msg=k)
    ref_t, _ = flatten_optimizer(ref_opt.state_dict())
    for k, v in ref_t.items():
        torch.testing.assert_close(ck.optimizer[k], v, rtol=1e-5, atol=1e-7, msg=k)


def test_a_dead_rank_fails_the_run_fast(tmp_path: Path) -> None:
    # Rank 1 vanishes mid-step (os._exit(3)). torchrun notices, stops rank 0 and fails the
    # launch; subprocess.run's timeout (120 s) fails this test (TimeoutExpired) if the launch
    # hung instead. The failure must be that death, not any other crash.
    import re

    proc = _torchrun("die", tmp_path, timeout=120)
    assert proc.returncode != 0
    # torchrun's failure summary lists every rank that failed: rank 1 with its own code.
    assert re.search(r"local_rank: 1\)\s*\n\s*exitcode\s*: 3 ", proc.stderr), proc.stderr[-2000:]


def test_expert_count_must_divide_over_ranks() -> None:
    from moe.distributed import ExpertParallelExperts
    from moe.experts import GroupedExperts

    with pytest.raises(ValueError, match="num_experts=6 does not divide over 4 processes"):
        ExpertParallelExperts(GroupedExperts(6, 8, 16), rank=0, world=4)


def torchrun_config(device: str) -> Config:
    """A tiny whole config whose pretrain stage runs 4 steps on 2 processes on `device`."""
    cfg = Config(
        model=ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        pretrain=PretrainConfig(
            max_steps=4,
            batch_size=4,
            warmup_steps=1,
            eval_every=4,
            eval_batches=2,
            checkpoint_every=2,
            log_every=1,
            nproc=2,
            device=device,
        ),
    )
    cfg.finetune_sql.max_len = cfg.finetune_domain.max_len = 16  # a valid whole config
    return cfg


def test_pretrain_stage_runs_under_torchrun_and_resumes(tmp_path: Path) -> None:
    """`pretrain.nproc: 2`: the pretrain task launches torchrun (gloo), rank 0 writes the model
    with every expert (it loads at world size 1), the metrics reach log_fn, and a relaunch
    resumes from the checkpoint."""
    from tasks.training import load_model, pretrain_model
    from tests.test_train import _data

    data = _data(tmp_path / "data")
    cfg = torchrun_config("cpu")  # gloo on CPU, GPU host or not
    rows: list[dict] = []
    out = tmp_path / "model"
    result = pretrain_model.fn(cfg, data, out, rows.append)
    assert result.steps == 4 and result.val_loss is not None
    assert (result.backend, result.world) == ("gloo", 2)  # the CPU process group
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    model = load_model(out)  # world size 1
    assert model.moe_layers[0].experts.w13_EDG.shape[0] == 4
    # A relaunch with the same params (what a Prefect retry does after a lost worker)
    # resumes from the newest checkpoint the first launch left and trains the rest. Here the
    # machine died after step 2's checkpoint: step 4's is gone. The relaunch trains steps 3
    # and 4 at world size 2 and ends with the same weights as the uninterrupted launch.
    import shutil

    first = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").unlink()
    shutil.rmtree(out / "checkpoints" / "step_00000004")
    again = pretrain_model.fn(cfg, data, out, rows.append)
    assert again.resumed_from == 2 and again.steps == 4
    got, want = load_file(str(out / "model.safetensors")), load_file_bytes(first)
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
