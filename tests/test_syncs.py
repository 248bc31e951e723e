"""What `HostSyncs` (moe/train/syncs.py) counts: every device-to-host read and every op whose
output size depends on the data, once each; ops that stay on the device count nothing. Each
case is its own test: dropping an op from the counter fails the case that uses it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe.train.syncs import HostSyncs, _is_sync

x = torch.arange(6.0)
mask = x > 2

SYNCS: dict[str, Callable[[], object]] = {
    "item": lambda: x.sum().item(),
    "float": lambda: float(x.sum()),
    "if": lambda: bool(x.sum() > 0),
    "nonzero": lambda: mask.nonzero(),
    "where(cond)": lambda: torch.where(mask),
    "x[mask]": lambda: x[mask],
    "x[mask] = v": lambda: x.clone().__setitem__(mask, 0.0),
    "masked_select": lambda: x.masked_select(mask),
    "bincount": lambda: torch.bincount(torch.tensor([0, 2, 2])),
    "unique": lambda: torch.unique(torch.tensor([1, 1, 2])),
    "repeat_interleave by tensor": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
    "tolist": lambda: x.tolist(),
    "equal": lambda: torch.equal(x, x),
}
NO_SYNCS: dict[str, Callable[[], object]] = {
    "add": lambda: x + 1,
    "x[index]": lambda: x[torch.tensor([0, 2])],
    "x[index] = v": lambda: x.clone().__setitem__(torch.tensor([0, 2]), 0.0),
    "where(cond, a, b)": lambda: torch.where(mask, x, 0.0),
    "repeat_interleave with output_size": lambda: x.repeat_interleave(
        torch.ones(6, dtype=torch.long), output_size=6
    ),
    "to(cpu) of a host tensor": lambda: x.to("cpu"),
}


@pytest.mark.parametrize("case", list(SYNCS))
def test_each_host_read_counts(case: str) -> None:
    with HostSyncs() as syncs:
        SYNCS[case]()
    assert sum(syncs.counts.values()) >= 1, case


@pytest.mark.parametrize("case", list(NO_SYNCS))
def test_what_stays_on_the_device_counts_nothing(case: str) -> None:
    with HostSyncs() as syncs:
        NO_SYNCS[case]()
    assert sum(syncs.counts.values()) == 0, (case, syncs.counts)


def test_a_copy_from_a_device_to_the_host_counts() -> None:
    """t.cpu() and host.copy_(t) of a device tensor (a CPU tensor's stay uncounted): judged
    on the op's arguments, so this runs without a GPU (a meta tensor stands for one in the
    device test only; tests/test_cuda.py reads a real one)."""
    to_copy = torch.ops.aten._to_copy.default
    copy = torch.ops.aten.copy_.default
    dev = torch.empty(2, device="meta")
    assert not _is_sync(to_copy, (x,), {"device": torch.device("cpu")})
    assert not _is_sync(copy, (x.clone(), x), {})

    class Device(torch.Tensor):  # a tensor that says it is on a GPU
        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", 0)

    on_gpu = x.as_subclass(Device)
    assert _is_sync(to_copy, (on_gpu,), {"device": torch.device("cpu")})
    assert _is_sync(copy, (x.clone(), on_gpu), {})
    assert not _is_sync(copy, (on_gpu, x), {})  # host to device: no wait
    assert not _is_sync(to_copy, (dev,), {"device": torch.device("cpu")})


def test_generation_reads_the_device_once_a_token_the_stop_check() -> None:
    """generate_batch keeps its tokens on the device and reads them once at the end: a token
    costs one host read (whether every row has stopped), whatever the batch; the MoE layers'
    decode steps read nothing."""
    from moe.model.config import ModelConfig, MoEConfig
    from moe.model.transformer import MoETransformer

    torch.manual_seed(0)
    model = MoETransformer(
        ModelConfig(n_layer=2, n_head=2, d_model=32, seq_len=64, dense_hidden=32),
        MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
        50,
    ).eval()
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    reads = {}
    for n in (4, 12):  # no stop token: every step runs
        with HostSyncs() as syncs:
            out = model.generate_batch(prompts, n, set())
        assert [len(o) for o in out] == [n] * 3
        reads[n] = sum(syncs.counts.values())
    assert reads[12] - reads[4] == 8, reads  # one a token


def test_flexattention_passes_through_and_the_count_goes_on() -> None:
    """FlexAttention (packed rows on a GPU) is a higher-order operator: under the mode it
    runs (torch refuses one a mode does not declare it handles) and counts nothing, and
    the reads after it still count."""
    from moe.model.masking import block_masks, flex_attention

    seg = torch.tensor([[0] * 5 + [1] * 7 + [-1] * 4])
    mask = block_masks(seg, set())[0]
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    with HostSyncs() as syncs:
        y = flex_attention(q, k, v, mask, None)
        assert sum(syncs.counts.values()) == 0, syncs.counts
        y.sum().item()
    assert sum(syncs.counts.values()) == 1
