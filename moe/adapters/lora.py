"""Low-rank adapters (LoRA): a frozen weight W plus (alpha / rank) B A, B zero at the start.

Shape suffixes as in moe/model/experts.py; r is an adapter's rank.

- `LoRALinear` is the model's own nn.Linear (same `weight`, same state-dict name) with one
  adapter per output segment: the fused q/k/v projection carries three, one per projection,
  exactly as PEFT's q_proj, k_proj and v_proj adapters on a Hugging Face checkpoint.
- `ExpertLoRA` holds the routed experts' adapters as 3-D weights, one low-rank pair per
  expert and projection (gate, up, down), computed by the same grouped matrix products as the
  experts (`expert_swiglu`): no loop over experts.
- `add_adapters` freezes the base and puts adapters where a `LoraConfig` says;
  `set_router_policy` decides what the routers may move; `merge_adapters` folds the adapters
  into the base weights (the model is then the plain architecture again, as exported).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe.adapters.config import LoraConfig
from moe.adapters.nf4 import dequantize, frozen_grouped_mm, frozen_linear, is_nf4, quantize
from moe.model.attention import CausalSelfAttention, LatentAttention
from moe.model.experts import Activation, GroupedExperts, grouped_mm, rows_of
from moe.model.transformer import MoELayer, SwiGLU

ROUTER_POLICIES = ("trained", "frozen", "bias-only")


def _kaiming_a(shape: tuple[int, ...], fan_in: int, g: torch.Generator) -> torch.Tensor:
    """PEFT's init of A: kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


class LoRALinear(nn.Linear):
    """nn.Linear plus scale * B_s A_s x on each output segment s (rows of `segments` widths).

    `lora_A` is (n_segments * r, in): the segments' A matrices stacked; `lora_B` is (out, r):
    segment s's B is its rows. One matmul computes every segment's A x."""

    segments: tuple[int, ...]
    scale: float
    rank: int

    @classmethod
    def wrap(
        cls,
        base: nn.Linear,
        segments: tuple[int, ...],
        rank: int,
        scale: float,
        dropout: float,
        g: torch.Generator,
    ) -> LoRALinear:
        if sum(segments) != base.out_features:
            raise ValueError(f"segments {segments} do not add up to {base.out_features} rows")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = base.in_features, base.out_features
        new.weight, new.bias = base.weight, base.bias
        new.segments, new.rank, new.scale = tuple(segments), rank, scale
        new.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device = base.weight.device
        a = _kaiming_a((len(segments) * rank, base.in_features), base.in_features, g)
        new.lora_A = nn.Parameter(a.to(device))
        new.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=device))
        new.drawn = {"lora_A": a}
        return new

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """scale * B A x per segment, concatenated over the output."""
        a = F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype))
        B, r = self.lora_B.to(x.dtype), self.rank
        if len(self.segments) == 1:
            return F.linear(a, B) * self.scale
        parts, row = [], 0
        for s, width in enumerate(self.segments):
            parts.append(F.linear(a[..., s * r : (s + 1) * r], B[row : row + width]))
            row += width
        return torch.cat(parts, dim=-1) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_nf4(self.weight):  # QLoRA's base
            return frozen_linear(x, self.weight, self.bias) + self.delta(x)
        return super().forward(x) + self.delta(x)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """The (out, in) matrix the adapters add to the weight: scale * B_s A_s per segment."""
        r, row, rows = self.rank, 0, []
        A, B = self.lora_A.float(), self.lora_B.float()
        for s, width in enumerate(self.segments):
            rows.append(B[row : row + width] @ A[s * r : (s + 1) * r])
            row += width
        return torch.cat(rows, dim=0) * self.scale

    def merged(self) -> nn.Linear:
        """A plain nn.Linear with the adapters folded in (the same weight Parameter)."""
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None)
        with torch.no_grad():
            self.weight.add_(self.delta_weight().to(self.weight.dtype))
        out.weight, out.bias = self.weight, self.bias
        return out


class ExpertLoRA(nn.Module):
    """The routed experts' adapters, one low-rank pair per expert and weight, in the layout of
    PEFT's `target_parameters` on transformers' fused experts: the gate and up projections
    are one (D, 2F) matrix per expert whose adapter has twice the rank (PEFT's rank_pattern
    for gate_up_proj: 2r, alpha 2a, the same scale), so the gate and the up projection each
    get rank r, as two separate adapters would; the down projection has rank r.
    a13 (E, D, 2r), b13 (E, 2r, 2F); a2 (E, F, r), b2 (E, r, D)."""

    def __init__(
        self, experts: GroupedExperts, rank: int, scale: float, dropout: float, g: torch.Generator
    ) -> None:
        super().__init__()
        E, (D, G), F_ = experts.num_experts, experts.w13_EDG.shape[1:], experts.hidden
        device = experts.w13_EDG.device
        self.rank, self.scale = rank, scale
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        a13, a2 = _kaiming_a((E, D, 2 * rank), D, g), _kaiming_a((E, F_, rank), F_, g)
        self.a13 = nn.Parameter(a13.to(device))
        self.b13 = nn.Parameter(torch.zeros(E, 2 * rank, G, device=device))
        self.a2 = nn.Parameter(a2.to(device))
        self.b2 = nn.Parameter(torch.zeros(E, rank, D, device=device))
        self.drawn = {"a13": a13, "a2": a2}

    def local(self) -> tuple[torch.Tensor, ...]:
        """(a13, b13, a2, b2) as this process holds them (its experts under EP)."""
        ts = (self.a13, self.b13, self.a2, self.b2)
        return tuple(t.to_local() if hasattr(t, "to_local") else t for t in ts)

    def swiglu(
        self,
        x_AD: torch.Tensor,
        w13_EDG: torch.Tensor,
        w2_EFD: torch.Tensor,
        counts_E: torch.Tensor,
        b13_EG: torch.Tensor | None,
        b2_ED: torch.Tensor | None,
        act: Activation,
    ) -> torch.Tensor:
        """The experts' SwiGLU with these adapters (moe/model/experts.py expert_swiglu):
        h = x w13 + s x A13 B13, y = swiglu(h) w2 + s swiglu(h) A2 B2, every product grouped
        over the experts (the kernels do not grow with their number); w13 and w2 may be NF4."""
        offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
        a13, b13, a2, b2 = self.local()
        h_AG = frozen_grouped_mm(x_AD, w13_EDG, offs_E, counts_E)
        if b13_EG is not None:
            h_AG = h_AG + rows_of(b13_EG, counts_E, x_AD)
        low_Ar = grouped_mm(self.dropout(x_AD), a13, offs_E, counts_E)
        h_AG = h_AG + grouped_mm(low_Ar, b13, offs_E, counts_E) * self.scale
        g_AF = act(h_AG)
        y_AD = frozen_grouped_mm(g_AF, w2_EFD, offs_E, counts_E)
        if b2_ED is not None:
            y_AD = y_AD + rows_of(b2_ED, counts_E, x_AD)
        low = grouped_mm(self.dropout(g_AF), a2, offs_E, counts_E)
        return y_AD + grouped_mm(low, b2, offs_E, counts_E) * self.scale

    @torch.no_grad()
    def delta_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the adapters add to w13 (E, D, 2F) and w2 (E, F, D)."""
        a13, b13, a2, b2 = (t.float() for t in self.local())
        return (a13 @ b13) * self.scale, (a2 @ b2) * self.scale


# ---------------------------------------------------------------------- the whole model


@dataclass
class AdapterPlan:
    """Where adapters went: module names of the adapted projections, the expert layers, and
    the parameter counts (trainable, frozen)."""

    linears: list[str]
    expert_layers: list[str]
    trainable: int
    frozen: int


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def attention_segments(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """An attention module's adapted projections and their output segments: q/k/v (one
    segment each, on the fused projection) and the output; for latent attention (DeepSeek-V3)
    every projection, as PEFT's adapters on q_a/q_b (or q), kv_a, kv_b and o_proj."""
    if isinstance(module, CausalSelfAttention):
        return {"qkv": module.widths, "proj": (module.proj.out_features,)}
    names = ["q_a", "q_b"] if module.q_rank else ["q"]
    names += ["kv_a", "kv_b", "proj"]
    return {n: (getattr(module, n).out_features,) for n in names}


def expert_rank(lcfg: LoraConfig, num_experts: int) -> int:
    """The routed experts' per-expert rank under `lora.expert_rank`."""
    return lcfg.rank if lcfg.expert_rank == "same" else max(1, lcfg.rank // num_experts)


def add_adapters(model: nn.Module, lcfg: LoraConfig, seed: int) -> AdapterPlan:
    """Freeze every parameter, then add adapters to the targets of `lcfg` (their A drawn from
    a generator of `seed`, so every rank and every retry draws the same). Embeddings and the
    output head train only when asked; the routers follow `set_router_policy`."""
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    scale = lcfg.alpha / lcfg.rank
    t = lcfg.targets
    linears: list[str] = []
    experts: list[str] = []
    for name, module in list(model.named_modules()):
        if isinstance(module, (CausalSelfAttention, LatentAttention)) and t.attention:
            wanted = attention_segments(module)
        elif isinstance(module, SwiGLU):
            shared = name.endswith(".shared")
            if not (t.shared_expert if shared else t.mlp):
                continue
            wanted = {n: (getattr(module, n).out_features,) for n in ("w1", "w3", "w2")}
        elif isinstance(module, MoELayer) and t.experts:
            ex = module.experts
            r = expert_rank(lcfg, ex.num_experts)
            ex.lora = ExpertLoRA(ex, r, lcfg.alpha / r, lcfg.dropout, g)
            experts.append(f"{name}.experts")
            continue
        else:
            continue
        for child, segments in wanted.items():
            base = getattr(module, child)
            setattr(
                module,
                child,
                LoRALinear.wrap(base, segments, lcfg.rank, scale, lcfg.dropout, g),
            )
            linears.append(f"{name}.{child}")
    # What each adapter was drawn with: a model sharded on the meta device (torchrun) fills
    # its adapters' shards from these after reading the base (moe/train/distributed.py).
    model.adapter_init = {}
    for name, module in model.named_modules():
        if isinstance(module, (LoRALinear, ExpertLoRA)):
            for pname, p in module.named_parameters(recurse=False):
                if pname in ("weight", "bias"):  # a LoRALinear's base
                    continue
                drawn = module.drawn.get(pname)
                full = drawn if drawn is not None else torch.zeros(p.shape)
                model.adapter_init[f"{name}.{pname}"] = full
    if lcfg.train_embeddings:
        model.embed.weight.requires_grad_(True)
    if lcfg.train_head:
        model.lm_head.weight.requires_grad_(True)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return AdapterPlan(linears, experts, trainable, frozen)


def adapter_counts(model: nn.Module, lcfg: LoraConfig) -> tuple[int, int]:
    """(adapter parameters, base weights they adapt) that `add_adapters` would add to
    `model`, computed from its shapes alone (a model on the meta device: nothing drawn)."""
    t = lcfg.targets
    adapters = adapted = 0
    for name, module in model.named_modules():
        linears: list[tuple[nn.Linear, int]] = []
        if isinstance(module, (CausalSelfAttention, LatentAttention)) and t.attention:
            segments = attention_segments(module)
            linears = [(getattr(module, n), len(w)) for n, w in segments.items()]
        elif isinstance(module, SwiGLU):
            if t.shared_expert if name.endswith(".shared") else t.mlp:
                linears = [(getattr(module, n), 1) for n in ("w1", "w3", "w2")]
        elif isinstance(module, MoELayer) and t.experts:
            ex = module.experts
            r = expert_rank(lcfg, ex.num_experts)
            D, G = ex.w13_EDG.shape[1:]
            adapters += ex.num_experts * (2 * r * (D + G) + r * (ex.hidden + D))
            adapted += ex.w13_EDG.numel() + ex.w2_EFD.numel()
        for lin, segments in linears:
            adapters += lcfg.rank * (segments * lin.in_features + lin.out_features)
            adapted += lin.weight.numel()
    return adapters, adapted


def set_router_policy(model: nn.Module, policy: str) -> None:
    """ "trained": gate weights learn and the routing state moves; "frozen": neither;
    "bias-only": the gates stay, the aux-free bias (and utilisation average) still move."""
    if policy not in ROUTER_POLICIES:
        raise ValueError(f"router policy {policy!r}: expected one of {', '.join(ROUTER_POLICIES)}")
    for layer in getattr(model, "moe_layers", []):
        layer.router.policy = policy
        layer.router.gate.weight.requires_grad_(policy == "trained")


def has_adapters(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRALinear, ExpertLoRA)) for m in model.modules())


def _is_adapter(name: str) -> bool:
    return ".lora_A" in name or ".lora_B" in name or ".lora." in name


def adapter_names(model: nn.Module) -> set[str]:
    """State-dict names of the adapter parameters."""
    return {n for n, _ in model.named_parameters() if _is_adapter(n)}


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight, in place, and remove it: the model is the
    plain architecture again, with the adapted model's outputs (up to float rounding)."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _swap(model, name, module.merged())
        elif isinstance(module, GroupedExperts) and getattr(module, "lora", None) is not None:
            d13, d2 = module.lora.delta_weights()
            module.w13_EDG.add_(d13.to(module.w13_EDG.dtype))
            module.w2_EFD.add_(d2.to(module.w2_EFD.dtype))
            module.lora = None
    if hasattr(model, "adapter_init"):
        del model.adapter_init


def quantize_base(model: nn.Module, block: int) -> int:
    """QLoRA: every adapted projection's and every adapted expert layer's frozen weight to
    NF4 (embeddings, head, norms and routers stay as they are). Returns the weights
    quantised."""
    n = 0
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight = quantize(module.weight, block)
            n += 1
        elif isinstance(module, GroupedExperts) and module.lora is not None:
            module.w13_EDG = quantize(module.w13_EDG, block)
            module.w2_EFD = quantize(module.w2_EFD, block)
            n += 2
    return n


def _frozen_bases(model: nn.Module) -> Iterator[tuple[nn.Module, str]]:
    """(module, attribute) of every adapted projection's and adapted expert layer's frozen
    weight."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            yield module, "weight"
        elif isinstance(module, GroupedExperts) and module.lora is not None:
            yield module, "w13_EDG"
            yield module, "w2_EFD"


@torch.no_grad()
def hold_base_in(model: nn.Module, dtype: torch.dtype) -> int:
    """LoRA on a GPU: the adapted projections' frozen weights held in `dtype` (bf16: 2 bytes
    a weight, as PEFT, torchtune and Unsloth hold a frozen base), the adapters, embeddings,
    head, norms and routers as they are (fp32). Under autocast every product over them is
    computed in bf16 anyway: this drops the fp32 copy and the cast of each step. Returns the
    bytes freed."""
    freed = 0
    for module, name in _frozen_bases(model):
        w = getattr(module, name)
        if is_nf4(w) or w.dtype == dtype:
            continue
        freed += w.numel() * (w.element_size() - torch.empty((), dtype=dtype).element_size())
        setattr(module, name, nn.Parameter(w.to(dtype), requires_grad=False))
    return freed


@torch.no_grad()
def dequantize_base(model: nn.Module) -> None:
    """The NF4 (QLoRA) or bf16 (LoRA on a GPU) frozen weights back to fp32 ones, before a
    merge: the adapters trained on these values, and the merge adds to them in fp32."""
    for module in model.modules():
        if isinstance(module, LoRALinear) and is_nf4(module.weight):
            module.weight = nn.Parameter(dequantize(module.weight), requires_grad=False)
        elif isinstance(module, GroupedExperts):
            E = module.num_experts
            for name in ("w13_EDG", "w2_EFD"):
                w = getattr(module, name)
                if is_nf4(w):
                    shape = (E, w.shape[0] // E, w.shape[1])
                    setattr(module, name, nn.Parameter(dequantize(w, shape), requires_grad=False))
    for module, name in _frozen_bases(model):
        w = getattr(module, name)
        if w.dtype != torch.float32:
            setattr(module, name, nn.Parameter(w.float(), requires_grad=False))
