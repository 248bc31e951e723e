"""Tensor codecs: every lossless codec round-trips bit-exactly in every dtype; byte grouping
compresses trained-like weights; XOR deltas of nearby steps are small; fp16 is marked lossy."""

from __future__ import annotations

import pytest
import torch

from moe.checkpoint.codec import CODECS, decode, encode


def _weights(dtype: torch.dtype, n: int = 65536, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dtype)


@pytest.mark.parametrize("codec", [c for c in CODECS if c != "fp16-zstd"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
)
def test_lossless_codecs_round_trip_bit_exact(codec: str, dtype: torch.dtype) -> None:
    t = _weights(torch.float32, 1000).mul(1000).to(dtype).reshape(10, 100)
    base = None
    if codec == "xor-zstd":
        base = (t.float() + 1).to(dtype)
    enc = encode(t, codec, base=base)
    out = decode(enc.codec, enc.dtype, enc.shape, enc.data, base=base)
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    assert not enc.lossy


def test_empty_and_scalar_tensors() -> None:
    for t in (torch.empty(0, 4), torch.tensor(3.5), torch.tensor(7, dtype=torch.int64)):
        enc = encode(t, "bg-zstd")
        assert torch.equal(decode(enc.codec, enc.dtype, enc.shape, enc.data), t)


def test_byte_grouping_beats_plain_zstd_on_bf16_weights() -> None:
    import zstandard

    t = _weights(torch.bfloat16)
    raw = t.numel() * 2
    grouped = len(encode(t, "bg-zstd").data)
    plain = len(zstandard.ZstdCompressor(level=3).compress(t.view(torch.uint8).numpy().tobytes()))
    assert grouped < plain
    assert grouped / raw < 0.75  # the exponent byte compresses, the mantissa byte does not


def test_xor_delta_of_a_small_update_is_smaller_than_a_full_copy() -> None:
    before = _weights(torch.float32)
    after = before - 1e-4 * torch.sign(_weights(torch.float32, seed=1))  # one Adam-sized step
    full = len(encode(after, "bg-zstd").data)
    delta = encode(after, "xor-zstd", base=before)
    assert len(delta.data) < 0.8 * full
    back = decode(delta.codec, delta.dtype, delta.shape, delta.data, base=before)
    assert torch.equal(back, after)
    with pytest.raises(ValueError, match="base"):
        decode(delta.codec, delta.dtype, delta.shape, delta.data)


def test_fp16_cold_tier_is_lossy_and_says_so() -> None:
    t = _weights(torch.float32)
    enc = encode(t, "fp16-zstd")
    assert enc.lossy
    out = decode(enc.codec, enc.dtype, enc.shape, enc.data)
    assert out.dtype == torch.float32
    assert not torch.equal(out, t)
    torch.testing.assert_close(out, t, rtol=1e-3, atol=1e-6)
    assert len(enc.data) < 0.6 * t.numel() * 4
    # Integer state is never rounded: it falls back to a lossless codec.
    steps = torch.tensor([12345678], dtype=torch.int64)
    enc = encode(steps, "fp16-zstd")
    assert not enc.lossy and enc.codec == "bg-zstd"


def test_unknown_codec_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        encode(torch.zeros(3), "zip")
