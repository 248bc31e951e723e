"""Attention and its positions: RMSNorm, rotary tables (whole heads, GLM-4.5's partial
rotation, YaRN: moe/model/rope.py), grouped-query attention (`CausalSelfAttention`, with
gpt-oss's sinks and sliding windows: moe/model/masking.py), DeepSeek-V3's multi-head latent
attention (`LatentAttention`), and the KV cache of batched greedy decoding (`KVCache`).

Shape suffixes: B batch, S sequence, D model width, H heads, Dh head width, F rotary
frequencies."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe.model.config import ModelConfig
from moe.model.masking import attention, block_masks, causal_mask, flex_attention, window_masks
from moe.model.rope import rope_frequencies, softmax_scale

# How packed rows attend (`PackedRows`): "auto" is FlexAttention with a block mask on a GPU
# (blocks of other examples skipped) and a boolean mask through scaled_dot_product_attention
# elsewhere (on 2 CPU cores the eager FlexAttention writes every score out); "flex" or
# "masked" chooses one everywhere ("flex" cannot train on a CPU: torch 2.13's FlexAttention has
# no backward there). Latent attention, and heads under 16 wide (FlexAttention's
# GPU kernel refuses them), always take the mask.
PACKED_ATTENTION = "auto"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        ) * self.weight


def rotary_tables(
    seq_len: int,
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    scaling: dict[str, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq_len, head_dim / 2); YaRN's scaled by its factor (moe/model/rope.py)."""
    inv_freq, factor = rope_frequencies(head_dim, theta, rope_type, scaling)
    angles_SF = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles_SF.cos() * factor, angles_SF.sin() * factor


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first 2 * cos.shape[-1] features of x's last dimension (all of
    them, or GLM-4.5's partial rotation); the rest pass unchanged."""
    r = 2 * cos.shape[-1]
    x1, x2 = x[..., :r].float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)


def apply_rotary(x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor) -> torch.Tensor:
    S = x_BHSDh.shape[-2]
    return rotate(x_BHSDh, cos_SF[:S], sin_SF[:S])


def rotate_at(
    x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor, pos_BS: torch.Tensor
) -> torch.Tensor:
    """Rotary angles by each token's own position (a KV cache's rows, a packed row's examples)."""
    return rotate(x_BHSDh, cos_SF[pos_BS].unsqueeze(1), sin_SF[pos_BS].unsqueeze(1))


class CausalSelfAttention(nn.Module):
    """Multi-head attention with grouped-query heads (n_kv_head key/value heads shared by
    n_head / n_kv_head query heads each), optional q/k RMSNorm and q/k/v biases. The q, k and
    v projections are one fused weight: rows [0, H*Dh) queries, then keys, then values.
    gpt-oss's options: an output bias, a `window`, sinks (moe/model/masking.py)."""

    def __init__(self, cfg: ModelConfig, window: int = 0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_width
        q_width, kv_width = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.widths = (q_width, kv_width, kv_width)
        self.qkv = nn.Linear(cfg.d_model, q_width + 2 * kv_width, bias=cfg.attn_bias)
        self.proj = nn.Linear(q_width, cfg.d_model, bias=cfg.attn_out_bias)
        self.window = window
        self.sinks = nn.Parameter(torch.zeros(cfg.n_head)) if cfg.attn_sinks else None
        self.qk_norm = cfg.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm == "head":
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm = RMSNorm(q_width, cfg.norm_eps)
            self.k_norm = RMSNorm(kv_width, cfg.norm_eps)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        Dh = self.head_dim
        q, k, v = self.qkv(x_BSD).split(self.widths, dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q = q.view(B, S, self.n_head, Dh)
        k = k.view(B, S, self.n_kv_head, Dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, S, Dh), (B, Hkv, S, Dh)
        v = v.view(B, S, self.n_kv_head, Dh).transpose(1, 2)
        if cache is None:  # training and scoring: positions 0..S-1, causal
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            y = attention(q, k, v, None, self.sinks, self.window)
        else:  # decoding: each row's own positions, keys and values appended to the cache
            q, k = cache.rotate(q, cos, sin), cache.rotate(k, cos, sin)
            k, v = cache.append(layer, k, v)
            flex = getattr(cache, "block_masks", None)
            if flex is not None:
                y = flex_attention(q, k, v, flex[self.window], self.sinks)
            else:
                mask = cache.window_masks[self.window] if self.window else cache.mask
                y = attention(q, k, v, mask, self.sinks)
        return self.proj(y.transpose(1, 2).reshape(B, S, self.n_head * Dh))


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank
    bottleneck (q_a, its RMSNorm, q_b), keys and values from one compressed latent per token
    (kv_a, its RMSNorm, kv_b) plus a rotated key part shared by every head. A query/key head
    is [un-rotated head_dim | rotated mla_rope_dim]; a value head is mla_v_dim wide. The
    latent norms use eps 1e-6, as DeepSeek's own code does.

    Attention runs through scaled_dot_product_attention on the expanded heads (the KV cache
    keeps them expanded too: decoding here is for evaluation, not serving)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        H, D = cfg.n_head, cfg.d_model
        self.n_head, self.nope, self.rope, self.v_dim = (
            H,
            cfg.head_width,
            cfg.mla_rope_dim,
            cfg.v_width,
        )
        qk = self.nope + self.rope
        self.q_rank, self.kv_rank = cfg.mla_q_rank, cfg.mla_kv_rank
        if self.q_rank:
            self.q_a = nn.Linear(D, self.q_rank, bias=False)
            self.q_norm = RMSNorm(self.q_rank, 1e-6)
            self.q_b = nn.Linear(self.q_rank, H * qk, bias=False)
        else:
            self.q = nn.Linear(D, H * qk, bias=False)
        self.kv_a = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, 1e-6)
        self.kv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.proj = nn.Linear(H * self.v_dim, D, bias=False)
        # with YaRN, DeepSeek's softmax scale grows with its mscale (moe/model/rope.py)
        self.scale = qk**-0.5 * softmax_scale(cfg.rope_type, cfg.rope_scaling)

    def forward(
        self,
        x_BSD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H, nope, rope = self.n_head, self.nope, self.rope
        q = self.q_b(self.q_norm(self.q_a(x_BSD))) if self.q_rank else self.q(x_BSD)
        q = q.view(B, S, H, nope + rope).transpose(1, 2)
        latent, k_rot = self.kv_a(x_BSD).split([self.kv_rank, rope], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(B, S, H, nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([nope, self.v_dim], dim=-1)
        k_rot = k_rot.view(B, 1, S, rope)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        if cache is None:
            q_rot, k_rot = apply_rotary(q_rot, cos, sin), apply_rotary(k_rot, cos, sin)
        else:
            q_rot, k_rot = cache.rotate(q_rot, cos, sin), cache.rotate(k_rot, cos, sin)
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(B, H, S, rope)], dim=-1)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        else:
            k, v = cache.append(layer, k, v)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=cache.mask, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, S, H * self.v_dim))


class KVCache:
    """Keys and values of every layer for batched greedy decoding of left-padded prompts.

    Row b's prompt sits at the right of a (B, L) block after pad_b pad tokens; its tokens keep
    positions 0.. (rotary angles by row), and no query attends to a pad key. A pad query
    attends to itself only, so its (unused) output stays finite."""

    def __init__(
        self, c: ModelConfig, dtype: torch.dtype, pads_B: torch.Tensor, total: int
    ) -> None:
        device = pads_B.device
        B = pads_B.numel()
        mla = c.attention == "mla"
        heads = c.n_head if mla else c.kv_heads
        k_width = c.head_width + c.mla_rope_dim if mla else c.head_width
        k_shape, v_shape = (B, heads, total, k_width), (B, heads, total, c.v_width)
        self.k = [torch.zeros(k_shape, device=device, dtype=dtype) for _ in range(c.n_layer)]
        self.v = [torch.zeros(v_shape, device=device, dtype=dtype) for _ in range(c.n_layer)]
        self.pads_B = pads_B
        self.valid_BK = torch.arange(total, device=device)[None, :] >= pads_B[:, None]
        self.length = 0  # keys cached so far
        self.pos_BS = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(B, 1, 1, 1, dtype=torch.bool, device=device)
        self.windows = {w for w in map(c.window, range(c.n_layer)) if w}

    def start(self, S: int) -> None:
        """Positions and attention mask for the next S tokens of every row."""
        device = self.pads_B.device
        t0 = self.length
        cols = torch.arange(t0, t0 + S, device=device)
        self.pos_BS = (cols[None, :] - self.pads_B[:, None]).clamp_min(0)
        keys = torch.arange(t0 + S, device=device)
        causal_SK = keys[None, :] <= cols[:, None]
        mask = causal_SK[None] & self.valid_BK[:, None, : t0 + S]
        diagonal = keys[None, None, :] == cols[None, :, None]
        self.mask = (mask | diagonal).unsqueeze(1)
        self.window_masks = window_masks(mask, diagonal, self.windows, t0)

    def rotate(
        self, x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor
    ) -> torch.Tensor:
        return rotate_at(x_BHSDh, cos_SF, sin_SF, self.pos_BS)

    def append(
        self, layer: int, k_BHSDh: torch.Tensor, v_BHSDh: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k_BHSDh.shape[2]
        self.k[layer][:, :, self.length : end] = k_BHSDh
        self.v[layer][:, :, self.length : end] = v_BHSDh
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class PackedRows:
    """Several examples in one row (packed finetuning), read by the attention layers as they
    read a KVCache: each token attends only to the tokens of its own example up to itself
    (a block-causal mask), positions restart at each example (rotary angles by token), and
    a sliding window or an attention sink acts within the example. What a row computes for an
    example is what the example alone in a row computes (tests/test_packing.py).

    `segments_BS` numbers each token's example within its row (0, 1, ...), in order; -1 marks
    the padding after the last example, which attends among itself and carries no loss."""

    def __init__(self, c: ModelConfig, segments_BS: torch.Tensor) -> None:
        S, device = segments_BS.shape[1], segments_BS.device
        idx_S = torch.arange(S, device=device)
        first_BS = torch.ones_like(segments_BS, dtype=torch.bool)
        first_BS[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
        start_BS = torch.where(first_BS, idx_S, 0).cummax(dim=1).values
        self.pos_BS = idx_S[None, :] - start_BS
        windows = {w for w in map(c.window, range(c.n_layer)) if w}
        how = PACKED_ATTENTION
        flex = how == "flex" or (how == "auto" and device.type == "cuda")
        self.block_masks = None
        # FlexAttention's block masks (moe/model/masking.py); its GPU kernel needs heads 16+ wide
        if flex and c.attention != "mla" and c.head_width >= 16:
            self.block_masks = block_masks(segments_BS, windows)
            return
        same_1BSS = (segments_BS[:, :, None] == segments_BS[:, None, :]).unsqueeze(1)
        self.mask = same_1BSS & causal_mask(S, 0, device)  # (B, 1, S, S): query, key
        self.window_masks = {w: same_1BSS & causal_mask(S, w, device) for w in windows}

    def rotate(
        self, x_BHSDh: torch.Tensor, cos_SF: torch.Tensor, sin_SF: torch.Tensor
    ) -> torch.Tensor:
        return rotate_at(x_BHSDh, cos_SF, sin_SF, self.pos_BS)

    def append(
        self, layer: int, k_BHSDh: torch.Tensor, v_BHSDh: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The row's own keys and values (nothing is cached)."""
        return k_BHSDh, v_BHSDh
