"""Data + expert parallel training on real process groups: torchrun, gloo, 2 CPU processes
(tests/dist_worker.py), checked against the same computation at world size 1 in this process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_file_bytes
from safetensors.torch import load_file

from moe.checkpoint.store import CheckpointStore
from moe.model.config import ModelConfig, MoEConfig
from moe.train.config import PretrainConfig
from tasks.config import Config
from tests import dist_worker as W
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def _torchrun(
    mode: str, out: Path, *args: object, nproc: int = 2, timeout: float = 180
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
            *map(str, args),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )


STEPS = 6  # checkpoints at 2, 4, 6


def _train2(out: Path, store: str, stop: int = 0, ep: int = 0) -> dict:
    """The worker's Trainer at world size 2 under torchrun; its result."""
    proc = _torchrun("train", out, store, STEPS, stop, ep)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / f"{store}.json").read_text())


def _train1(out: Path, store: str, stop: int = 0) -> dict:
    """The same Trainer at world size 1, in this process (no process group)."""
    W.train(out, store, STEPS, stop, 0)
    return json.loads((out / f"{store}.json").read_text())


def _weights(out: Path, store: str) -> dict[str, torch.Tensor]:
    return load_file(str(out / f"{store}.safetensors"))


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    assert [k for k, v in want.items() if not torch.equal(got[k], v)] == []


def _from(out: Path, src: str, dest: str, step: int) -> None:
    """A copy of store `src` as a machine that died after step `step`'s checkpoint left it."""
    shutil.copytree(out / src, out / dest)
    for d in (out / dest).glob("step_*"):
        if int(d.name[5:]) > step:
            shutil.rmtree(d)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Uninterrupted runs: world size 1, and world size 2 with the experts over both ranks."""
    out = tmp_path_factory.mktemp("dist")
    _train1(out, "w1")
    _train2(out, "w2")
    return out


def test_world_2_trains_like_world_1_holding_half_of_the_state(runs: Path) -> None:
    """6 steps of the real Trainer (FSDP2 dense, experts over 2 ranks; lr 1e-2, aux-free
    bias, gate recalibration) end where world size 1 ends; each rank holds half of the
    parameters and of the AdamW moments, and no rank ever gathered the optimizer state."""
    one, two = (json.loads((runs / f"{s}.json").read_text()) for s in ("w1", "w2"))
    assert (two["backend"], two["world"]) == ("gloo", 2)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    _close(_weights(runs, "w2"), _weights(runs, "w1"))
    whole = json.loads((runs / "w1.rank0.json").read_text())
    for rank in (0, 1):
        held = json.loads((runs / f"w2.rank{rank}.json").read_text())
        assert held["params"] == whole["params"] // 2
        assert held["moments"] == whole["moments"] // 2
    # The checkpoint is sharded: each rank wrote its own files, and one process can read it
    # whole (what evaluation and the CLI do) equal to the gathered final weights.
    store = CheckpointStore(runs / "w2")
    last = store.latest_valid()
    assert {p.name for p in last.iterdir()} >= {"r000.L0.bin", "r001.L0.bin", "r001.L1.bin"}
    ck = store.load(last)
    assert ck.sharded and ck.step == STEPS
    assert store.info()[0].ranks == 2  # what `moe-pipeline checkpoint ls` prints
    _equal(ck.model, _weights(runs, "w2"))


def test_experts_sharded_with_the_dense_blocks_train_the_same(runs: Path, tmp_path: Path) -> None:
    """expert_parallel 1: no token exchange, the experts are FSDP-sharded like the rest."""
    _train2(tmp_path, "e1", ep=1)
    _close(_weights(tmp_path, "e1"), _weights(runs, "w1"))


def test_activation_checkpointing_under_fsdp_trains_the_same(runs: Path, tmp_path: Path) -> None:
    """Each block recomputed in the backward, inside its FSDP unit, experts over both ranks."""
    proc = _torchrun("train", tmp_path, "ac", STEPS, 0, 0, "cpu", "ac")  # flags: ac
    assert proc.returncode == 0, proc.stderr[-4000:]
    _close(_weights(tmp_path, "ac"), _weights(runs, "w1"))


def test_bf16_under_fsdp_records_the_routing_and_trains(runs: Path, tmp_path: Path) -> None:
    """dtype bfloat16: FSDP gathers bf16 (MixedPrecisionPolicy, the CUDA default) and the
    routers their own fp32 unit. Each block still records its routing into the trainer's
    collector (FSDP's cast of a block's arguments would have copied it: no counts)."""
    proc = _torchrun("train", tmp_path, "bf", STEPS, 0, 0, "cpu", "bf16")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads((tmp_path / "bf.json").read_text())
    want = json.loads((runs / "w1.json").read_text())
    assert len(got["expert_share"]) == 2  # both MoE layers
    assert all(sum(row) == pytest.approx(1.0, abs=1e-3) for row in got["expert_share"])
    assert got["loss"] == pytest.approx(want["loss"], rel=0.02)  # bf16 against fp32


def test_lora_under_fsdp_and_expert_parallelism_trains_like_one_process(tmp_path: Path) -> None:
    """LoRA adapters (attention, dense MLP, the routed experts' 3-D adapters sharded with
    their experts), base frozen, aux-free bias moving (router: bias-only): world 2 ends where
    world 1 ends, the base untouched; the sharded checkpoint holds the adapters only."""
    W.train(tmp_path, "l1", STEPS, 0, 0, "cpu", ("lora",))
    proc = _torchrun("train", tmp_path, "l2", STEPS, 0, 0, "cpu", "lora")
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _weights(tmp_path, "l1"), _weights(tmp_path, "l2")
    _close(two, one)
    base = W.build()
    for name, t in base.state_dict().items():
        if name in two and ".router." not in name:  # frozen: exactly as built
            assert torch.equal(two[name], t), name
    assert not torch.equal(two["blocks.0.ffn.router.expert_bias_E"], torch.zeros(4))
    ck = CheckpointStore(tmp_path / "l2").load(CheckpointStore(tmp_path / "l2").latest_valid())
    assert ck.sharded and ck.state["adapter"] == {"base_sha256": "random-base"}
    # what trains (adapters) and the routing state (buffers), no base weight
    assert all(".lora" in k or ".router." in k and k.endswith("_E") for k in ck.model)
    assert any(".experts.lora." in k for k in ck.model) and any(".lora_A" in k for k in ck.model)


def test_deepseek_v3s_shape_trains_at_world_2_like_world_1(tmp_path: Path) -> None:
    """Latent attention (FSDP-sharded), sigmoid routing limited to 1 of 2 expert groups with
    a routed scale and the aux-free bias (experts over both ranks), a shared expert: world 2
    ends where world 1 ends, and the bias the two trained is the same and has moved."""
    steps = 5  # odd: a bias of +-u steps cannot be back at 0
    W.train(tmp_path, "d1", steps, 0, 0, "cpu", ("deepseek",))
    proc = _torchrun("train", tmp_path, "d2", steps, 0, 0, "cpu", "deepseek")
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _weights(tmp_path, "d1"), _weights(tmp_path, "d2")
    assert "blocks.0.attn.kv_b.weight" in one
    _close(two, one)
    biases = [two[f"blocks.{i}.ffn.router.expert_bias_E"] for i in (0, 1)]
    assert any(float(b.abs().max()) > 0 for b in biases), biases


def test_gpt_osss_shape_trains_at_world_2_like_world_1(tmp_path: Path) -> None:
    """Sinks, a sliding window, every bias and YaRN (FSDP-sharded), the experts' biases and
    clamped SwiGLU over both ranks (expert parallelism carries them): world 2 ends where
    world 1 ends, the experts' biases trained."""
    W.train(tmp_path, "g1", STEPS, 0, 0, "cpu", ("gptoss",))
    proc = _torchrun("train", tmp_path, "g2", STEPS, 0, 0, "cpu", "gptoss")
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = _weights(tmp_path, "g1"), _weights(tmp_path, "g2")
    assert "blocks.0.attn.sinks" in one and "blocks.1.ffn.experts.b13_EG" in one
    _close(two, one)
    assert float(two["blocks.1.ffn.experts.b2_ED"].abs().max()) > 0


def test_a_killed_world_2_run_resumes_bit_exactly(runs: Path, tmp_path: Path) -> None:
    shutil.copy(runs / "w2.safetensors", tmp_path)
    first = _train2(tmp_path, "r2", stop=3)  # killed after step 3: step 2's checkpoint
    assert first["steps"] == 3
    again = _train2(tmp_path, "r2")
    assert again["resumed_from"] == 2 and again["steps"] == STEPS
    _equal(_weights(tmp_path, "r2"), _weights(runs, "w2"))


def test_checkpoints_restore_across_world_sizes_and_expert_degrees(
    runs: Path, tmp_path: Path
) -> None:
    """Step 2's checkpoint, continued elsewhere, ends where world size 1 ends: written at
    world 2 restored at 1 (assembled whole), written at 1 restored at 2 (each rank keeps
    its part), written with the experts over 2 ranks restored with them sharded with the
    dense blocks (DCP reshards)."""
    for src in ("w1", "w2"):
        shutil.copytree(runs / src, tmp_path / src)
    _from(tmp_path, "w2", "2to1", 2)
    assert _train1(tmp_path, "2to1")["resumed_from"] == 2
    _from(tmp_path, "w1", "1to2", 2)
    assert _train2(tmp_path, "1to2")["resumed_from"] == 2
    _from(tmp_path, "w2", "ep2to1", 2)
    assert _train2(tmp_path, "ep2to1", ep=1)["resumed_from"] == 2
    for store in ("2to1", "1to2", "ep2to1"):
        _close(_weights(tmp_path, store), _weights(runs, "w1"))


def test_a_damaged_shard_falls_back_to_the_previous_checkpoint(runs: Path, tmp_path: Path) -> None:
    _from(runs, "w2", "dmg", 4)
    shutil.move(runs / "dmg", tmp_path / "dmg")
    shard = tmp_path / "dmg" / "step_00000004" / "r001.L0.bin"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    proc = _torchrun("train", tmp_path, "dmg", STEPS, 0, 0)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "r001.L0.bin does not match its sha256" in proc.stderr
    assert json.loads((tmp_path / "dmg.json").read_text())["resumed_from"] == 2
    _equal(_weights(tmp_path, "dmg"), _weights(runs, "w2"))


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One launch at world size 4 with the experts over 2 ranks, so every expert has two
    data-parallel copies (the only layout where the gradient divisor, the expert gradients'
    sum over copies and the clipping norm's count of replicated shards each matter): the
    aux-loss balancing (coefficient 0.1), a clip that binds every step, a store whose
    every layer has cold experts; then, in the same processes, the jitter resume check
    (tests/dist_worker.py rng_resume). And world size 1 on the same global batches here."""
    out = tmp_path_factory.mktemp("dist4")
    W.train(out, "a1", STEPS, 0, 0, "cpu", ("aux", "clip"))
    flags = "aux,clip,cold,rng"
    proc = _torchrun("train", out, "a4", STEPS, 0, 2, "cpu", flags, nproc=4, timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_the_aux_loss_balances_the_global_batch_at_world_4(world4: Path) -> None:
    """Each rank routes a quarter of the batch; the aux loss's routed fraction f_E is the
    whole batch's (counts all-reduced), so its gradient is world size 1's: the routers, the
    routed shares and the loss end where one process ends."""
    one, four = (json.loads((world4 / f"{s}.json").read_text()) for s in ("a1", "a4"))
    assert (four["backend"], four["world"]) == ("gloo", 4)
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert four["expert_share"] == one["expert_share"]  # the same routing, token for token
    got, want = _weights(world4, "a4"), _weights(world4, "a1")
    routers = [k for k in want if ".router.gate." in k]
    assert len(routers) == 2
    _close({k: got[k] for k in routers}, {k: want[k] for k in routers})


def test_expert_gradients_sum_over_the_data_parallel_copies(world4: Path) -> None:
    """World 4, experts over 2 ranks: an expert's gradient holds its EP group's tokens,
    summed over the other group and divided by 4. Every parameter ends where world size 1
    ends, and both copies of each expert stay identical."""
    _close(_weights(world4, "a4"), _weights(world4, "a1"))
    sha = [json.loads((world4 / f"a4.rank{r}.json").read_text())["experts_sha"] for r in range(4)]
    # ranks (0, 2) hold experts 0-1, ranks (1, 3) experts 2-3 (mesh ("dp_mod_ep", "ep") 2x2)
    assert sha[0] == sha[2] and sha[1] == sha[3] and sha[0] != sha[1]


def test_gradient_clipping_at_world_4_clips_what_world_1_clips(world4: Path) -> None:
    """grad_clip 0.05 binds at every step: the norm (each replicated expert shard counted
    once) is world size 1's at every step, so is the scale, and so are the weights."""
    one, four = (json.loads((world4 / f"{s}.json").read_text()) for s in ("a1", "a4"))
    assert len(four["grad_norms"]) == STEPS and min(one["grad_norms"]) > 4 * W.CLIP
    assert four["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    _close(_weights(world4, "a4"), _weights(world4, "a1"))


def test_every_ranks_rng_carries_across_a_resume(world4: Path) -> None:
    """Router jitter drawn from each rank's own RNG (seeded per rank): killed after step 3,
    resumed from step 2's sharded checkpoint, every rank ends with the uninterrupted run's
    weights and RNG state, bit for bit. The ranks' states differ, so restoring one rank's
    state everywhere would not do."""
    ranks = [json.loads((world4 / f"rng.rank{r}.json").read_text()) for r in range(4)]
    for rank, got in enumerate(ranks):
        assert (got["resumed_from"], got["steps"]) == (2, STEPS), rank
        assert got["differ"] == [] and got["rng_equal"], (rank, got)
    assert len({got["rng_sha"] for got in ranks}) == 4


def test_cold_experts_of_a_sharded_checkpoint_land_in_the_cold_tier(world4: Path) -> None:
    """Written at world 4 with the experts over 2 ranks (cold below the layer's mean load,
    cold codec lzma): each cold expert's rows, weights and AdamW moments, are records of
    the L2 file of the rank that wrote them, in the cold codec; hot experts' in L1; and the
    checkpoint reads back whole equal to the final weights."""
    from moe.checkpoint.manifest import Manifest

    store = CheckpointStore(world4 / "a4")
    last = store.latest_valid()
    m = Manifest.read(last)
    assert m.sharded and m.step == STEPS
    assert set(m.experts) == {"blocks.0.ffn", "blocks.1.ffn"}
    for layer, tiers in m.experts.items():
        assert tiers["cold"] and tiers["hot"], (layer, tiers)
    experts = [t for t in m.tensors if t.expert is not None]
    kinds = {(t.group, t.name.rsplit(".", 1)[-1]) for t in experts}
    assert kinds == {
        ("model", "w13_EDG"),
        ("model", "w2_EFD"),
        ("optimizer", "exp_avg"),
        ("optimizer", "exp_avg_sq"),
    }
    for t in experts:
        layer = t.name.split(".experts.")[0]
        tier = "L2" if t.expert in m.experts[layer]["cold"] else "L1"
        assert (t.tier, t.file[5:], t.codec) == (
            tier,
            f"{tier}.bin",
            "bg-lzma" if tier == "L2" else "bg-zstd",
        ), t
    cold_files = {t.file for t in experts if t.tier == "L2"}
    assert cold_files and all((last / f).is_file() and f in m.files for f in cold_files)
    assert all(t.tier == "L0" for t in m.tensors if t.expert is None)
    _equal(store.load(last).model, _weights(world4, "a4"))


def test_ranks_agree_on_time_and_a_stop_at_metrics_rows_only(tmp_path: Path) -> None:
    """At world 2 no step but a metrics row (every 4 steps here), a save and the end makes
    the ranks meet on the host: a stop asked of rank 1 alone from step 2 stops both at step
    4, the next row, saved there, and both ranks hold the same training time."""
    proc = _torchrun("notice", tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = [json.loads((tmp_path / f"notice.rank{r}.json").read_text()) for r in (0, 1)]
    for g in got:
        assert (g["steps"], g["stop"]) == (4, "interrupted")
        # step 4's row: the time, then the stop; the save at the stop; the end
        assert g["agreed_at"] == [4, 4, 4, 4]
    assert got[0]["elapsed_s"] == got[1]["elapsed_s"] > 0
    assert CheckpointStore(tmp_path / "notice").latest_valid().name == "step_00000004"


def test_a_dead_rank_fails_the_run_fast(tmp_path: Path) -> None:
    # Rank 1 vanishes mid-step (os._exit(3)). torchrun notices, stops rank 0 and fails the
    # launch; subprocess.run's timeout (120 s) fails this test (TimeoutExpired) if the launch
    # hung instead. The failure must be that death, not any other crash.
    import re

    proc = _torchrun("die", tmp_path, timeout=120)
    assert proc.returncode != 0
    # torchrun's failure summary lists every rank that failed: rank 1 with its own code.
    assert re.search(r"local_rank: 1\)\s*\n\s*exitcode\s*: 3 ", proc.stderr), proc.stderr[-2000:]


def test_expert_count_and_degree_must_divide() -> None:
    from moe.train.distributed import expert_degree

    with pytest.raises(ValueError, match="num_experts=6 does not divide over 4 processes"):
        expert_degree(0, 4, 6)
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the 4 processes"):
        expert_degree(3, 4, 6)
    assert expert_degree(2, 4, 6) == 2


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
    from moe.hf.model_dir import load_model_dir
    from tasks.pretraining import pretrain_model
    from tests.test_train import _data

    data = _data(tmp_path / "data")
    cfg = torchrun_config("cpu")  # gloo on CPU, GPU host or not
    rows: list[dict] = []
    out = tmp_path / "model"
    result = pretrain_model.fn(cfg, data, out, rows.append)
    assert result.steps == 4 and result.val_loss is not None
    assert (result.backend, result.world) == ("gloo", 2)  # the CPU process group
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    model = load_model_dir(out, torch.float32)  # world size 1
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


def test_continued_pretraining_of_a_hugging_face_model_runs_sharded(tmp_path: Path) -> None:
    """model.init names transformers' own Qwen3-MoE folder and pretrain.nproc is 2: the first
    process streams the import once, each rank reads its part of it into the model built on
    the meta device, and training ends where one process (loading the model whole) ends."""
    from tokenizers import Tokenizer, models

    from moe.hf.model_init import init_architecture
    from tasks.pretraining import pretrain_model
    from tests.test_hf import hf_model
    from tests.test_train import _data

    hf_model("qwen3_moe", tmp_path / "hf")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))  # model.init requires one
    data = _data(tmp_path / "data")
    results = {}
    for nproc in (1, 2):
        cfg = torchrun_config("cpu")
        cfg.pretrain.nproc = nproc
        cfg.model.init = str(tmp_path / "hf")
        # Qwen3-MoE has no selection bias: aux_free becomes the aux loss (init_architecture).
        # Its routed fraction is the global batch's, so the ranks train as one process does.
        cfg.model, cfg.moe = init_architecture(cfg.model, cfg.moe)
        assert "aux_loss" in cfg.moe.balancing
        results[nproc] = pretrain_model.fn(cfg, data, tmp_path / f"n{nproc}", lambda r: None)
    assert (results[1].world, results[2].world, results[2].backend) == (1, 2, "gloo")
    assert results[2].train_loss == pytest.approx(results[1].train_loss, rel=1e-4)
    _close(
        load_file(str(tmp_path / "n2" / "model.safetensors")),
        load_file(str(tmp_path / "n1" / "model.safetensors")),
    )
    assert not (tmp_path / "n2" / ".init").exists()  # the streamed import is cleaned up


def test_a_broken_hugging_face_init_fails_every_rank_at_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.init names a Hugging Face folder whose q_proj contradicts config.json, and the
    stage runs on 2 processes through the launcher (tasks/launch.py `torchrun`,
    tasks.dist_entry): the first process's import refuses the tensor by name with one
    `error:` line, the other rank learns of it at once and fails too (instead of waiting for
    a file that never comes, which the subprocess timeout would catch), and the launcher
    raises the same InputError: the stage is refused, not retried as a crash."""
    import re

    from tokenizers import Tokenizer, models

    from moe.errors import InputError
    from moe.hf.model_init import init_architecture
    from tasks.launch import torchrun
    from tests.test_hf import K_Q, _rewrite, hf_model
    from tests.test_train import _data

    hf_model("qwen3_moe", tmp_path / "hf")
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1}, unk_token="<unk>"))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    _rewrite(tmp_path / "hf", lambda t: t.update({K_Q: t[K_Q][:-16]}))  # one head short
    cfg = torchrun_config("cpu")
    cfg.model.init = str(tmp_path / "hf")
    cfg.model, cfg.moe = init_architecture(cfg.model, cfg.moe)
    out = tmp_path / "model"
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with pytest.raises(InputError, match=rf"{re.escape(K_Q)}.*shape"):
        torchrun(cfg, "pretrain", _data(tmp_path / "data"), out, lambda row: None)
    err = capfd.readouterr().err
    # The first process: one line, the refusal the import gives, naming the tensor.
    assert re.search(rf"(?m)^error: .*{re.escape(K_Q)}.*shape", err), err[-3000:]
    # The other rank: its own failure, at once, pointing at the first process's log.
    assert "the import failed on another machine's first process" in err, err[-3000:]
    # Nothing half-written: no model, no part of the streamed import.
    assert not (out / "model.safetensors").exists() and not (out / ".init").exists()


SIGTERM_RANKS = """
import pickle, sys
from pathlib import Path
from prefect import flow
from tasks.pretraining import pretrain_model

cfg, data, out = pickle.loads(Path(sys.argv[1]).read_bytes())
flow(name="stage")(lambda: pretrain_model(cfg, data, out, lambda row: None))()
print("the flow returned", flush=True)
"""


def test_a_sigterm_reaches_the_ranks_which_save_their_step_and_end(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """The pipeline's process gets a SIGTERM (a spot reclaim, an eviction) while its stage
    trains on 2 processes under torchrun: the launcher passes it to torchrun, which passes
    it to the ranks; they agree on the step, save it together and end. Nothing is left
    running (before, torchrun was SIGKILLed and the ranks trained on, orphaned), and the
    newest checkpoint is the step they stopped at, not the last regular one (there is none:
    one is due every 10,000 steps). The signal is sent once rank 0 has logged step 2."""
    import pickle
    import signal
    import time

    import psutil

    from tests.conftest import cli_env
    from tests.test_train import _data

    cfg = torchrun_config("cpu")
    cfg.pretrain.max_steps = cfg.pretrain.checkpoint_every = 10_000
    cfg.pretrain.eval_every = 10_000
    out = tmp_path / "model"
    args = tmp_path / "args.pickle"
    args.write_bytes(pickle.dumps((cfg, _data(tmp_path / "data"), out)))
    log = tmp_path / "stage.log"
    env = {**cli_env(prefect_server), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SIGTERM_RANKS, str(args)],
            cwd=ROOT,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    tree: list[psutil.Process] = []
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 300  # a bound on the wait, not the verdict
        while not (
            metrics.is_file()
            and any(json.loads(x).get("step", 0) >= 2 for x in metrics.read_text().split("\n")[:-1])
        ):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        tree = psutil.Process(proc.pid).children(recursive=True)
        ranks = [p for p in tree if "torch.distributed.run" not in p.cmdline()]
        assert len(ranks) == 2, [p.cmdline() for p in tree]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=240) == -signal.SIGTERM, log.read_text()[-3000:]
        left = [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:  # on a failure too: nothing of this test trains on
        if proc.poll() is None:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            if p.is_running():
                p.kill()
        proc.wait(timeout=60)
    said = log.read_text()
    assert "the flow returned" not in said
    assert not left, "processes left running after the stage ended"
    stopped = [x for x in said.splitlines() if "stopping at step" in x and "interrupted" in x]
    assert stopped, said[-3000:]
    step = int(stopped[0].split("stopping at step ")[1].split(":")[0])
    assert step >= 2
    newest = CheckpointStore(out / "checkpoints").latest_valid()
    assert newest is not None and newest.name == f"step_{step:08d}", said[-3000:]
    assert not (out / "model.safetensors").exists()  # an unfinished stage writes no model


def test_every_sharded_router_is_gathered_again_before_its_backward(tmp_path: Path) -> None:
    """Under bf16 each router is an FSDP2 unit of its own (fp32 weights, gathered unrounded).
    FSDP2 gathers a unit's weights again for its backward from a hook on the unit's outputs,
    and torch 2.11 (the rented-GPU image) finds those outputs with pytree's tree_flatten:
    a router's output (a dataclass) hid its tensors, no hook ran, and on CUDA the backward
    read a freed weight. Here FSDP2 runs with 2.11's rule on one CPU process: every router
    unit must run its pre-backward (a CPU's all-gather is synchronous, so only the hook's
    absence is seen, not the crash)."""
    import torch.distributed as dist
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    from torch.utils._pytree import tree_flatten

    from moe.train import distributed as D

    def hook_rule_of_torch_2_11(self, output):  # FSDPState._register_pre_backward_hook
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if torch.is_tensor(t) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    seen: list[str] = []
    pre_backward = FSDPParamGroup.pre_backward

    def recording(self, *args, **kwargs):
        seen.append(self._module_fqn)
        return pre_backward(self, *args, **kwargs)

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(FSDPState, "_register_pre_backward_hook", hook_rule_of_torch_2_11)
        mp.setattr(FSDPParamGroup, "pre_backward", recording)
        model = W.build()
        D.parallelize(model, D.make_meshes(torch.device("cpu"), 1), param_dtype=torch.bfloat16)
        x, y, _ = W.Batches().batch_at(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss, aux = model(x, y, None, logits=False)
        (loss + aux.balance_loss).backward()
    finally:
        mp.undo()
        dist.destroy_process_group()
    routers = {f"blocks.{i}.ffn.router" for i in range(len(model.blocks))}
    assert routers <= set(seen), f"no pre-backward for {sorted(routers - set(seen))}"
