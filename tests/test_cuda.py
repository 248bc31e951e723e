"""The CUDA paths: training in bf16 on a GPU, resume there, the model equal to its CPU self,
and data + expert parallel training over NCCL. They skip, saying why, where no GPU is present
(this project's CI machine has none); on a GPU host they run with the rest of the suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import model_tensors
from tests.test_train import _data, _trainer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@cuda
def test_bf16_training_on_cuda_learns_checkpoints_and_resumes(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "c", 30, lr=1e-2, device="cuda", dtype="auto")
    assert (
        t.ranks.device.type == "cuda" and t.ranks.amp_dtype == torch.bfloat16
    )  # auto: bf16 on CUDA
    before = t.evaluate()
    result = t.fit()
    assert result.val_loss < before - 0.5
    # The checkpoint holds fp32 master weights and loads on a CPU-only machine.
    ck = CheckpointStore(tmp_path / "c").load(CheckpointStore(tmp_path / "c").latest_valid())
    assert ck.step == 30
    assert all(v.device.type == "cpu" for v in ck.model.values())
    assert ck.model["embed.weight"].dtype == torch.float32
    # Killed after 10 steps and resumed on the GPU: same step count, close weights (CUDA
    # kernels with atomics are not bit-reproducible, so close, not equal).
    first = _trainer(data, tmp_path / "k", 30, stop_after=10, lr=1e-2, device="cuda")
    first.fit()
    resumed = _trainer(data, tmp_path / "k", 30, lr=1e-2, device="cuda")
    r = resumed.fit()
    assert r.resumed_from == 9 and r.steps == 30
    for k, v in model_tensors(t.model).items():
        torch.testing.assert_close(
            model_tensors(resumed.model)[k].cpu(), v.cpu(), rtol=0.05, atol=0.02
        )


@cuda
def test_the_model_on_cuda_equals_itself_on_cpu() -> None:
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        64,
    )
    x = torch.randint(0, 64, (4, 16))
    cpu_logits, cpu_loss, _ = model(x, x)
    gpu_logits, gpu_loss, _ = model.cuda()(x.cuda(), x.cuda())
    torch.testing.assert_close(gpu_logits.cpu(), cpu_logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(gpu_loss.cpu(), cpu_loss, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL data + expert parallel needs two GPUs"
)
def test_pretrain_under_torchrun_on_two_gpus_uses_nccl(tmp_path: Path) -> None:
    from moe.hf.model_dir import load_model_dir
    from tasks.pretraining import pretrain_model
    from tests.test_distributed import torchrun_config

    data = _data(tmp_path / "data")
    cfg = torchrun_config("cuda")
    rows: list[dict] = []
    result = pretrain_model.fn(cfg, data, tmp_path / "model", rows.append)
    assert result.steps == 4 and json.dumps(rows)
    assert (result.backend, result.world) == ("nccl", 2)  # not a silent gloo fallback
    assert (
        load_model_dir(tmp_path / "model", torch.float32).moe_layers[0].experts.w13_EDG.shape[0]
        == 4
    )


@cuda
def test_fsdp2_on_one_gpu_trains_and_saves_sharded(tmp_path: Path) -> None:
    """Under torchrun, even with one process, the model is sharded (FSDP2 on a one-GPU mesh,
    bf16 compute with fp32 reduction) and checkpointed through DCP; NCCL ran, not gloo."""
    from tests.test_distributed import _torchrun

    proc = _torchrun("train", tmp_path, "g1", 6, 0, 0, "cuda", nproc=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "g1.json").read_text())
    assert (result["backend"], result["world"], result["sharded"]) == ("nccl", 1, True)
    assert result["steps"] == 6 and result["loss"] == result["loss"]  # trained, finite
    store = CheckpointStore(tmp_path / "g1")
    ck = store.load(store.latest_valid())
    assert ck.sharded and ck.step == 6


@cuda
def test_a_packed_batch_reaches_the_gpu_through_pinned_memory_and_trains() -> None:
    """Packed rows are copied to the GPU from pinned memory without waiting (ranks.py
    `copy_to_device`), arriving equal; the packed loss on the GPU under bf16 equals the CPU's
    fp32 one within bf16's rounding."""
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer
    from moe.train.config import FinetuneConfig
    from moe.train.ranks import Ranks
    from tests.test_packing import _sft

    batch = _sft().batch_at(0)
    ranks = Ranks(FinetuneConfig(device="cuda", max_len=48))
    x, y, w, rows, n_tok, seg = ranks.to_device(batch)
    torch.cuda.synchronize()
    for got, want in zip((x, y, w, seg), batch, strict=True):
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=48, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        97,
    )
    model.set_routing_step(10**6, 0.5)
    _, cpu_loss, _ = model(*batch[:3], logits=False, segments_BS=batch[3])
    model.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss, _ = model(x, y, w, logits=False, loss_rows=rows, segments_BS=seg)
    assert abs(float(loss) - float(cpu_loss)) < 0.05 * float(cpu_loss)


@cuda
def test_a_copy_to_the_gpu_does_not_wait_for_the_work_queued_before_it() -> None:
    """`copy_to_device` of a contiguous host tensor and of a strided view (a sampler's
    x = t[:, :-1], whose pinned copy would keep its strides and go through an unpinned
    temporary) returns while the GPU is still busy with a queued sleep: it did not wait."""
    from moe.train.config import FinetuneConfig
    from moe.train.ranks import Ranks

    ranks = Ranks(FinetuneConfig(device="cuda", max_len=48))
    t = torch.arange(4 * 65).view(4, 65)
    for host in (t, t[:, :-1]):
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of the GPU's cycles, queued
        got = ranks.copy_to_device(host)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert busy, f"the copy of the {tuple(host.shape)} tensor waited for the GPU"
        assert torch.equal(got.cpu(), host)
