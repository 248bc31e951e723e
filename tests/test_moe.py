"""Contract of the MoE core: the grouped expert path equals the slow reference (outputs and
gradients), the router computes in fp32, capacity drops the lowest scores, and the balance
loss has the values its papers give."""

from __future__ import annotations

import pytest
import torch

from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import GroupedExperts, reference_moe
from moe.model.routing import Router, capacity_mask
from moe.model.transformer import LOSS_ROW_BUCKET, MoETransformer


def _layer(E: int = 4, D: int = 16, F: int = 32, K: int = 2, cf: float = 0.0, seed: int = 0):
    torch.manual_seed(seed)
    router = Router(
        D,
        MoEConfig(
            num_experts=E, top_k=K, dropless=cf == 0, capacity_factor=cf or 1.0, balancing=[]
        ),
    )
    experts = GroupedExperts(E, D, F)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return router, experts


@pytest.mark.parametrize("cf", [0.0, 0.75])
@pytest.mark.parametrize("D", [16, 6])  # 6: rows not 16-byte aligned -> padded for the kernel
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


def test_gpt_oss_experts_equal_the_reference_outputs_and_grads() -> None:
    """Expert biases and the clamped SwiGLU (moe.activation: clamped_swiglu) on the grouped
    path against reference_moe, the clamps reached (weights large enough)."""
    torch.manual_seed(0)
    mcfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=32,
        balancing=[],
        activation="clamped_swiglu",
        expert_proj_bias=True,
        router_logit_bias=True,
    )
    router, experts = Router(16, mcfg), GroupedExperts.for_config(16, mcfg)
    for p in [*experts.parameters(), router.gate.bias]:
        torch.nn.init.normal_(p, std=1.0)
    x = torch.randn(40, 16, requires_grad=True)
    r = router(x)
    with torch.no_grad():
        h = torch.einsum("td,edg->teg", x, experts.w13_EDG) + experts.b13_EG
    assert bool((h[..., :32] > 7).any()) and bool((h[..., 32:] < -7).any())  # clamps bite
    y_fast = experts(x, r.experts_TK, r.weights_TK)
    y_ref = reference_moe(experts, x, r.experts_TK, r.weights_TK)
    g = torch.randn_like(y_fast)
    params = [x, *experts.parameters()]
    grads_fast = torch.autograd.grad(y_fast, params, g, retain_graph=True)
    grads_ref = torch.autograd.grad(y_ref, params, g)
    for a, b in zip([y_fast, *grads_fast], [y_ref, *grads_ref], strict=True):
        # values in the hundreds here: fp32 rounding relative to the largest
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.detach().abs().max()))
    # gpt-oss's routing: the top-k logits (bias included), softmaxed; ours renormalises the
    # top-k of the softmax, the same weights
    logits = x.detach() @ router.gate.weight.T + router.gate.bias
    top = logits.topk(2)
    assert torch.equal(r.experts_TK, top.indices)
    torch.testing.assert_close(r.weights_TK, top.values.softmax(-1))


def test_sinks_and_windows_in_the_fused_attention_equal_the_softmax_written_out() -> None:
    """moe/model/masking.py `attention` (a zero key/value whose mask is the sink, through
    scaled_dot_product_attention) against transformers' eager formula: the sink's logit
    in each softmax's denominator, a window of 3; outputs and gradients, sinks' included."""
    from moe.model.masking import attention, causal_mask

    torch.manual_seed(0)
    q = torch.randn(2, 4, 10, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 10, 8, requires_grad=True) for _ in range(2))
    sinks = torch.randn(4, requires_grad=True)
    fused = attention(q, k, v, None, sinks, window=3)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ kk.transpose(2, 3)) / 8**0.5
    scores = scores.masked_fill(~causal_mask(10, 3), float("-inf"))
    logits = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 10, 1)], dim=-1)
    written = logits.softmax(-1)[..., :-1] @ vv
    torch.testing.assert_close(fused, written)
    g = torch.randn_like(fused)
    for a, b in zip(
        torch.autograd.grad(fused, (q, k, v, sinks), g),
        torch.autograd.grad(written, (q, k, v, sinks), g),
        strict=True,
    ):
        torch.testing.assert_close(a, b)
    assert causal_mask(5, 2).sum(1).tolist() == [1, 2, 2, 2, 2]  # itself and one before


def test_unaligned_widths_take_the_kernel_padded_never_the_host(monkeypatch) -> None:
    """Rows of 24 and 20 bytes (D=6, F=5 in fp32; a rank-1 expert adapter is 4) are padded
    to the kernel's 16 bytes: equal to the reference, and the counts never go to the host."""

    def no_host_read(self, *args, **kwargs):
        raise AssertionError("a tensor was read on the host (.tolist())")

    torch.manual_seed(0)
    router, experts = _layer(D=6, F=5)
    x = torch.randn(40, 6, requires_grad=True)
    with torch.no_grad():
        r = router(x)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "tolist", no_host_read)
        y_fast = experts(x, r.experts_TK, r.weights_TK)
        grads_fast = torch.autograd.grad(y_fast.square().sum(), [x, *experts.parameters()])
    y_ref = reference_moe(experts, x, r.experts_TK, r.weights_TK)
    grads_ref = torch.autograd.grad(y_ref.square().sum(), [x, *experts.parameters()])
    torch.testing.assert_close(y_fast, y_ref)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_the_cpu_kernel_needs_the_padding_too() -> None:
    """Why `_aligned` pads on a CPU as well (a review took it for a CUDA-only need): torch's
    CPU grouped product refuses rows that are not a multiple of 16 bytes. If a torch release
    lifts that, this fails, and the CPU can skip the weight's padded copy."""
    import torch.nn.functional as F

    offs = torch.tensor([10, 20, 30, 40], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        F.grouped_mm(torch.randn(40, 6), torch.randn(4, 6, 5), offs=offs)


def test_the_loop_over_experts_says_why_once(monkeypatch) -> None:
    """Where the kernel cannot run (here: a torch without F.grouped_mm) the loop gives the
    same result and warns once, naming the reason: a 6x slower step is never silent."""
    import moe.model.experts as X

    router, experts = _layer()
    x = torch.randn(40, 16)
    r = router(x)
    monkeypatch.delattr(torch.nn.functional, "grouped_mm")
    monkeypatch.setattr(X, "_WARNED", set())
    monkeypatch.setattr(X, "_REASONS", {})  # worked out again without the kernel
    with pytest.warns(RuntimeWarning, match="loop over the experts.*has no F.grouped_mm"):
        y = experts(x, r.experts_TK, r.weights_TK)
    torch.testing.assert_close(y, reference_moe(experts, x, r.experts_TK, r.weights_TK))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        experts(x, r.experts_TK, r.weights_TK)  # said once


def test_under_autocast_every_grouped_product_computes_in_its_dtype() -> None:
    """F.grouped_mm has no autocast rule: an fp32 input under bf16 autocast missed the CUDA
    kernel (bf16 only) for the loop. Every grouped product, forward and backward, experts
    and their adapters, must see bf16 operands."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from moe.adapters.config import LoraConfig
    from moe.adapters.lora import ExpertLoRA

    class Dtypes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[torch.dtype, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "grouped_mm" in func.__name__:
                self.seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return func(*args, **(kwargs or {}))

    router, experts = _layer()
    lcfg = LoraConfig(rank=4)
    experts.lora = ExpertLoRA(experts, lcfg.rank, 2.0, 0.0, torch.Generator().manual_seed(0))
    torch.nn.init.normal_(experts.lora.b13, std=0.1)
    x = torch.randn(40, 16, requires_grad=True)
    r = router(x)
    with Dtypes() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        y = experts(x, r.experts_TK, r.weights_TK)
        y.float().square().sum().backward()
    assert len(mode.seen) >= 8 * 2  # 8 products forward, more in the backward
    assert {d for ds in mode.seen for d in ds if d.is_floating_point} == {torch.bfloat16}


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
    model.eval()
    prompt = idx[0, :14].tolist()  # 14 + 5 tokens: the context window (16) slides
    out = model.generate(prompt, max_new_tokens=5)
    # Greedy: each new token is the argmax of a forward pass over the last seq_len tokens.
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(model(torch.tensor([ids[-16:]]))[0][0, -1].argmax()))
    assert out == ids[14:] and len(out) == 5
    assert model.generate(prompt, max_new_tokens=5, stop_ids={out[0]}) == []  # stops before it
    assert model.num_params(active_only=True) < model.num_params()
    with pytest.raises(ValueError, match="longer than model.seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("dropless", [True, False])
def test_batched_kv_cache_decoding_equals_plain_decoding(dropless: bool) -> None:
    """generate_batch (left-padded prompts, a KV cache, one token per row per step) gives the
    same tokens as generate (the whole window again for every token), prompt by prompt."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        n_layer=3, n_head=2, d_model=32, seq_len=48, dense_hidden=64, moe_every=2, init_std=0.3
    )
    mcfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, dropless=dropless)
    model = MoETransformer(cfg, mcfg, vocab_size=61).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (1, 9, 4, 17, 9, 30)]
    stop = {7, 11}
    plain = [model.generate(p, max_new_tokens=16, stop_ids=stop) for p in prompts]
    batched = model.generate_batch(prompts, max_new_tokens=16, stop_ids=stop)
    assert batched == plain
    assert any(len(o) == 16 for o in plain) and any(len(o) < 16 for o in plain)  # both ends
    assert len({tuple(o) for o in plain}) == len(prompts)  # the prompts lead somewhere else
    with pytest.raises(ValueError, match="fit model.seq_len=48"):
        model.generate_batch([[1] * 40], max_new_tokens=16)


def test_set_context_reads_longer_prompts_as_a_model_built_that_long() -> None:
    """A checkpoint trained at 16 positions reads 40 after set_context(40): the same logits
    and KV-cache generations as the same weights built at 40."""
    torch.manual_seed(0)
    mcfg = MoEConfig(num_experts=4, top_k=2, expert_hidden=32)

    def build(n: int) -> MoETransformer:
        cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=n, dense_hidden=64)
        return MoETransformer(cfg, mcfg, vocab_size=50).eval()

    short, long = build(16), build(40)
    long.load_state_dict(short.state_dict())
    prompt = torch.randint(0, 50, (1, 30))
    with pytest.raises(ValueError, match="fit model.seq_len=16"):
        short.generate_batch([prompt[0].tolist()], max_new_tokens=8)
    short.set_context(40)
    assert short.cfg.seq_len == 40 and short.rope_cos.shape == long.rope_cos.shape
    torch.testing.assert_close(short(prompt)[0], long(prompt)[0])
    got = short.generate_batch([prompt[0].tolist()], max_new_tokens=8)
    assert got == long.generate_batch([prompt[0].tolist()], max_new_tokens=8) and len(got[0]) == 8


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


# --------------------------------------------------------------------------- balancing


def _router(E: int = 8, K: int = 2, D: int = 16, **kw) -> Router:
    torch.manual_seed(0)
    return Router(D, MoEConfig(num_experts=E, top_k=K, **kw))


def _skewed_input(D: int = 16, T: int = 512) -> torch.Tensor:
    """Tokens that share a common direction: an untrained router sends most of them to a
    few experts (MaxVio ~1.8 at 8 experts)."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(T, D, generator=g) + torch.randn(D, generator=g) * 2


def _max_vio(counts: torch.Tensor) -> float:
    c = counts.float()
    return float(c.max() / c.mean() - 1)


def test_aux_free_bias_reduces_imbalance_on_a_skewed_input() -> None:
    router = _router(balancing=["aux_free"], aux_free_rate=0.01)
    x = _skewed_input()
    router.train()
    before = _max_vio(router(x).tokens_per_expert_E)
    for step in range(1, 301):
        router(x)
        router.update_state(step)
    after = _max_vio(router(x).tokens_per_expert_E)
    assert before > 1.0  # the input really is skewed
    assert after < 0.3 and after < 0.25 * before
    assert abs(float(router.expert_bias_E.sum())) < 1e-4  # re-centred
    # The bias only chooses: the combine weights are still the router's own probabilities.
    r = router(x)
    probs = (x @ router.gate.weight.T).softmax(-1).gather(1, r.experts_TK)
    torch.testing.assert_close(r.weights_TK, probs / probs.sum(-1, keepdim=True))


def test_util_aware_routing_moves_load_to_under_used_experts() -> None:
    x = _skewed_input()
    plain_counts = _router(balancing=[])(x).tokens_per_expert_E.float()
    aware = _router(balancing=["util_aware"], util_alpha=0.3, util_momentum=0.9)
    aware.train()
    routed = torch.zeros(8)
    for step in range(1, 61):
        counts = aware(x).tokens_per_expert_E.float()
        aware.update_state(step)  # the moving average follows the routed load
        if step > 30:
            routed += counts
    # Utilisation-aware reweighting is a weak balancer (measured: MaxVio 1.85 -> 0.93 here at
    # alpha 0.3, -> 1.49 at 0.2), but it moves load off the busy experts.
    assert _max_vio(routed) < 0.75 * _max_vio(plain_counts)
    assert float(aware.util_E.min()) < 1 < float(aware.util_E.max())


def test_rebalance_scales_gate_rows_by_utilisation() -> None:
    router = _router(E=4, balancing=["rebalance"], rebalance_every=2, rebalance_beta=0.1)
    router.util_E.copy_(torch.tensor([2.0, 1.0, 0.5, 0.5]))
    w0 = router.gate.weight.detach().clone()
    router.load_E.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    router.update_state(1)  # not due: step 1
    torch.testing.assert_close(router.gate.weight, w0)
    router.load_E.copy_(torch.tensor([1.0, 1.0, 1.0, 1.0]))
    router.update_state(2)  # due
    factor = (1 - 0.1 * (router.util_E - 1)).clamp(0.5, 1.5)
    torch.testing.assert_close(router.gate.weight, w0 * factor.unsqueeze(1))
    assert float(factor[0]) < 1 < float(factor[2])  # the busy expert's row shrinks


def test_cv_penalty_is_std_over_mean_of_the_soft_load_and_has_gradient() -> None:
    router = _router(balancing=["cv_penalty"], cv_penalty_coef=0.5)
    x = _skewed_input()
    r = router(x)
    soft = (x @ router.gate.weight.T).softmax(-1).sum(0)
    expected = soft.std(unbiased=False) / soft.mean()
    torch.testing.assert_close(r.cv_loss, expected)
    torch.testing.assert_close(r.balance_loss, 0.5 * expected)
    r.balance_loss.backward()
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_expert_warmup_routes_uniformly_then_blends_in_the_router() -> None:
    router = _router(E=8, K=2, balancing=["warmup"], warmup_steps=10, warmup_blend_steps=10)
    router.train()
    x = _skewed_input(T=4096)
    router.set_step(0, 0.0)
    r = router(x)
    torch.testing.assert_close(r.weights_TK, torch.full_like(r.weights_TK, 0.5))
    assert _max_vio(r.tokens_per_expert_E) < 0.15  # uniform at random: near-even load
    router.set_step(100, 0.5)  # past warm-up and blend: the router's own top-k
    r = router(x)
    probs = (x @ router.gate.weight.T).softmax(-1)
    top = probs.topk(2)
    assert torch.equal(r.experts_TK, top.indices)
    router.eval()
    router.set_step(0, 0.0)  # warm-up is a training-time policy; evaluation routes normally
    assert torch.equal(router(x).experts_TK, top.indices)


def test_force_balanced_gives_exactly_even_load() -> None:
    router = _router(E=4, K=2, force_balanced=True)
    r = router(_skewed_input(T=64))
    assert r.tokens_per_expert_E.tolist() == [32, 32, 32, 32]
    assert torch.all(r.weights_TK == 0.5)


def test_capacity_factor_schedule_moves_linearly() -> None:
    router = _router(dropless=False, capacity_factor=1.5, capacity_factor_end=1.0)
    router.progress = 0.0
    assert router.capacity_factor() == pytest.approx(1.5)
    router.progress = 0.5
    assert router.capacity_factor() == pytest.approx(1.25)
    router.progress = 1.0
    assert router.capacity(800) == 200  # 1.0 * 800 * 2 / 8
    r = router(_skewed_input(T=800))
    assert r.keep_TK is not None
    assert float(r.dropped_fraction) > 0
    kept = torch.bincount(r.experts_TK[r.keep_TK], minlength=8)
    assert int(kept.max()) <= 200


@pytest.mark.parametrize(
    "balancing",
    [
        ["aux_loss"],
        ["z_loss"],
        ["cv_penalty"],
        ["util_aware"],
        ["rebalance"],
        ["aux_free"],
        ["warmup"],
        ["aux_loss", "z_loss", "cv_penalty", "util_aware", "rebalance", "aux_free", "warmup"],
    ],
)
def test_every_balancing_option_trains_without_nan(balancing: list[str]) -> None:
    torch.manual_seed(0)
    mcfg = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=32,
        balancing=balancing,  # type: ignore[arg-type]
        rebalance_every=2,
        warmup_steps=2,
        warmup_blend_steps=2,
        jitter=0.01,
    )
    model = MoETransformer(ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16), mcfg, 50)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 50, (4, 16))
    losses = []
    for step in range(6):
        model.set_routing_step(step, step / 6)
        _, loss, aux = model(idx, idx)
        (loss + aux.balance_loss).backward()
        opt.step()
        opt.zero_grad()
        model.update_routing(step + 1)
        losses.append(float(loss.detach()))
        assert torch.isfinite(aux.balance_loss)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    # The routing state is part of the model's state dict (checkpoints carry it).
    keys = model.state_dict().keys()
    assert any(k.endswith("router.expert_bias_E") for k in keys)
    assert not any(k.endswith("router.load_E") for k in keys)


def test_layer_matches_hugging_face_qwen3_moe_block() -> None:
    """Parity with transformers' Qwen3-MoE sparse block (a dev dependency; nothing is
    downloaded: the block is built from a config and our weights are copied in)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from moe.model.transformer import MoEAux, MoELayer

    torch.manual_seed(0)
    D, E, K, F = 32, 8, 2, 64
    ours = MoELayer(D, MoEConfig(num_experts=E, top_k=K, expert_hidden=F, balancing=[]))
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.1)
    cfg = Qwen3MoeConfig(
        hidden_size=D,
        moe_intermediate_size=F,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,  # as our moe.renormalize
    )
    cfg._experts_implementation = "grouped_mm"
    hf = Qwen3MoeSparseMoeBlock(cfg)
    w1, w3, w2 = ours.experts.weights_EDF()
    with torch.no_grad():
        hf.gate.weight.copy_(ours.router.gate.weight)
        hf.experts.gate_up_proj.copy_(torch.cat([w1, w3], dim=2).transpose(1, 2))
        hf.experts.down_proj.copy_(w2.transpose(1, 2))
    x = torch.randn(2, 24, D, requires_grad=True)
    zero = torch.zeros(())
    y_ours = ours(x, MoEAux(zero, zero, zero))
    y_hf = hf(x)
    torch.testing.assert_close(y_ours, y_hf, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y_hf)
    (gx_ours,) = torch.autograd.grad(y_ours, x, g)
    (gx_hf,) = torch.autograd.grad(y_hf, x, g)
    torch.testing.assert_close(gx_ours, gx_hf, rtol=1e-5, atol=1e-6)
    # The check can fail: a different expert's weights change the output.
    with torch.no_grad():
        hf.experts.down_proj[0].mul_(2)
    assert not torch.allclose(ours(x, MoEAux(zero, zero, zero)), hf(x))


def test_the_loss_without_logits_equals_the_loss_with_them() -> None:
    """logits=False runs the output head only where a target counts (finetuning's answer
    tokens): the same loss and the same gradients as the full head, weights included."""
    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=24),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        64,
    )
    x = torch.randint(0, 64, (3, 24))
    y = x.clone()
    y[:, :15] = -100  # the prompt carries no loss
    y[2, 20:] = -100  # padding
    w = torch.rand(3, 24) + 0.5
    losses, grads, rows = [], [], []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    for logits in (True, False):
        model.zero_grad()
        out, loss, _ = model(x, y, w, logits=logits)
        assert (out is None) == (not logits)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # the 23 loss positions go through the head as 64 rows (the rest ignored): a few sizes
    assert rows[-1] == LOSS_ROW_BUCKET and 3 * 9 - 4 < LOSS_ROW_BUCKET


@pytest.mark.parametrize("renormalize", ["auto", True])
def test_at_top_1_from_scratch_the_language_model_loss_trains_the_gate(renormalize) -> None:
    """Switch's rule for a model built here: its one choice weighs the router's probability,
    so the gate learns through the weight. Renormalised (an import's rule, Mixtral's), the one
    choice weighs 1 and only the balancing losses would move the gate."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, dense_hidden=64, moe_every=2)
    mcfg = MoEConfig(
        num_experts=4,
        top_k=1,
        expert_hidden=32,
        balancing=[],  # the language-model loss alone
        warmup_steps=0,
        warmup_blend_steps=0,
        renormalize=renormalize,
    )
    model = MoETransformer(cfg, mcfg, vocab_size=50)
    idx = torch.randint(0, 50, (3, 16))
    _, loss, _ = model(idx, idx)
    loss.backward()
    grad = model.moe_layers[0].router.gate.weight.grad
    # renormalised, w / (w + 1e-20) leaves a gradient of ~1e-20 / w: none to speak of
    moved = grad is not None and float(grad.abs().max()) > 1e-6
    assert moved == (renormalize == "auto")
    assert mcfg.renormalizes() == (renormalize is True)
    assert not MoEConfig(top_k=1).renormalizes() and MoEConfig(top_k=2).renormalizes()
