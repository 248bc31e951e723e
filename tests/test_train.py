"""Contract of moe/train/trainer.py: training learns, and a run killed at any step and resumed ends
with weights bit-identical to an uninterrupted run (CPU); a checkpoint from other params is
not resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import model_tensors, weights_digest
from moe.data.tokens import BatchSampler, TokenStore, token_dtype, write_token_store
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer
from moe.train.config import PretrainConfig
from moe.train.optim import lr_at
from moe.train.stop import Budget
from moe.train.trainer import Trainer
from moe.train.validation import Validation

VOCAB = 64


def _data(tmp_path: Path) -> Path:
    tmp_path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    # A learnable corpus: a repeating pattern with a little noise.
    docs = [
        [(i * 7 + j) % 50 + 1 if torch.rand(1, generator=g) > 0.1 else 3 for j in range(400)]
        for i in range(12)
    ]
    counts = write_token_store(
        iter(map(str, range(12))),
        lambda b: [docs[int(x)] for x in b],
        0,
        VOCAB,
        tmp_path,
        {"val": 0.2},
        1,
    )
    (tmp_path / "meta.json").write_text(
        json.dumps({"dtype": str(token_dtype(VOCAB)), "vocab_size": VOCAB, "splits": counts})
    )
    return tmp_path


def _trainer(
    data: Path,
    ckpt: Path,
    max_steps: int,
    stop_after: int | None = None,
    lr: float = 3e-3,
    device: str = "cpu",
    dtype: str = "auto",
    activation_checkpoint: bool = False,
    compile: bool = False,
) -> Trainer:
    torch.manual_seed(0)
    cfg = PretrainConfig(
        activation_checkpoint=activation_checkpoint,
        compile=compile,
        max_steps=max_steps,
        batch_size=4,
        grad_accum=2,
        lr=lr,
        min_lr=lr / 10,
        warmup_steps=2,
        checkpoint_every=3,
        log_every=2,
        device=device,  # CPU unless a test says otherwise (tests/test_cuda.py)
        dtype=dtype,
    )
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        VOCAB,
    )
    return Trainer(
        model,
        cfg,
        BatchSampler(TokenStore(data, "train"), 4, 16, seed=1),
        CheckpointStore(ckpt, max_retain=2),
        fingerprint=f"lr={lr}",
        schedule="cosine",
        min_lr=cfg.min_lr,
        router_lr_mult=3.0,
        validation=Validation(BatchSampler(TokenStore(data, "val"), 4, 16, seed=2), 5, 2),
        metrics_path=ckpt.parent / f"{ckpt.name}.jsonl",
        stop_after=stop_after,
    )


def test_resume_is_bit_identical(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    straight = _trainer(data, tmp_path / "a", 10)
    straight.fit()
    # Killed after 4 steps: the newest checkpoint is step 3, so step 4 is lost and redone.
    first = _trainer(data, tmp_path / "b", 10, stop_after=4)
    assert first.fit().stop_reason == "stop_after"
    resumed = _trainer(data, tmp_path / "b", 10)
    result = resumed.fit()
    assert result.resumed_from == 3 and result.steps == 10
    assert weights_digest(model_tensors(resumed.model)) == weights_digest(
        model_tensors(straight.model)
    )
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k]["exp_avg"], sb[k]["exp_avg"]) and torch.equal(
            sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"]
        )
    # the log has no duplicated steps after the resume
    steps = [
        json.loads(r)["step"]
        for r in (tmp_path / "b.jsonl").read_text().splitlines()
        if "loss" in json.loads(r)
    ]
    assert steps == sorted(set(steps))


KILL_CHILD = """
import sys, time
from pathlib import Path
from tests.test_train import _data, _trainer
tmp = Path(sys.argv[1])
t = _trainer(tmp / "data", tmp / "k", 10)
def log_fn(row):
    if "loss" in row:
        if row["step"] == 4:  # the machine dies here, once step 3's checkpoint is on disk
            while t.checkpointer.store.latest_valid() is None:  # (written on the writer thread)
                time.sleep(0.01)
        print(row["step"], flush=True)
        if row["step"] == 4:
            time.sleep(600)
t.metrics.log_fn = log_fn
t.fit()
"""


def test_resume_after_a_real_sigkill_is_bit_identical(tmp_path: Path) -> None:
    """A training process killed with SIGKILL (no handler, no flush, the writer thread dies
    with it) and started again ends with the weights and optimizer state of a run that was
    never interrupted."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import ROOT, read_line

    data = _data(tmp_path / "data")
    child = subprocess.Popen(
        [sys.executable, "-c", KILL_CHILD, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert [read_line(child, timeout=120) for _ in range(2)] == ["2", "4"]  # log_every 2
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        child.kill()
    resumed = _trainer(data, tmp_path / "k", 10)
    result = resumed.fit()
    assert result.resumed_from == 3 and result.steps == 10
    straight = _trainer(data, tmp_path / "s", 10)
    straight.fit()
    assert weights_digest(model_tensors(resumed.model)) == weights_digest(
        model_tensors(straight.model)
    )
    sa, sb = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for k in sa:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(sa[k][name]), torch.as_tensor(sb[k][name]))


def test_training_learns(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "c", 30, lr=1e-2)
    before = t.evaluate()
    result = t.fit()
    assert result.val_loss < before - 0.5
    rows = [json.loads(r) for r in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert all(len(r["expert_share"][0]) == 4 for r in rows if "expert_share" in r)


def test_activation_checkpointing_trains_the_same_and_counts_routing_once(tmp_path: Path) -> None:
    """Recomputing each block in the backward (grad_accum 2) ends with the weights, the losses
    and the routing statistics of keeping the activations: the recompute neither counts the
    routed tokens again nor drops the balancing loss's gradient."""
    data = _data(tmp_path / "data")
    results, weights = [], []
    for ac in (False, True):
        t = _trainer(data, tmp_path / f"c{ac}", 8, lr=1e-2, activation_checkpoint=ac)
        assert all(b.recompute == ac for b in t.model.blocks)
        results.append(t.fit())
        weights.append(model_tensors(t.model))
    off, on = results
    assert on.train_loss == pytest.approx(off.train_loss, rel=1e-6)
    assert on.expert_share == off.expert_share
    for k, v in weights[0].items():
        torch.testing.assert_close(weights[1][k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_a_recomputed_block_records_its_routing_once() -> None:
    """The recompute in the backward neither appends the layer's statistics again nor adds
    its routed tokens to the router's count a second time."""
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    seen = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(
            ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
            MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
            VOCAB,
        )
        for block in model.blocks:
            block.recompute = recompute
        for layer in model.moe_layers:
            layer.aux_grad_scale = 1.0
        _, loss, aux = model(idx, idx)
        loss.backward()
        assert len(aux.tokens_per_expert) == len(model.moe_layers)
        seen.append([layer.router.load_E.clone() for layer in model.moe_layers])
        assert all(float(load.sum()) == 2 * 16 * 2 for load in seen[-1])  # tokens x top_k
    assert all(torch.equal(a, b) for a, b in zip(*seen, strict=True))


def test_bf16_autocast_on_cpu_learns(tmp_path: Path) -> None:
    """`dtype: bfloat16` on CPU: the forward runs under bf16 autocast (the logits come out
    bf16), the master weights and optimizer stay fp32, and the model still learns."""
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "bf", 30, lr=1e-2, dtype="bfloat16")
    assert t.ranks.device.type == "cpu" and t.ranks.amp_dtype == torch.bfloat16
    x, _, _ = BatchSampler(TokenStore(data, "train"), 2, 16, seed=3).batch_at(0)
    with t.ranks.autocast():
        logits, _, _ = t.model(x)
    assert logits.dtype == torch.bfloat16
    before = t.evaluate()
    result = t.fit()
    assert result.val_loss < before - 0.5
    assert all(p.dtype == torch.float32 for p in t.model.parameters())


def test_bf16_on_a_cpu_without_bf16_instructions_is_warned(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`dtype: bfloat16` on a CPU that emulates bf16 (AVX2 alone) runs several times slower
    than float32: the stage says so, and still does what was asked. A CPU's instructions
    cannot be chosen from a test, so oneDNN's probe is replaced for each answer (the real
    probe runs too); `auto` on the CPU stays float32 and says nothing."""
    from moe.train import ranks

    assert isinstance(ranks.cpu_bf16_native(), bool)  # the real probe, on this CPU
    for native in (True, False):
        monkeypatch.setattr(ranks, "cpu_bf16_native", lambda n=native: n)
        caplog.clear()
        with caplog.at_level("WARNING", logger="moe.train.ranks"):
            assert ranks.autocast_dtype(torch.device("cpu"), "bfloat16") == torch.bfloat16
            assert ranks.autocast_dtype(torch.device("cpu"), "auto") is None
        assert ("without bf16 instructions" in caplog.text) == (not native), caplog.text


def test_a_non_finite_gradient_between_log_steps_leaves_weights_and_moments_as_before(
    tmp_path: Path,
) -> None:
    """A NaN gradient at step 2, between the metrics rows at steps 0 and 4: the update is
    skipped on the device (no host read), so the weights, both AdamW moments and its step
    count after step 2 are those before it; training goes on, and the row at step 4 raises
    naming step 2 and the number skipped."""
    t = _trainer(_data(tmp_path / "data"), tmp_path / "ck", 8)
    t.cfg.log_every = 4
    t.cfg.checkpoint_every = 100  # no save in between (a save reads the norm too)
    bad = 2
    first = next(p for p in t.model.parameters() if p.requires_grad)
    first.register_hook(lambda g: g * float("nan") if t.step == bad else g)

    def snapshot() -> dict[str, torch.Tensor]:
        out = {n: p.detach().clone() for n, p in t.model.named_parameters()}
        for i, state in enumerate(t.optimizer.state.values()):
            out |= {f"{i}.{k}": v.detach().clone() for k, v in state.items()}
        return out

    seen: dict[str, dict[str, torch.Tensor]] = {}
    step = t.optimizer.step

    def watched(*args, **kwargs):
        at = t.step
        if at in (bad, bad + 1):
            seen[f"before {at}"] = snapshot()
        out = step(*args, **kwargs)
        if at in (bad, bad + 1):
            seen[f"after {at}"] = snapshot()
        return out

    t.optimizer.step = watched
    with pytest.raises(FloatingPointError, match=r"at step 2 \(1 step\(s\) skipped"):
        t.fit()
    assert t.step == 4  # went on to the row, not stopped at the bad step
    before, after = seen["before 2"], seen["after 2"]
    assert before.keys() == after.keys() and any(".exp_avg_sq" in k for k in after)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    # the step after it updates as usual: finite, and moved
    later = seen["after 3"]
    assert all(bool(torch.isfinite(v).all()) for v in later.values())
    assert not all(torch.equal(after[k], later[k]) for k in after)


def test_checkpoints_from_other_params_are_not_resumed(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    _trainer(data, tmp_path / "d", 6).fit()
    other = _trainer(data, tmp_path / "d", 6, lr=1e-3)
    assert other.fit().resumed_from is None


def test_schedules() -> None:
    assert lr_at(0, 100, 1.0, 10, 0.1, "cosine") == 0.1
    assert lr_at(9, 100, 1.0, 10, 0.1, "cosine") == 1.0
    assert abs(lr_at(100, 100, 1.0, 10, 0.1, "cosine") - 0.1) < 1e-9
    assert abs(lr_at(55, 100, 1.0, 10, 0.0, "linear") - 0.5) < 1e-9


# ----------------------------------------------------------------- early stopping

from moe.train.config import EarlyStopConfig  # noqa: E402
from moe.train.early_stop import EarlyStopper  # noqa: E402


def test_patience_stops_on_a_plateau_and_scales_with_lr() -> None:
    stop = EarlyStopper(
        EarlyStopConfig(patience=4, min_delta=0.01, util_weight=0.0), initial_lr=1.0
    )
    assert stop.update(1, 3.0, 1.0, lr=1.0, cost_per_step=0, steps_left=100) is None
    for step in (2, 3, 4):
        assert (
            stop.update(step, 3.0, 1.0, lr=1.0, cost_per_step=0, steps_left=100) is None
        )  # 3 bad < patience 4
    reason = stop.update(5, 3.0, 1.0, lr=1.0, cost_per_step=0, steps_left=100)
    assert reason and reason.startswith("patience")
    # At half the initial lr the patience halves: two bad evaluations are enough.
    late = EarlyStopper(EarlyStopConfig(patience=4, util_weight=0.0), initial_lr=1.0)
    late.update(1, 3.0, 1.0, lr=0.5, cost_per_step=0, steps_left=100)
    assert late.update(2, 3.0, 1.0, lr=0.5, cost_per_step=0, steps_left=100) is None
    assert late.update(3, 3.0, 1.0, lr=0.5, cost_per_step=0, steps_left=100).startswith("patience")
    assert late.patience(1e-9) == 1  # floor: never zero


def test_composite_counts_expert_utilisation() -> None:
    stop = EarlyStopper(EarlyStopConfig(patience=1, util_weight=1.0), initial_lr=1.0)
    stop.update(1, 3.0, utilisation=1.0, lr=1.0, cost_per_step=0, steps_left=10)
    # Loss improved by 0.2 but half the experts starved: the composite got worse -> stop.
    assert stop.update(2, 2.8, utilisation=0.5, lr=1.0, cost_per_step=0, steps_left=10).startswith(
        "patience"
    )


def test_cost_aware_stop_when_remaining_cost_exceeds_expected_gain() -> None:
    cfg = EarlyStopConfig(patience=0, value_per_loss=10.0, trend_window=3)
    stop = EarlyStopper(cfg, initial_lr=1.0)
    # Improving 0.001 loss/step: 1000 steps left promise 1.0 loss = 10.0 of value.
    for step, loss in ((100, 3.2), (200, 3.1), (300, 3.0)):
        reason = stop.update(step, loss, 1.0, lr=1.0, cost_per_step=0.005, steps_left=1000)
    assert reason is None  # remaining cost 5.0 < value 10.0
    stop = EarlyStopper(cfg, initial_lr=1.0)
    for step, loss in ((100, 3.2), (200, 3.1), (300, 3.0)):
        reason = stop.update(step, loss, 1.0, lr=1.0, cost_per_step=0.02, steps_left=1000)
    assert reason and reason.startswith("cost")  # remaining cost 20.0 > value 10.0


def test_early_stop_in_training_is_recorded_and_checkpointed(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "e", 30, lr=1e-2)
    # A plateau threshold no real run meets: stop at the second evaluation.
    t.state.stopper = EarlyStopper(EarlyStopConfig(patience=1, min_delta=100.0), initial_lr=1e-2)
    result = t.fit()
    assert result.stop_reason.startswith("patience") and result.steps == 10
    assert CheckpointStore(tmp_path / "e").latest_valid().name == "step_00000010"
    rows = [json.loads(r) for r in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [r for r in rows if "early_stop" in r][-1]["early_stop"].startswith("patience")
    # The last row is the save that followed the stop, at the stop's step.
    assert rows[-1]["step"] == 10 and set(rows[-1]) == {"step", "checkpoint_stall_s"}


def test_a_multi_node_budget_stop_comes_when_the_machines_total_reaches_it(
    tmp_path: Path,
) -> None:
    """The stage's price is its pool's rate times its machines (tasks/training.py `stage_price`):
    on 2 machines at $1800/hour each, $0.5 is spent at step 8 (1/16 s a step), half the
    steps one machine would take."""
    from tasks.config import Config
    from tasks.training import stage_price

    data = _data(tmp_path / "data")
    stops = {}
    for nodes in (1, 2):
        cfg = Config()
        cfg.pools.definitions[cfg.pools.stages["pretrain"]].price_per_hour = 1800.0
        cfg.pools.definitions[cfg.pools.stages["pretrain"]].pricing = "on_demand"
        cfg.pretrain.nodes = nodes
        t = _trainer(data, tmp_path / f"n{nodes}", 30)
        ticks = iter(range(10**6))
        t.clock = lambda ticks=ticks: next(ticks) / 16
        t.stop.budget = Budget(price_per_hour=stage_price(cfg, "pretrain"), left=0.5, alert=0.3)
        result = t.fit()
        assert result.stop_reason.startswith("budget")
        stops[nodes] = result.steps
    assert stops == {1: 16, 2: 8}


def test_budget_warns_then_stops_with_a_checkpoint(tmp_path: Path) -> None:
    data = _data(tmp_path / "data")
    t = _trainer(data, tmp_path / "b", 30)
    # An injected clock: every reading is 1/16 s after the last, so each step costs exactly
    # 1/16 s of training time on any CPU. At $3600/hour that is $0.0625 a step; with $0.5 left
    # for this stage the alert (at 30%: $0.15) comes at step 3 and the stop at step 8.
    ticks = iter(range(10**6))
    t.clock = lambda: next(ticks) / 16
    t.stop.budget = Budget(price_per_hour=3600.0, left=0.5, alert=0.3)
    result = t.fit()
    assert result.stop_reason.startswith("budget") and result.steps == 8
    rows = [json.loads(r) for r in (tmp_path / "b.jsonl").read_text().splitlines()]
    alerts = [r for r in rows if "budget_alert" in r]
    stops = [r for r in rows if r.get("early_stop", "").startswith("budget")]
    assert [r["step"] for r in alerts] == [3] and [r["step"] for r in stops] == [8]
    assert CheckpointStore(tmp_path / "b").latest_valid().name == f"step_{result.steps:08d}"


def test_a_finished_trainer_is_freed_without_waiting_for_the_cycle_collector(
    tmp_path: Path,
) -> None:
    """`moe-pipeline run` runs every stage in one process: a stage's trainer (its model,
    optimizer state, batches) must go when the stage drops it, not at Python's next full
    collection. With the cyclic collector off, nothing but reference counts frees it."""
    import gc
    import weakref

    data = _data(tmp_path / "data")
    trainer = _trainer(data, tmp_path / "ckpt", 2)
    trainer.fit()
    gone = [weakref.ref(trainer), weakref.ref(trainer.model), weakref.ref(trainer.optimizer)]
    gc.collect()
    gc.disable()
    try:
        del trainer
        assert [r() is None for r in gone] == [True, True, True]
    finally:
        gc.enable()


@pytest.mark.slow
def test_compiled_blocks_train_as_the_eager_ones(tmp_path: Path) -> None:
    """`compile: true` compiles each block (regional compilation) and trains what eager
    training trains: the same losses and weights to float tolerance after 4 steps."""
    data = _data(tmp_path / "data")
    eager = _trainer(data, tmp_path / "a", 4)
    compiled = _trainer(data, tmp_path / "b", 4, compile=True)
    assert all(
        hasattr(b, "_compiled_call_impl") and b._compiled_call_impl for b in compiled.model.blocks
    )
    a, b = eager.fit(), compiled.fit()
    assert abs(a.train_loss - b.train_loss) < 1e-4, (a.train_loss, b.train_loss)
    for (n, p), q in zip(eager.model.named_parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-4, rtol=1e-3, msg=n)


def test_a_compiled_block_compiles_once_while_the_routing_schedules_move(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regional compile over 20 steps with the expert warm-up blending in (a new weight each
    step) and a capacity schedule whose factor moves each step: each compiled frame is traced
    once, in the first step, and never again (a recompile a step would hit dynamo's cache limit
    and fall back to eager). The blocks are compiled by a counting backend: what recompiles is
    decided by dynamo's guards, whatever the backend."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile", lambda self: compile_module(self, backend=counter)
    )
    torch._dynamo.reset()
    t = _trainer(_data(tmp_path / "data"), tmp_path / "ck", 20, compile=True)
    t.validation = None  # its no-grad forward is a second variant, once: not this test's
    for layer in t.model.moe_layers:
        r = layer.router
        r.methods = r.methods | {"warmup"}
        r.cfg.warmup_steps, r.cfg.warmup_blend_steps = 0, 50  # blending for all 20 steps
        r.cfg.capacity_factor, r.cfg.capacity_factor_end = 4.0, 3.0  # moves, drops nothing
        r.cfg.dropless = False
    frames: list[int] = []
    step = t._optimizer_step

    def counted(run, counts):
        out = step(run, counts)
        frames.append(counter.frame_count)
        return out

    t._optimizer_step = counted
    t.fit()
    for layer in t.model.moe_layers:  # the last step's: the schedules did move
        assert float(layer.router.blend_t) == pytest.approx(20 / 50)
        assert float(layer.router.capacity_factor_t) == pytest.approx(4.0 - 19 / 20)
    assert frames[0] > 0 and frames == [frames[0]] * 20, frames
    torch._dynamo.reset()
