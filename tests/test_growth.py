"""Expert growth and pruning (moe/model/growth.py): orthogonal new experts, output unchanged at the
moment of growth, optimizer steps after growth and pruning, checkpoints across a change in
expert count, and a trigger that fires on skewed load and not on balanced load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import (
    flatten_optimizer,
    load_model_tensors,
    model_tensors,
    unflatten_optimizer,
)
from moe.model.config import GrowthConfig, ModelConfig, MoEConfig
from moe.model.growth import (
    GrowthManager,
    LayerState,
    experts_per_layer,
    grow,
    grow_reason,
    prune,
    resize_model,
)
from moe.model.transformer import MoETransformer


def _model(E: int = 4) -> MoETransformer:
    torch.manual_seed(0)
    return MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
        MoEConfig(num_experts=E, top_k=2, expert_hidden=32, balancing=["aux_free", "z_loss"]),
        50,
    )


def _step(model: MoETransformer, opt: torch.optim.Optimizer, idx: torch.Tensor) -> float:
    _, loss, aux = model(idx, idx)
    (loss + aux.balance_loss).backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def test_new_expert_is_orthogonal_and_output_is_unchanged() -> None:
    model = _model()
    idx = torch.randint(0, 50, (3, 16))
    layer = model.moe_layers[0]
    model.eval()
    before = model(idx)[0]
    old_w13 = layer.experts.w13_EDG.detach().clone()
    state = LayerState.fresh(4)
    state.freq_E = torch.tensor([0.7, 0.1, 0.1, 0.1])
    event = grow(layer, state, None, step=10)
    assert event["experts_after"] == 5 and event["split_from"] == 0
    new = layer.experts.w13_EDG[4].flatten()
    for e in range(4):
        cos = torch.dot(new, old_w13[e].flatten()) / (new.norm() * old_w13[e].norm())
        assert abs(float(cos.detach())) < 1e-5
    assert float(new.norm().detach()) == __import__("pytest").approx(
        float(old_w13.flatten(1).norm(dim=1).mean()), rel=1e-4
    )
    after = model(idx)[0]
    assert torch.equal(before, after)  # zero combine weight at birth: exactly the same
    assert model.experts_per_layer() == [5, 4]


def test_optimizer_steps_after_growth_and_pruning() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 50, (4, 16))
    _step(model, opt, idx)
    layer = model.moe_layers[1]
    state = LayerState.fresh(4)
    exp_avg_before = opt.state[layer.experts.w13_EDG]["exp_avg"].clone()
    grow(layer, state, opt, step=1)
    moved = opt.state[layer.experts.w13_EDG]["exp_avg"]
    assert moved.shape[0] == 5 and torch.equal(moved[:4], exp_avg_before)
    assert torch.count_nonzero(moved[4]) == 0  # the new expert's moments start at zero
    layer.router.logit_offset_E.zero_()  # let the new expert take traffic
    for _ in range(3):
        assert torch.isfinite(torch.tensor(_step(model, opt, idx)))
    assert layer.experts.w13_EDG.grad is None  # zero_grad(set_to_none) reached the new param
    event = prune(layer, state, expert=2, optimizer=opt, step=5)
    assert event["experts_after"] == 4 and event["merged_into"] in (0, 1, 2, 3)
    assert opt.state[layer.experts.w2_EFD]["exp_avg"].shape[0] == 4
    assert layer.router.gate.weight.shape[0] == 4 and layer.router.expert_bias_E.numel() == 4
    assert torch.isfinite(torch.tensor(_step(model, opt, idx)))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_checkpoint_round_trip_across_a_change_in_expert_count(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 50, (4, 16))
    _step(model, opt, idx)
    grow(model.moe_layers[0], LayerState.fresh(4), opt, step=1)
    model.moe_layers[0].router.logit_offset_E.zero_()
    _step(model, opt, idx)
    store = CheckpointStore(tmp_path)
    opt_t, rest = flatten_optimizer(opt.state_dict())
    store.save(2, model_tensors(model), opt_t, {}, {"step": 2, "optimizer": rest})
    ck = store.load(store.latest_valid())
    fresh = _model()  # built from the config: 4 experts per layer
    assert resize_model(fresh, experts_per_layer(ck.model, fresh))
    assert fresh.experts_per_layer() == [5, 4]
    load_model_tensors(fresh, ck.model)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(unflatten_optimizer(ck.optimizer, ck.state["optimizer"]))
    model.eval()
    fresh.eval()
    assert torch.equal(model(idx)[0], fresh(idx)[0])
    _step(fresh, fresh_opt, idx)  # and it trains on


def test_trigger_fires_on_skewed_load_not_on_balanced() -> None:
    cfg = GrowthConfig(enabled=True, top_fraction=0.2, top_load=0.8, importance_var=0.25)
    skewed = LayerState.fresh(8)
    skewed.freq_E = torch.tensor([0.5, 0.35, 0.05, 0.04, 0.02, 0.02, 0.01, 0.01])
    assert "carry" in grow_reason(skewed, cfg)
    balanced = LayerState.fresh(8)
    assert grow_reason(balanced, cfg) is None
    spread = LayerState.fresh(8)  # no top-20% dominance but uneven importance
    spread.freq_E = torch.tensor([0.3, 0.25, 0.2, 0.1, 0.05, 0.05, 0.03, 0.02])
    spread.grad_E = spread.freq_E.clone()
    assert "variance" in grow_reason(spread, cfg)
    # an even load with uneven gradient norms: the importance variance is high, the layer
    # does not grow (a new expert there would start with no traffic and only add imbalance)
    busy = LayerState.fresh(8)
    busy.grad_E = torch.tensor([0.5, 0.3, 0.1, 0.04, 0.03, 0.01, 0.01, 0.01])
    assert float(busy.importance().var(unbiased=False)) > cfg.importance_var
    assert grow_reason(busy, cfg) is None


def test_manager_grows_a_skewed_layer_and_prunes_a_dead_expert() -> None:
    model = _model()
    cfg = GrowthConfig(
        enabled=True,
        check_every=1,
        cooldown=1000,
        ema=0.0,
        prune_window=3,
        u_min=0.05,
        ramp_steps=2,
    )
    gm = GrowthManager(model, cfg)
    skewed = torch.tensor([90.0, 8.0, 2.0, 0.0])  # layer 0: expert 0 hot, expert 3 dead
    even = torch.tensor([25.0, 25.0, 25.0, 25.0])
    gm.observe([skewed, even])
    events = gm.act(1, None)
    assert [(e["layer"], e["kind"]) for e in events] == [(0, "grow")]
    assert events[0]["load_before"]["max_vio"] > 2 and "trigger" in events[0]
    assert model.experts_per_layer() == [5, 4]
    gm.ramp(2)
    assert -20 < float(model.moe_layers[0].router.logit_offset_E[4]) < 0
    gm.ramp(5)
    assert float(model.moe_layers[0].router.logit_offset_E[4]) == 0.0
    # Expert 3 of layer 1 gets nothing for 3 observed steps: merged away.
    for step in range(2, 5):
        gm.observe(
            [torch.tensor([30.0, 30.0, 20.0, 10.0, 10.0]), torch.tensor([40.0, 40.0, 20.0, 0.0])]
        )
        events = gm.act(step, None)
    assert [(e["layer"], e["kind"]) for e in events] == [(1, "prune")]
    assert model.experts_per_layer() == [5, 3]


def test_training_with_growth_resumes_bit_identically(tmp_path: Path) -> None:
    """The trainer grows experts on the way, records the events, and a run killed after a
    growth resumes from a checkpoint with more experts than the config says, bit-identically."""
    import json

    from moe.data.tokens import BatchSampler, TokenStore
    from moe.train.config import PretrainConfig
    from moe.train.trainer import Trainer
    from tests.test_train import VOCAB, _data

    data = _data(tmp_path / "data")

    def trainer(ckpt: Path, stop_after: int | None = None) -> Trainer:
        torch.manual_seed(0)
        growth = GrowthConfig(
            enabled=True,
            check_every=2,
            cooldown=4,
            importance_var=0.001,
            min_load_cv=0.0,  # grow on any unevenness: the test needs growth events
            max_experts=6,
            ramp_steps=2,
            ema=0.5,
        )
        model = MoETransformer(
            ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=32),
            MoEConfig(num_experts=4, top_k=2, expert_hidden=32, growth=growth),
            VOCAB,
        )
        cfg = PretrainConfig(
            max_steps=12,
            batch_size=4,
            lr=3e-3,
            warmup_steps=2,
            checkpoint_every=3,
            log_every=2,
            device="cpu",
        )
        return Trainer(
            model,
            cfg,
            BatchSampler(TokenStore(data, "train"), 4, 16, seed=1),
            CheckpointStore(ckpt, max_retain=2),
            fingerprint="g",
            schedule="cosine",
            metrics_path=ckpt.parent / f"{ckpt.name}.jsonl",
            stop_after=stop_after,
        )

    straight = trainer(tmp_path / "a")
    res = straight.fit()
    grown = [e for e in res.expert_events if e["kind"] == "grow"]
    assert grown and res.experts_per_layer != [4, 4]
    assert max(res.experts_per_layer) <= 6
    rows = [json.loads(r) for r in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert any("expert_event" in r for r in rows)
    first = trainer(tmp_path / "b", stop_after=7)  # after the first growth (step 2 or 4)
    first.fit()
    resumed = trainer(tmp_path / "b")
    again = resumed.fit()
    assert again.resumed_from == 6 and again.experts_per_layer == res.experts_per_layer
    a, b = model_tensors(straight.model), model_tensors(resumed.model)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_split_init_starts_near_the_hot_expert_and_keeps_the_output() -> None:
    model = _model()
    idx = torch.randint(0, 50, (3, 16))
    model.eval()
    layer = model.moe_layers[0]
    layer.router.expert_bias_E.copy_(torch.tensor([0.02, 0.01, -0.04, 0.01]))  # aux_free
    before = model(idx)[0]
    state = LayerState.fresh(4)
    state.freq_E = torch.tensor([0.1, 0.1, 0.7, 0.1])
    grow(layer, state, None, step=3, init="split")
    # the new expert starts with the routing bias of the expert it competes with
    assert layer.router.expert_bias_E.tolist() == pytest.approx([0.02, 0.01, -0.04, 0.01, -0.04])
    w = layer.experts.w13_EDG.detach()
    rel = float((w[4] - w[2]).norm() / w[2].norm())
    assert abs(rel - 0.1) < 1e-4  # the hot expert plus a 10% orthogonal component
    assert torch.equal(model(idx)[0], before)
