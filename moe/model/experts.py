"""SwiGLU experts stored as 3-D weights, computed with sort-based dispatch + grouped GEMM.

Shape suffixes: T tokens, D model width, F expert hidden width, E experts, K choices per
token, A = T*K assignments (after capacity drops: the kept ones).

`GroupedExperts.forward` sorts assignments by expert and runs the three projections as
grouped matrix multiplications through one seam, `grouped_mm`, which faster kernels replace.
`reference_moe` beside it is the slow, obviously-right loop over experts that the tests hold
the fast path equal to (outputs and gradients).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe.model.config import MoEConfig
from moe.model.routing import count_per_expert


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch's CPU grouped_mm backward rejects expanded (stride-0) gradients, e.g. from .sum().
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g.contiguous()


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over the fused (A, 2F) projection, without the concatenation that
    autograd's chunk backward does: the gradient is written straight into one (A, 2F) buffer.
    Measured on 2 CPU cores at 16384 x 512: ~15% faster forward + backward than
    `F.silu(g) * u` on chunks, bit-identical results (bench/RESULTS.md)."""

    @staticmethod
    def forward(ctx, h_AG: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        gate_AF, up_AF = h_AG.chunk(2, dim=-1)
        silu_AF = F.silu(gate_AF)
        ctx.save_for_backward(h_AG, silu_AF)
        return silu_AF * up_AF

    @staticmethod
    def backward(ctx, grad_AF: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h_AG, silu_AF = ctx.saved_tensors
        gate_AF, up_AF = h_AG.chunk(2, dim=-1)
        grad_AG = torch.empty_like(h_AG)
        d_gate_AF, d_up_AF = grad_AG.chunk(2, dim=-1)
        torch.mul(grad_AF, silu_AF, out=d_up_AF)
        torch.ops.aten.silu_backward.grad_input(grad_AF * up_AF, gate_AF, grad_input=d_gate_AF)
        return grad_AG


def swiglu(h_AG: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dimension."""
    return _SwiGLU.apply(h_AG)


def clamped_swiglu(h_AG: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation (transformers' GptOssExperts._apply_gate) on [gate | up] halves:
    the gate clamped above at `limit`, the up to [-limit, limit], then
    gate * sigmoid(alpha * gate) * (up + 1)."""
    gate_AF, up_AF = h_AG.chunk(2, dim=-1)
    gate_AF = gate_AF.clamp(max=limit)
    up_AF = up_AF.clamp(min=-limit, max=limit)
    return (up_AF + 1) * (gate_AF * torch.sigmoid(gate_AF * alpha))


@dataclass(frozen=True)
class Activation:
    """The experts' activation (MoEConfig.activation, act_alpha, act_limit)."""

    kind: str = "swiglu"
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, h_AG: torch.Tensor) -> torch.Tensor:
        if self.kind == "clamped_swiglu":
            return clamped_swiglu(h_AG, self.alpha, self.limit)
        return swiglu(h_AG)


SWIGLU = Activation()
# The names of the experts' optional biases (MoEConfig.expert_proj_bias): zero at init.
EXPERT_BIASES = ("b13_EG", "b2_ED")


# Why a call took the slow loop, each said once per process (a 6x slower step must not be silent).
_WARNED: set[str] = set()


def _fallback_reason(x: torch.Tensor) -> str | None:
    """Why F.grouped_mm cannot take this input (None: it can)."""
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no F.grouped_mm"
    if x.is_cuda:
        major = torch.cuda.get_device_capability(x.device)[0]
        if major < 8:
            return f"the GPU's compute capability {major}.x is below 8.0 (the kernel's floor)"
        if x.dtype != torch.bfloat16:
            return f"{x.dtype} input on CUDA: its kernel takes bf16 (train with dtype: auto)"
    return None


# The reason per (device type, dtype), worked out once: a compiled block then reads a
# constant instead of tracing the capability query (prepare_compile fills it in first).
_REASONS: dict[tuple[str, torch.dtype], str | None] = {}


def fallback_reason(x: torch.Tensor) -> str | None:
    """_fallback_reason, once per device type and dtype."""
    key = (x.device.type, x.dtype)
    if key not in _REASONS:
        _REASONS[key] = _fallback_reason(x)
    return _REASONS[key]


def _aligned(x_AD: torch.Tensor, w_EDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Zero-pad the inner (D) and output (F) widths to the kernel's 16-byte rows: the product
    is unchanged (the padded columns are sliced off), and no count is read on the host.
    Returns the padded operands and the true output width."""
    step = 16 // x_AD.element_size()
    D, F_ = w_EDF.shape[1:]
    pad_d, pad_f = -D % step, -F_ % step
    if pad_d:
        x_AD = F.pad(x_AD, (0, pad_d))
    if pad_d or pad_f:
        w_EDF = F.pad(w_EDF, (0, pad_f, 0, pad_d))
    return x_AD, w_EDF, F_


def _grouped_mm_fp32(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return F.grouped_mm(x, w, offs=offs)


# F.grouped_mm outside torch.compile: its compiled form (the meta kernel) takes bf16 only,
# while the CPU's kernel also takes fp32 (`compile: true` then breaks the graph here).
# `torch.compiler.disable` imports torch._dynamo (a second on a CPU): it is applied by
# `prepare_compile`, before anything is compiled, not when this module is imported (the CLI's
# `params check` and `plan` build the model on the meta device and compile nothing).
_grouped_mm_uncompiled = _grouped_mm_fp32


def prepare_compile(device: torch.device | str = "cpu") -> None:
    """Keep the fp32 grouped product out of what torch.compile traces, and work out on
    `device` whether the kernel runs (call before compiling a block that holds experts)."""
    global _grouped_mm_uncompiled
    if _grouped_mm_uncompiled is _grouped_mm_fp32:
        _grouped_mm_uncompiled = torch.compiler.disable(_grouped_mm_fp32)
    for dtype in (torch.bfloat16, torch.float32):
        fallback_reason(torch.empty(0, device=device, dtype=dtype))


def grouped_mm(
    x_AD: torch.Tensor, w_EDF: torch.Tensor, offs_E: torch.Tensor, counts_E: torch.Tensor
) -> torch.Tensor:
    """Row block e of x_AD (rows offs[e-1]:offs[e]) times w_EDF[e]. The one compute seam.

    Under autocast both operands are cast to its dtype first (F.grouped_mm has no autocast
    rule of its own: an fp32 input would miss the CUDA kernel, which takes bf16 only).
    Widths that are not a multiple of 16 bytes are zero-padded for the kernel. Only where
    the kernel cannot run at all (no F.grouped_mm, fp32 on CUDA outside autocast, a GPU
    below SM80) does it loop over the experts, reading their counts on the host (a sync),
    and it says so once, with the reason."""
    device = x_AD.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x_AD = x_AD.to(dtype)
    w_EDF = w_EDF.to(x_AD.dtype)
    reason = fallback_reason(x_AD)
    if reason is None:
        x_AD, w_EDF, width = _aligned(x_AD, w_EDF)
        product = F.grouped_mm if x_AD.dtype == torch.bfloat16 else _grouped_mm_uncompiled
        y_AF = _ContiguousGrad.apply(product(x_AD, w_EDF, offs=offs_E))
        return y_AF if y_AF.shape[-1] == width else y_AF[..., :width]
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(
            f"grouped_mm falls back to a loop over the experts with a host sync per call "
            f"(several times slower): {reason}",
            RuntimeWarning,
            stacklevel=2,
        )
    chunks = torch.split(x_AD, counts_E.tolist())
    return torch.cat([c @ w_EDF[e] for e, c in enumerate(chunks)], dim=0)


def rows_of(b_EX: torch.Tensor, counts_E: torch.Tensor, x_AD: torch.Tensor) -> torch.Tensor:
    """Each expert's bias row repeated for its rows (sorted by expert): (A, X), no host sync."""
    b_EX = b_EX.to(x_AD.dtype)
    return b_EX.repeat_interleave(counts_E, dim=0, output_size=x_AD.shape[0])


def expert_swiglu(
    x_AD: torch.Tensor,
    w13_EDG: torch.Tensor,
    w2_EFD: torch.Tensor,
    counts_E: torch.Tensor,
    lora: Any = None,
    b13_EG: torch.Tensor | None = None,
    b2_ED: torch.Tensor | None = None,
    act: Activation = SWIGLU,
) -> torch.Tensor:
    """The experts' SwiGLU on rows sorted by expert: h = x w13, y = swiglu(h) w2, each
    product grouped over the experts. With biases (gpt-oss) each row's expert's b13 is added
    to h and b2 to y; `act` may be the clamped SwiGLU. `lora`: the experts' adapters
    (moe/adapters/lora.py ExpertLoRA), which then compute the layer with theirs, over a
    base that may be NF4 (QLoRA)."""
    if lora is not None:
        return lora.swiglu(x_AD, w13_EDG, w2_EFD, counts_E, b13_EG, b2_ED, act)
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    h_AG = grouped_mm(x_AD, w13_EDG, offs_E, counts_E)
    if b13_EG is not None:
        h_AG = h_AG + rows_of(b13_EG, counts_E, x_AD)
    y_AD = grouped_mm(act(h_AG), w2_EFD, offs_E, counts_E)
    if b2_ED is not None:
        y_AD = y_AD + rows_of(b2_ED, counts_E, x_AD)
    return y_AD


class GroupedExperts(nn.Module):
    """SwiGLU experts. The gate and up projections are one (E, D, 2F) weight, so one grouped
    GEMM computes both (HF and torchtitan store them the same way). `lora`: the experts'
    adapters when a stage trains with LoRA (moe/adapters/lora.py ExpertLoRA). With `bias`
    (gpt-oss) a bias per expert on the gate/up (E, 2F) and down (E, D) projections; `act`
    is the activation (the clamped SwiGLU for gpt-oss)."""

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        bias: bool = False,
        act: Activation = SWIGLU,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden = num_experts, hidden
        self.lora: nn.Module | None = None
        self.act = act
        self.w13_EDG = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))  # G = 2F
        self.w2_EFD = nn.Parameter(torch.empty(num_experts, hidden, d_model))  # down proj
        self.b13_EG: nn.Parameter | None = None
        self.b2_ED: nn.Parameter | None = None
        if bias:
            self.b13_EG = nn.Parameter(torch.zeros(num_experts, 2 * hidden))
            self.b2_ED = nn.Parameter(torch.zeros(num_experts, d_model))

    @classmethod
    def for_config(cls, d_model: int, mcfg: MoEConfig) -> GroupedExperts:
        """The experts MoEConfig describes (width, biases, activation)."""
        act = Activation(mcfg.activation, mcfg.act_alpha, mcfg.act_limit)
        return cls(mcfg.num_experts, d_model, mcfg.expert_hidden, mcfg.expert_proj_bias, act)

    def weights_EDF(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate (E, D, F), up (E, D, F), down (E, F, D)) as views."""
        F_ = self.hidden
        return self.w13_EDG[..., :F_], self.w13_EDG[..., F_:], self.w2_EFD

    def forward(
        self,
        x_TD: torch.Tensor,
        experts_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        keep_TK: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T, K = experts_TK.shape
        expert_A = experts_TK.flatten()
        slot_A: torch.Tensor | None = None  # flat (token, choice) slot of each kept assignment
        if keep_TK is not None:
            # Capacity drops: boolean indexing syncs with the host on GPU; dropless mode
            # never takes this branch.
            slot_A = keep_TK.flatten().nonzero().squeeze(1)
            expert_A = expert_A[slot_A]
        order_A = torch.sort(expert_A, stable=True).indices
        if slot_A is not None:
            order_A = slot_A[order_A]
        counts_E = count_per_expert(expert_A, self.num_experts)

        y_AD = self.compute(x_TD[order_A // K], counts_E)
        # Combine in fp32 (summing K bf16 products loses bits the residual stream keeps):
        # put each result back in its (token, choice) slot, then one batched (1 x K) @ (K x D)
        # product per token weights and sums them.
        y_SD = (
            y_AD.new_zeros(T * K, y_AD.shape[1]) if slot_A is not None else torch.empty_like(y_AD)
        )
        y_SD.index_copy_(0, order_A, y_AD)
        out_T1D = torch.bmm(weights_TK.float().unsqueeze(1), y_SD.view(T, K, -1).float())
        return out_T1D.squeeze(1).to(x_TD.dtype)

    def compute(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts on rows sorted by expert (counts_E rows each): the seam that expert
        parallelism (moe/train/distributed.py) replaces with an exchange around the same math."""
        return expert_swiglu(
            x_AD, self.w13_EDG, self.w2_EFD, counts_E, self.lora, self.b13_EG, self.b2_ED, self.act
        )


def reference_moe(
    experts: GroupedExperts,
    x_TD: torch.Tensor,
    experts_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    keep_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slow, obviously-right MoE: for each token, for each kept choice, run that expert."""
    w1, w3, w2 = experts.weights_EDF()
    # biases and activation as GroupedExperts has them (a duck-typed twin may have neither)
    b13, b2 = getattr(experts, "b13_EG", None), getattr(experts, "b2_ED", None)
    act = getattr(experts, "act", SWIGLU)
    out_TD = torch.zeros(x_TD.shape, dtype=torch.float32, device=x_TD.device)
    for e in range(experts.num_experts):
        for k in range(experts_TK.shape[1]):
            mask_T = experts_TK[:, k] == e
            if keep_TK is not None:
                mask_T = mask_T & keep_TK[:, k]
            if not mask_T.any():
                continue
            x = x_TD[mask_T]
            gate, up = x @ w1[e].to(x.dtype), x @ w3[e].to(x.dtype)
            if b13 is not None:
                b_gate, b_up = b13[e].to(x.dtype).chunk(2)
                gate, up = gate + b_gate, up + b_up
            if act.kind == "clamped_swiglu":
                limit = act.limit
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                h = gate * torch.sigmoid(act.alpha * gate) * (up + 1)
            else:
                h = F.silu(gate) * up
            y = h @ w2[e].to(x.dtype)
            if b2 is not None:
                y = y + b2[e].to(x.dtype)
            out_TD[mask_T] += y.float() * weights_TK[mask_T, k].unsqueeze(1)
    return out_TD.to(x_TD.dtype)
