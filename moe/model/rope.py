"""RoPE scaling: YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large
Language Models"), as Hugging Face checkpoints configure it (gpt-oss, DeepSeek-V3).

`yarn_parameters` is transformers' `_compute_yarn_parameters` (modeling_rope_utils.py) in
the same operations, so that the rotary tables are the same floats without transformers
being needed at run time (tests/test_hf.py holds the two equal). It imports nothing of ours;
the keys ModelConfig.rope_scaling may hold are checked in moe/model/config.py (YARN_KEYS).

- Each frequency band is interpolated (divided by `factor`), kept (extrapolated) or blended
  linearly between the two, by how many rotations it makes over the original context
  (`original_max_position_embeddings`): fewer than `beta_slow` interpolated, more than
  `beta_fast` kept.
- cos and sin are multiplied by `attention_factor` (default 0.1 ln(factor) + 1, or
  DeepSeek's mscale ratio), which scales every attention score by its square.
"""

from __future__ import annotations

import math

import torch


def _mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(
    head_dim: int, theta: float, scaling: dict[str, float]
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,), attention factor) of YaRN."""
    dim = head_dim
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_mscale(factor, mscale) / _mscale(factor, mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1
    truncate = bool(scaling.get("truncate", 1.0))

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # the share of each band kept as it is
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq, float(attention_factor)


def rope_frequencies(
    head_dim: int, theta: float, rope_type: str = "default", scaling: dict[str, float] | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, factor on cos and sin) of plain RoPE (factor 1) or YaRN."""
    if rope_type == "yarn":
        return yarn_parameters(head_dim, theta, scaling or {})
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0


def softmax_scale(rope_type: str, scaling: dict[str, float]) -> float:
    """What DeepSeek's YaRN multiplies the attention's softmax scale by: mscale(factor,
    mscale_all_dim) squared (DeepSeek-V2/V3's modeling, transformers' yarn_apply_mscale); 1
    without YaRN or without mscale_all_dim."""
    if rope_type != "yarn" or not scaling.get("mscale_all_dim"):
        return 1.0
    m = _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
    return m * m
