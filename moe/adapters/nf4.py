"""QLoRA's frozen base in 4-bit NF4: torchao's NF4Tensor (the QLoRA paper's NormalFloat-4
with double quantisation: blocks of `block` weights share an absmax scale, and those scales
are themselves quantised to int8 in blocks of 256). torchao runs on the CPU and on CUDA
with plain PyTorch ops, the same tensor torchtune's QLoRA uses; bitsandbytes' CPU backend
was not one we could rely on here (../shared/STACK.md).

A quantised weight is dequantised per layer in the forward (to the compute dtype) and again
in the backward, which needs it only for the input's gradient: nothing full-size is kept
between them. Expert weights (E, D, F) are quantised as their 2-D (E*D, F) view.
"""

from __future__ import annotations

import importlib
import logging
import math
import sys
from typing import Any

import torch
import torch.nn.functional as F

from moe.model.experts import grouped_mm

SCALER_BLOCK = 256  # torchao's (and the QLoRA paper's) block of the double quantisation
# torchao costs ~4 s to import here: it is imported when a base is quantised, and until then
# no tensor can be NF4.
_NF4 = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def _torchao_nf4() -> Any:
    # Its CUDA kernels fail to load on a CPU-only torch with a warning each, and it registers
    # an enum torch warns about; NF4 needs neither.
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.ERROR)
    try:
        return importlib.import_module(_NF4)
    finally:
        for q, level in zip(quiet, levels, strict=True):
            q.setLevel(level)


def is_nf4(t: torch.Tensor) -> bool:
    nf4 = sys.modules.get(_NF4)
    return nf4 is not None and isinstance(t, nf4.NF4Tensor)


def quantize(t: torch.Tensor, block: int) -> torch.nn.Parameter:
    """A frozen weight as NF4, 2-D (3-D expert weights flattened over their first two
    dimensions). The scales are quantised in groups of 256 blocks, or of the largest power of
    two that divides the block count (a small weight). Refused when the weight's size is not
    a multiple of the block."""
    flat = t.detach().reshape(-1, t.shape[-1]).contiguous()
    if flat.numel() % block:
        raise ValueError(
            f"a weight of shape {tuple(t.shape)} does not split into NF4 blocks of {block}: "
            "pick a lora.nf4_block that divides every adapted weight's size"
        )
    scaler_block = math.gcd(flat.numel() // block, SCALER_BLOCK)
    nf4 = _torchao_nf4().to_nf4(flat, block, scaler_block)
    return torch.nn.Parameter(nf4, requires_grad=False)


def dequantize(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """The weight back in its dtype (and `shape`); a plain tensor is returned as it is."""
    if not is_nf4(t):
        return t
    dense = t.get_original_weight()
    return dense.view(shape) if shape is not None else dense


class _NF4Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.w = w  # the NF4 weight itself (no gradient), dequantised again in the backward
        return F.linear(x, dequantize(w).to(x.dtype))

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return g @ dequantize(ctx.w).to(g.dtype), None


def frozen_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over a weight that may be NF4."""
    y = _NF4Linear.apply(x, w) if is_nf4(w) else F.linear(x, w.to(x.dtype))
    return y if bias is None else y + bias.to(y.dtype)


class _NF4GroupedMM(torch.autograd.Function):
    """grouped_mm over a frozen NF4 expert weight: dequantised for the product and again for
    the input's gradient, never kept in between."""

    @staticmethod
    def forward(ctx, x_AD, w, offs_E, counts_E, shape):  # type: ignore[override]
        ctx.w, ctx.shape = w, shape
        ctx.save_for_backward(offs_E, counts_E)
        return grouped_mm(x_AD, dequantize(w, shape), offs_E, counts_E)

    @staticmethod
    def backward(ctx, g_AF):  # type: ignore[override]
        offs_E, counts_E = ctx.saved_tensors
        w_EFD = dequantize(ctx.w, ctx.shape).transpose(1, 2).contiguous()
        return grouped_mm(g_AF.contiguous(), w_EFD, offs_E, counts_E), None, None, None, None


def frozen_grouped_mm(
    x_AD: torch.Tensor, w: torch.Tensor, offs_E: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """The experts' grouped product over a frozen weight that may be NF4 ((E*D, F) stored)."""
    if not is_nf4(w):
        return grouped_mm(x_AD, w, offs_E, counts_E)
    shape = (counts_E.numel(), w.shape[0] // counts_E.numel(), w.shape[1])
    return _NF4GroupedMM.apply(x_AD, w, offs_E, counts_E, shape)
