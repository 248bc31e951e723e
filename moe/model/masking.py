"""Attention beyond plain causal (gpt-oss's): sliding-window masks, in training and in the
KV cache, and attention sinks (a learned logit per head in the softmax's denominator).

A sink is computed by the fused scaled_dot_product_attention, not a softmax written out:
one more key and value of zeros in front, whose additive mask is the head's sink (its score
is q.0 = 0 plus the sink; its value adds nothing). Measured on 2 CPU cores (B 8, H 4, S 192,
Dh 32, GQA 2): ~1.2x faster than the written-out softmax forward and backward, ~2.5x in the
forward alone, with the sinks' gradients through the mask; equal to it within fp32 rounding.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def causal_mask(
    S: int, window: int, device: torch.device | None = None, offset: int = 0
) -> torch.Tensor:
    """(S, offset + S) bool: query i (at position offset + i) sees key j when j <= offset + i
    and, with a window, offset + i - j < window (itself and window - 1 tokens before it, as
    transformers' sliding_window_overlay)."""
    q = torch.arange(offset, offset + S, device=device)[:, None]
    k = torch.arange(offset + S, device=device)[None, :]
    allowed = k <= q
    if window:
        allowed = allowed & (q - k < window)
    return allowed


def window_masks(
    mask_BSK: torch.Tensor, diagonal_BSK: torch.Tensor, windows: set[int], t0: int
) -> dict[int, torch.Tensor]:
    """The KV cache's mask (B, 1, S, K) for each window width: its causal mask of valid keys
    within the window, or the query itself (a pad query). A window counts cache slots, which
    are positions: a row's pads precede its tokens."""
    S = mask_BSK.shape[1]
    out = {}
    for w in windows:
        near = causal_mask(S, w, mask_BSK.device, offset=t0)
        out[w] = ((mask_BSK & near[None]) | diagonal_BSK).unsqueeze(1)
    return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    sinks: torch.Tensor | None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of q (B, H, S, Dh) over k, v (B, Hkv, K, Dh) where `allowed` (bool,
    broadcast to (B, H, S, K)) is true, with the heads' `sinks` (H,) when given. `allowed`
    None: causal over positions 0..S-1 (training), within `window` when one is given."""
    gqa = k.shape[1] != q.shape[1]
    if allowed is None and sinks is None and not window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if allowed is None:
        allowed = causal_mask(q.shape[2], window, q.device)[None, None]
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=gqa)
    zero = k.new_zeros(*k.shape[:2], 1, k.shape[3])
    k, v = torch.cat([zero, k], dim=2), torch.cat([zero, v], dim=2)
    Bm, H, S, K = allowed.shape[0], q.shape[1], allowed.shape[2], allowed.shape[3]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, float("-inf")).expand(Bm, H, S, K)
    sink = sinks.to(q.dtype).view(1, H, 1, 1).expand(Bm, H, S, 1)
    mask = torch.cat([sink, bias], dim=-1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


# --------------------------------------------------------------------------- FlexAttention


@functools.cache
def _flex(device_type: str) -> Callable[..., Any]:
    """FlexAttention, compiled on a GPU (its fused kernel); on a CPU the eager one, which
    writes the scores out (tests compare it with the masked path)."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type == "cpu":
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return flex_attention
    return torch.compile(flex_attention, dynamic=False)


def block_masks(segments_BS: torch.Tensor, windows: set[int]) -> dict[int, Any]:
    """FlexAttention's block masks for rows that pack examples (`segments_BS`: each token's
    example, -1 for the padding after them): a token sees the tokens of its own example up
    to itself, within a window where one is given (the key 0: none). Blocks no query of a
    block may see are skipped: the cost grows with the examples' lengths, not the row's."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, S = segments_BS.shape
    seg = segments_BS

    def make(w: int) -> Any:
        def allowed(b: Any, h: Any, q: Any, k: Any) -> Any:
            ok = (seg[b, q] == seg[b, k]) & (k <= q)
            return ok & (q - k < w) if w else ok

        return create_block_mask(allowed, B, None, S, S, device=seg.device)

    return {w: make(w) for w in {0, *windows}}


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Attention of q (B, H, S, Dh) over k, v (B, Hkv, S, Dh) under a FlexAttention block
    mask, with the heads' `sinks` (H,): a sink's logit joins each softmax's denominator, so
    the output is scaled by sum / (sum + e^sink) = sigmoid(lse - sink), lse the log of the
    sum over the keys seen (FlexAttention returns it)."""
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as plain

    # Inside a compiled model (`compile: true`) the plain function: the compiler lowers it to
    # the fused kernel itself, where a compiled function called in there breaks the graph.
    flex = plain if torch.compiler.is_compiling() else _flex(q.device.type)
    gqa = k.shape[1] != q.shape[1]
    if sinks is None:
        return flex(q, k, v, block_mask=mask, enable_gqa=gqa)
    y, aux = flex(q, k, v, block_mask=mask, enable_gqa=gqa, return_aux=AuxRequest(lse=True))
    keep = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype).view(1, -1, 1))
    return y * keep.unsqueeze(-1).to(y.dtype)
