"""Packed finetuning: several examples in one row compute what each computes alone.

A packed row holds examples back to back (moe/data/tokens.py `SFTBatches` with packing), each
attending only to itself with positions restarting at its first token (moe/model/attention.py
`PackedRows`). The loss and every gradient of a packed batch equal those of the same examples
one to a padded row (fp32, 1e-5), for a dense model, an MoE model, sliding-window attention,
attention sinks and latent attention; the batch is a pure function of the step, rows are
filled best-fit from the step's draw, and every step has one shape."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moe.data.tokens import SFTBatches, SFTExample
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer

VOCAB, PAD = 97, 0

KINDS = {
    "dense": dict(dense_layers=[0, 1]),
    "moe": {},
    "sliding": dict(sliding_window=5, sliding_layers=[0], attn_sinks=False),
    "sinks": dict(attn_sinks=True, sliding_window=5, sliding_layers=[1], attn_out_bias=True),
    "mla": dict(attention="mla", mla_q_rank=16, mla_kv_rank=16, mla_rope_dim=8),
}


def _model(kind: str, d_model: int = 32) -> MoETransformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layer=2, n_head=4, d_model=d_model, seq_len=64, dense_hidden=48, **KINDS[kind]
    )
    model = MoETransformer(cfg, MoEConfig(num_experts=4, top_k=2, expert_hidden=24), VOCAB)
    model.set_routing_step(10**6, 0.5)  # past the expert warm-up (its noise is per batch)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
    return model


def _examples(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, targets) of `n` examples of varied lengths, the prompt without loss."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(4, 20))
        ids = rng.integers(1, VOCAB, size=L + 1).tolist()
        prompt = int(rng.integers(1, L))
        targets = [-100] * prompt + ids[prompt + 1 :]
        out.append((ids[:-1], targets))
    return out


def _unpacked(examples: list) -> tuple[torch.Tensor, ...]:
    width = max(len(x) for x, _ in examples)
    x = torch.full((len(examples), width), PAD)
    y = torch.full((len(examples), width), -100)
    for r, (ids, t) in enumerate(examples):
        x[r, : len(ids)], y[r, : len(t)] = torch.tensor(ids), torch.tensor(t)
    return x, y, torch.ones_like(y, dtype=torch.float32)


def _packed(examples: list, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    x = torch.full((rows, width), PAD)
    y = torch.full((rows, width), -100)
    seg = torch.full((rows, width), -1)
    fill = [0] * rows
    for i, (ids, t) in enumerate(examples):
        r = i % rows
        a, b = fill[r], fill[r] + len(ids)
        x[r, a:b], y[r, a:b] = torch.tensor(ids), torch.tensor(t)
        seg[r, a:b] = int(seg[r].max()) + 1
        fill[r] = b
    assert max(fill) <= width
    return x, y, torch.ones_like(y, dtype=torch.float32), seg


def _loss_and_grads(model: MoETransformer, *batch: torch.Tensor, segments=None):
    model.zero_grad(set_to_none=True)
    _, loss, _ = model(*batch, logits=False, segments_BS=segments)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_packed_batch_has_the_loss_and_gradients_of_its_examples_unpacked(kind: str) -> None:
    model = _model(kind)
    examples = _examples(9, seed=1)
    loss_u, grads_u = _loss_and_grads(model, *_unpacked(examples))
    x, y, w, seg = _packed(examples, rows=3, width=64)
    loss_p, grads_p = _loss_and_grads(model, x, y, w, segments=seg)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)
    assert grads_u.keys() == grads_p.keys() and len(grads_u) > 5
    for name, g in grads_u.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))],
)  # fmt: skip
@pytest.mark.parametrize("kind", ["dense", "moe", "sliding", "sinks"])
def test_flex_attentions_block_mask_computes_what_the_boolean_mask_does(
    kind: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FlexAttention (a GPU's packed attention) gives the loss of the unpacked examples,
    sliding windows and sinks included, and on a GPU their gradients (torch 2.13's
    FlexAttention has no backward on a CPU: there its eager form checks the forward)."""
    import moe.model.attention as A

    model = _model(kind, d_model=64).to(device)  # heads 16 wide: FlexAttention's GPU kernel
    examples = _examples(9, seed=2)
    x, y, w, seg = (t.to(device) for t in _packed(examples, rows=3, width=64))
    monkeypatch.setattr(A, "PACKED_ATTENTION", "flex")
    assert A.PackedRows(model.cfg, seg).block_masks is not None
    assert A.PackedRows(_model(kind).cfg, seg).block_masks is None  # heads 8 wide: the mask
    if device == "cpu":
        with torch.no_grad():
            loss_u = model(*_unpacked(examples), logits=False)[1]
            loss_p = model(x, y, w, logits=False, segments_BS=seg)[1]
        torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=1e-5)
        return
    loss_u, grads_u = _loss_and_grads(model, *(t.to(device) for t in _unpacked(examples)))
    loss_p, grads_p = _loss_and_grads(model, x, y, w, segments=seg)
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-4, atol=1e-4)
    assert grads_u.keys() == grads_p.keys()
    for name, g in grads_u.items():
        torch.testing.assert_close(grads_p[name], g, rtol=1e-4, atol=1e-4, msg=name)


def test_without_segments_the_examples_of_a_row_see_each_other() -> None:
    """The control: the same packed rows read as plain causal rows give another loss (so the
    equality above is the mask's and the positions' doing)."""
    model = _model("moe")
    examples = _examples(9, seed=1)
    loss_u, _ = _loss_and_grads(model, *_unpacked(examples))
    x, y, w, _ = _packed(examples, rows=3, width=64)
    loss_plain, _ = _loss_and_grads(model, x, y, w)
    assert abs(float(loss_plain) - float(loss_u)) > 1e-3


def _sft(n: int = 60, batch: int = 8, max_len: int = 48, seed: int = 3) -> SFTBatches:
    rng = np.random.default_rng(seed)
    examples = [
        SFTExample(
            rng.integers(1, VOCAB, size=int(rng.integers(3, 30))).tolist(),
            rng.integers(1, VOCAB, size=int(rng.integers(2, 12))).tolist(),
        )
        for _ in range(n)
    ]
    return SFTBatches(examples, batch, max_len, seed=7, pad_id=PAD, packing=True)


def test_packed_batches_have_one_shape_and_are_a_function_of_the_step() -> None:
    b = _sft()
    shapes = set()
    for step in range(30):
        x, y, w, seg = b.batch_at(step)
        shapes.add(tuple(x.shape))
        again = b.batch_at(step)
        assert all(torch.equal(p, q) for p, q in zip((x, y, w, seg), again, strict=True))
        # each example is one run of its segment id, in order, pads (-1) only after the last
        for row in seg.tolist():
            ids = [s for s in row if s >= 0]
            assert ids == sorted(ids) and row[len(ids) :] == [-1] * (len(row) - len(ids))
        assert bool((y[seg < 0] == -100).all())  # padding carries no loss
    assert shapes == {(b.rows, 48)}


def test_packed_rows_hold_the_examples_they_were_given_whole() -> None:
    """Every packed example is one of the set's, whole (its prompt and response in order), and
    the rows are well filled: more than 85% of their tokens are the examples'."""
    b = _sft(n=60, batch=16)
    encoded = {tuple(b.encode(ex)[0]) for ex in b.examples}
    filled = []
    for step in range(20):
        x, _, _, seg = b.batch_at(step)
        for r in range(x.shape[0]):
            for s in seg[r].unique().tolist():
                if s >= 0:
                    assert tuple(x[r][seg[r] == s].tolist()) in encoded
        filled.append(float((seg >= 0).float().mean()))
    assert np.mean(filled) > 0.85, np.mean(filled)


def test_examples_per_step_are_the_batch_size_in_expectation() -> None:
    b = _sft(n=200, batch=16)
    counts = [int((b.batch_at(s)[3].max(dim=1).values + 1).sum()) for s in range(40)]
    assert 14.5 <= np.mean(counts) <= 17.5, np.mean(counts)


def _sft_trainer(data: Path, ckpt: Path, stop_after: int | None = None):
    from moe.checkpoint.store import CheckpointStore
    from moe.data.tokens import BatchSampler, MixedBatches, TokenStore
    from moe.train.config import FinetuneConfig
    from moe.train.trainer import Trainer

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=48, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        VOCAB,
    )
    sft = _sft(n=60, batch=8, max_len=48)
    batches = MixedBatches(sft, BatchSampler(TokenStore(data, "train"), 2, 48, seed=1))
    cfg = FinetuneConfig(max_steps=8, batch_size=8, lr=3e-3, warmup_steps=2, checkpoint_every=3,
                         log_every=2, device="cpu", max_len=48)  # fmt: skip
    return Trainer(
        model, cfg, batches, CheckpointStore(ckpt, max_retain=2), fingerprint="packed",
        schedule="linear", min_lr=0.0, expert_warmup=False,
        metrics_path=ckpt.parent / f"{ckpt.name}.jsonl", stop_after=stop_after,
    )  # fmt: skip


def test_a_packed_finetune_resumes_bit_identically_and_reports_its_examples(
    tmp_path: Path,
) -> None:
    """Packed rows with replay rows beside them (MixedBatches), stopped after 4 steps and
    resumed: the weights of an uninterrupted run; the metrics rows say how many examples and
    real tokens a step held."""
    import json

    from moe.checkpoint.tensors import model_tensors, weights_digest
    from tests.test_train import _data

    data = _data(tmp_path / "data")
    straight = _sft_trainer(data, tmp_path / "a")
    straight.fit()
    assert _sft_trainer(data, tmp_path / "b", stop_after=4).fit().stop_reason == "stop_after"
    resumed = _sft_trainer(data, tmp_path / "b")
    assert resumed.fit().resumed_from == 3
    assert weights_digest(model_tensors(resumed.model)) == weights_digest(
        model_tensors(straight.model)
    )
    rows = [json.loads(r) for r in (tmp_path / "a.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "loss" in r]
    sft = _sft(n=60, batch=8, max_len=48)
    want = np.mean([int((sft.batch_at(s)[3].max(dim=1).values + 1).sum()) for s in (0, 1)])
    # the first row covers steps 0 and 1: their SFT examples, plus one segment per replay row
    assert rows[0]["examples_per_step"] == want + 2
    assert rows[0]["real_tokens_per_step"] > 0.85 * (sft.rows + 2) * 48


def test_an_epoch_packs_every_example_once_favouring_no_length() -> None:
    """The plan holds each example once an epoch, and the steps of an epoch take all its rows
    but for a remainder shorter than a step: the examples trained on have the set's mean
    length (a top-up of each step's room would favour the short ones)."""
    b = _sft(n=300, batch=16)
    plan = b.plan
    rows = plan.epoch(0)
    assert sorted(i for row in rows for i in row) == list(range(300))
    assert all(sum(int(b.lengths[i]) for i in row) <= 48 for row in rows)
    seen = [i for s in range(plan.steps_per_epoch) for row in plan.rows_at(s) for i in row]
    assert len(seen) == len(set(seen)) and len(rows) - plan.steps_per_epoch * b.rows < b.rows
    assert abs(np.mean(b.lengths[seen]) - np.mean(b.lengths)) < 0.03 * np.mean(b.lengths)
    # the next epoch is another order of the same examples
    assert plan.rows_at(plan.steps_per_epoch) != plan.rows_at(0)
    assert sorted(i for row in plan.epoch(1) for i in row) == list(range(300))


def test_weighted_examples_are_packed_in_proportion_to_their_weights() -> None:
    rng = np.random.default_rng(0)
    examples = [
        SFTExample(rng.integers(1, VOCAB, size=10).tolist(), [5, 6], weight=3.0 if i < 50 else 1.0)
        for i in range(200)
    ]
    b = SFTBatches(examples, 16, 48, seed=7, pad_id=PAD, packing=True)
    counts = np.bincount([i for row in b.plan.epoch(0) for i in row], minlength=200)
    share = counts[:50].sum() / counts.sum()  # 150 / 300 of the weight
    assert 0.44 < share < 0.56, share


def test_batch_size_is_a_steps_and_each_micro_batch_draws_its_share() -> None:
    """grad_accum 4 on batch_size 16: each micro-batch holds 4 examples (packed: in
    expectation), as tasks/fit.py counts a micro-batch's activations; the micro-batches of a
    step are different rows of the plan."""
    unpacked = _sft(n=200, batch=16)
    unpacked = SFTBatches(unpacked.examples, 16, 48, seed=7, pad_id=PAD, micro_batches=4)
    assert unpacked.batch_at(0, 0)[0].shape[0] == 4
    b = SFTBatches(unpacked.examples, 16, 48, seed=7, pad_id=PAD, packing=True, micro_batches=4)
    counts = [
        int((b.batch_at(s, m)[3].max(dim=1).values + 1).sum()) for s in range(20) for m in range(4)
    ]
    assert 3.0 <= np.mean(counts) <= 5.0, np.mean(counts)
    assert not torch.equal(b.batch_at(0, 0)[0], b.batch_at(0, 1)[0])
