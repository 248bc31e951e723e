"""Contract of the MoE core: the grouped expert path equals the slow reference (outputs and
gradients), the router computes in fp32, capacity drops the lowest scores, and the balance
loss has the values its papers give."""

from __future__ import annotations

import pytest
import torch

from moe.config import ModelConfig, MoEConfig
from moe.experts import GroupedExperts, reference_moe
from moe.model import MoETransformer
from moe.routing import Router, capacity_mask


def _layer(E: int = 4, D: int = 16, F: int = 32, K: int = 2, cf: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    router = Router(D, E, K, capacity_factor=cf)
    experts = GroupedExperts(E, D, F)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return router, experts


@pytest.mark.parametrize("cf", [0.0, 0.75])
@pytest.mark.parametrize("D", [16, 6])  # 6: rows not 16-byte aligned -> the loop fallback
def test_grouped_equals_reference_outputs_and_grads(cf: float, D: int) -> None:
    router, experts = _layer(D=D, cf=cf)
    x = torch.randn(40, D, requires_grad=True)
    r = router(x)
    if cf:
        assert r.keep_TK is not None and not bool(r.keep_TK.all())  # some tokens were dropped
    y_fast = experts(x, r.experts_TK, r.weights_TK, r.keep_TK)
    y_ref = reference_moe(experts, x, r.experts_TK, r.weights_TK, r.keep_TK)
    torch.testing.assert_close(y_fast, y_ref)
    g = torch.randn_like(y_fast)
    grads_fast = torch.autograd.grad(y_fast, [x, *experts.parameters()], g, retain_graph=True)
    grads_ref = torch.autograd.grad(y_ref, [x, *experts.parameters()], g)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_grouped_handles_empty_experts() -> None:
    _, experts = _layer(E=4)
    x = torch.randn(10, 16)
    experts_TK = torch.zeros(10, 1, dtype=torch.long)  # every token to expert 0
    w = torch.ones(10, 1)
    torch.testing.assert_close(experts(x, experts_TK, w), reference_moe(experts, x, experts_TK, w))


def test_router_logits_are_fp32_under_bf16_autocast() -> None:
    router, _ = _layer()
    x = torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = router(x)
    assert r.weights_TK.dtype == torch.float32
    ref = (x @ router.gate.weight.T).softmax(-1).topk(2).values
    torch.testing.assert_close(r.weights_TK, ref / ref.sum(-1, keepdim=True))


def test_aux_loss_is_one_when_perfectly_balanced() -> None:
    router, _ = _layer(E=4, K=1)
    torch.nn.init.zeros_(router.gate.weight)  # uniform probabilities
    x = torch.randn(64, 16)
    r = router(x)
    # With uniform P_i = 1/E, E * sum f_i * P_i = sum f_i = 1 whatever the assignment.
    assert float(r.aux_loss.detach()) == pytest.approx(1.0)
    assert float(r.z_loss.detach()) == pytest.approx(
        torch.log(torch.tensor(4.0)).item() ** 2, rel=1e-5
    )


def test_capacity_mask_keeps_highest_scores_per_expert() -> None:
    experts_TK = torch.tensor([[0], [0], [0], [1], [0]])
    scores = torch.tensor([[0.1], [0.9], [0.5], [0.3], [0.7]])
    keep = capacity_mask(experts_TK, scores, num_experts=2, capacity=2)
    assert keep.flatten().tolist() == [False, True, False, True, True]


def test_model_forward_backward_and_generate() -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=64, moe_every=2)
    model = MoETransformer(cfg, MoEConfig(num_experts=4, top_k=2, expert_hidden=32), vocab_size=50)
    assert len(model.moe_layers) == 1  # moe_every=2: block 1 only
    idx = torch.randint(0, 50, (3, 16))
    logits, loss, aux = model(idx, idx)
    assert logits.shape == (3, 16, 50)
    (loss + aux.aux_loss).backward()
    assert model.moe_layers[0].router.gate.weight.grad is not None
    assert int(aux.tokens_per_expert[0].sum()) == 3 * 16 * 2
    out = model.generate([1, 2, 3], max_new_tokens=5)
    assert len(out) == 5
    assert model.num_params(active_only=True) < model.num_params()
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_loss_weights_change_the_loss() -> None:
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(d_model=32, n_head=2, seq_len=8, dense_hidden=32),
        MoEConfig(num_experts=2, top_k=1, expert_hidden=16),
        20,
    )
    x = torch.randint(0, 20, (2, 8))
    y = x.clone()
    y[:, :4] = -100
    _, plain, _ = model(x, y)
    w = torch.ones(2, 8)
    _, same, _ = model(x, y, w)
    torch.testing.assert_close(plain, same)
    w[:, 6] = 5.0
    _, weighted, _ = model(x, y, w)
    assert not torch.allclose(plain, weighted)
