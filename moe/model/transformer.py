"""Decoder-only transformer with Mixture-of-Experts feed-forward blocks.

Shape suffixes: B batch, S sequence, D model width, H heads, Dh head width, V vocabulary,
T = B*S flattened tokens, E experts.

RMSNorm, rotary positions, causal attention (grouped-query or DeepSeek-V3's latent
attention, moe/model/attention.py) through scaled_dot_product_attention, and a SwiGLU
feed-forward that is an MoE layer in every `moe_every`-th block (dense otherwise).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from moe.model.attention import (
    CausalSelfAttention,
    KVCache,
    LatentAttention,
    PackedRows,
    RMSNorm,
    rotary_tables,
)
from moe.model.config import ModelConfig, MoEConfig
from moe.model.experts import EXPERT_BIASES, GroupedExperts
from moe.model.routing import Router, recompute_context, recomputing


@dataclass
class MoEAux:
    """What the MoE layers report from one forward pass."""

    balance_loss: torch.Tensor  # sum over MoE layers of the enabled balancing losses (scaled)
    aux_loss: torch.Tensor  # sum over MoE layers, unscaled (for logging)
    z_loss: torch.Tensor
    tokens_per_expert: list[torch.Tensor] = field(default_factory=list)  # per MoE layer, (E,)
    dropped_fraction: list[torch.Tensor] = field(default_factory=list)


# The positions through the output head in a loss-only forward, a multiple of this.
LOSS_ROW_BUCKET = 64


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _CarryLoss(torch.autograd.Function):
    """Identity on a layer's output whose backward also gives the layer's balancing loss its
    gradient (`scale`, the weight of that loss in the objective). Sharded training needs the
    loss to enter the backward through the block's output: FSDP reduces a block's gradients
    once the backward has left it, and a loss added beside the output would reach the
    block's parameters only after that (DeepSeek-V2's AddAuxiliaryLoss does the same)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale, ctx.like = scale, (loss.dtype, loss.device)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        dtype, device = ctx.like
        return g, torch.full((), ctx.scale, dtype=dtype, device=device), None


def _checkpoint_contexts() -> tuple[
    contextlib.AbstractContextManager, contextlib.AbstractContextManager
]:
    return contextlib.nullcontext(), recompute_context()


class MoELayer(nn.Module):
    # None: the balancing loss is returned in MoEAux for the caller's objective. A float: its
    # gradient is carried through this layer's output with that weight (sharded training),
    # and MoEAux holds its value only.
    aux_grad_scale: float | None = None

    def __init__(self, d_model: int, mcfg: MoEConfig) -> None:
        super().__init__()
        self.router = Router(d_model, mcfg)
        self.experts = GroupedExperts.for_config(d_model, mcfg)
        shared_hidden = mcfg.shared_expert_hidden or mcfg.expert_hidden
        self.shared = SwiGLU(d_model, shared_hidden) if mcfg.shared_expert else None
        # Qwen2-MoE: the shared expert's output times sigmoid(x . g), one scalar per token.
        self.shared_gate = (
            nn.Linear(d_model, 1, bias=False)
            if mcfg.shared_expert and mcfg.shared_expert_gate
            else None
        )

    def forward(self, x_BSD: torch.Tensor, aux: MoEAux) -> torch.Tensor:
        B, S, D = x_BSD.shape
        x_TD = x_BSD.reshape(B * S, D)
        r = self.router(x_TD)
        y_TD = self.experts(x_TD, r.experts_TK, r.weights_TK, r.keep_TK)
        if self.shared is not None:
            shared_TD = self.shared(x_TD)
            if self.shared_gate is not None:
                shared_TD = torch.sigmoid(self.shared_gate(x_TD)) * shared_TD
            y_TD = y_TD + shared_TD
        if self.aux_grad_scale is not None:
            y_TD = _CarryLoss.apply(y_TD, r.balance_loss, self.aux_grad_scale)
        if recomputing():  # the first forward recorded these
            return y_TD.view(B, S, D)
        if self.aux_grad_scale is not None:
            aux.balance_loss = aux.balance_loss + r.balance_loss.detach()
        else:
            aux.balance_loss = aux.balance_loss + r.balance_loss
        aux.aux_loss = aux.aux_loss + r.aux_loss
        aux.z_loss = aux.z_loss + r.z_loss
        aux.tokens_per_expert.append(r.tokens_per_expert_E)
        aux.dropped_fraction.append(r.dropped_fraction)
        return y_TD.view(B, S, D)


class Block(nn.Module):
    # Activation checkpointing: keep only the block's input in the forward and recompute the
    # rest in the backward (the trainer sets it from `activation_checkpoint`).
    recompute: bool = False

    def __init__(self, cfg: ModelConfig, mcfg: MoEConfig, use_moe: bool, window: int = 0) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = (
            LatentAttention(cfg) if cfg.attention == "mla" else CausalSelfAttention(cfg, window)
        )
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn: MoELayer | SwiGLU = (
            MoELayer(cfg.d_model, mcfg) if use_moe else SwiGLU(cfg.d_model, cfg.dense_hidden)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        aux: MoEAux,
        cache: KVCache | PackedRows | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        if self.recompute and not isinstance(cache, KVCache) and torch.is_grad_enabled():
            return checkpoint(
                self._forward,
                x,
                cos,
                sin,
                aux,
                cache,
                layer,
                use_reentrant=False,
                context_fn=_checkpoint_contexts,
            )
        return self._forward(x, cos, sin, aux, cache, layer)

    def _forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        aux: MoEAux,
        cache: KVCache | PackedRows | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, cache, layer)
        h = self.norm2(x)
        return x + (self.ffn(h, aux) if isinstance(self.ffn, MoELayer) else self.ffn(h))


@torch.no_grad()
def init_parameter_(name: str, t: torch.Tensor, cfg: ModelConfig) -> None:
    """One parameter's initialisation, in place (its draws from torch's global generator):
    biases zero, norms as built (ones), matrices normal(0, init_std), the residual-output
    projections scaled by 1/sqrt(2 * n_layer) as in GPT-2. The sharded engine draws the same
    on a whole copy of each parameter (moe/train/distributed.py `init_like_one_process`)."""
    if t.dim() == 1 or name.endswith(EXPERT_BIASES):
        if name.endswith((".bias", "sinks", *EXPERT_BIASES)):
            t.zero_()
        return
    t.normal_(mean=0.0, std=cfg.init_std)
    if name.endswith(("proj.weight", "w2.weight", "w2_EFD")):
        t.mul_(1.0 / math.sqrt(2 * cfg.n_layer))


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, mcfg: MoEConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.mcfg, self.vocab_size = cfg, mcfg, vocab_size
        self.embed = nn.Embedding(vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(
            Block(cfg, mcfg, use_moe=cfg.is_moe_block(i), window=cfg.window(i))
            for i in range(cfg.n_layer)
        )
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(
            cfg.seq_len, cfg.rope_width, cfg.rope_theta, cfg.rope_type, cfg.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def set_context(self, seq_len: int) -> None:
        """Read up to `seq_len` positions (prompt and answer together): the rotary tables are
        computed again for that length. A checkpoint trained at a shorter length reads longer
        prompts this way (as its pretrained model could: SmolLM2 was trained at 8,192)."""
        c = self.cfg
        c.seq_len = seq_len
        cos, sin = rotary_tables(seq_len, c.rope_width, c.rope_theta, c.rope_type, c.rope_scaling)
        device = self.embed.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def experts_per_layer(self) -> list[int]:
        """Expert count of each MoE layer (they differ after growth or pruning)."""
        return [layer.experts.num_experts for layer in self.moe_layers]

    @property
    def moe_layers(self) -> list[MoELayer]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoELayer)]

    def set_routing_step(self, step: int, progress: float) -> None:
        """Tell the routers the optimizer step (expert warm-up) and the fraction of the run
        done (capacity schedule). Finetuning passes a step past the warm-up."""
        for layer in self.moe_layers:
            layer.router.set_step(step, progress)

    def update_routing(self, step: int) -> None:
        """After each optimizer step: aux-free bias, utilisation average, gate rebalancing."""
        for layer in self.moe_layers:
            layer.router.update_state(step)

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            init_parameter_(name, p, self.cfg)

    def forward(
        self,
        idx_BS: torch.Tensor,
        targets_BS: torch.Tensor | None = None,
        loss_weight_BS: torch.Tensor | None = None,
        logits: bool = True,
        loss_rows: torch.Tensor | None = None,
        segments_BS: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, MoEAux]:
        """Logits (B, S, V); the mean cross-entropy over targets != -100, weighted per token
        when loss_weight_BS is given; and the MoE auxiliaries.

        `logits=False` (training and scoring, which read only the loss) returns None for the
        logits and runs the output head only where a target counts: in finetuning the prompt
        carries no loss and is ~80% of the tokens, and the head over a 4096-token vocabulary is
        about half of this small model's forward FLOPs (bench/RESULTS.md). The loss is the
        same (tests/test_moe.py). `loss_rows`: those positions (flat, int64) when the caller
        has them already: the trainer finds them on the host, where the batch is, so that the
        device is never asked how many there are (a host sync). `segments_BS`: rows that pack
        several examples, each token's example (moe/model/attention.py `PackedRows`)."""
        B, S = idx_BS.shape
        if S > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {S} tokens is longer than model.seq_len={self.cfg.seq_len}"
            )
        zero = torch.zeros((), device=idx_BS.device)
        aux = MoEAux(balance_loss=zero, aux_loss=zero, z_loss=zero)
        x = self.embed(idx_BS)
        packed = None if segments_BS is None else PackedRows(self.cfg, segments_BS)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope_cos, self.rope_sin, aux, packed, i)
        h_BSD = self.norm(x)
        if targets_BS is None:
            return self.lm_head(h_BSD), None, aux
        t_T = targets_BS.reshape(-1)
        w_T = None if loss_weight_BS is None else loss_weight_BS.reshape(-1).float()
        logits_BSV = None
        if logits:
            logits_BSV = self.lm_head(h_BSD)
            logits_TV = logits_BSV.view(-1, logits_BSV.size(-1))
        else:  # only the positions that carry loss go through the head
            keep_T = (t_T != -100).nonzero().squeeze(1) if loss_rows is None else loss_rows
            # rounded up to a multiple of LOSS_ROW_BUCKET with ignored rows (no loss, no
            # gradient): the head's operands take a few sizes, not a new one each step, which
            # fragments a CPU heap step after step (bench/RESULTS.md: host memory)
            n = keep_T.numel()
            pad = -n % LOSS_ROW_BUCKET
            if pad:
                keep_T = torch.cat([keep_T, keep_T.new_zeros(pad)])
            logits_TV = self.lm_head(h_BSD.reshape(B * S, -1)[keep_T])
            t_T = t_T[keep_T]
            w_T = None if w_T is None else w_T[keep_T]
            if pad:
                t_T[n:] = -100
        ce = F.cross_entropy(logits_TV.float(), t_T, ignore_index=-100, reduction="none")
        mask = (t_T != -100).float()
        w = mask if w_T is None else mask * w_T
        loss = (ce * w).sum() / w.sum().clamp_min(1e-8)
        return logits_BSV, loss, aux

    def num_params(self, active_only: bool = False) -> int:
        """Parameter count; active_only counts top_k of num_experts experts per MoE layer."""
        total = sum(p.numel() for p in self.parameters())
        if active_only:
            for layer in self.moe_layers:
                per_expert = sum(p[0].numel() for p in layer.experts.parameters())
                total -= per_expert * (layer.experts.num_experts - self.mcfg.top_k)
        return total

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6 * active params + attention (PaLM appendix B)."""
        c = self.cfg
        qk = c.head_width + (c.mla_rope_dim if c.attention == "mla" else 0)
        scores_and_mix = c.n_head * (qk + c.v_width)  # Q K^T and the weighted sum of V
        return (
            6.0 * self.num_params(active_only=True) + 6.0 * c.n_layer * scores_and_mix * c.seq_len
        )

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop_ids: set[int] | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        scores: list[float] | None = None,
        adjust: Callable[[torch.Tensor, list[list[int]]], None] | None = None,
    ) -> list[list[int]]:
        """Greedy decoding of several prompts at once with a KV cache: one forward pass over
        the left-padded prompts, then one token per row per step. The same tokens as
        `generate` on each prompt alone (tests/test_moe.py); every prompt plus max_new_tokens
        must fit in model.seq_len (the caller truncates). `temperature` > 0 samples each
        token from softmax(logits / temperature) instead (drawn from `generator`); `scores`,
        when given, receives each row's log-probability of what it generated (the model's
        own, at temperature 1), stop token included. `adjust(logits_BV, out)`, when given,
        may change each row's logits in place before the token is chosen, from what the rows
        generated so far (moe/sql/constrain.py holds identifiers to a schema this way)."""
        if not prompts:
            return []
        device = self.embed.weight.device
        lens_B = torch.tensor([len(p) for p in prompts], device=device)
        L = int(lens_B.max())
        if int(lens_B.min()) < 1 or L + max_new_tokens > self.cfg.seq_len:
            raise ValueError(
                f"prompts of 1..{self.cfg.seq_len - max_new_tokens} tokens fit model.seq_len="
                f"{self.cfg.seq_len} with {max_new_tokens} new tokens; got {int(lens_B.min())}"
                f"..{L}"
            )
        B = len(prompts)
        idx_BS = torch.zeros(B, L, dtype=torch.long, device=device)
        for b, p in enumerate(prompts):
            idx_BS[b, L - len(p) :] = torch.tensor(p, device=device)
        cache = KVCache(self.cfg, self.embed.weight.dtype, L - lens_B, L + max_new_tokens)
        stop = torch.tensor(sorted(stop_ids or ()), dtype=torch.long, device=device)
        out: list[list[int]] = [[] for _ in range(B)]
        logp_B = torch.zeros(B, device=device)
        done_B = torch.zeros(B, dtype=torch.bool, device=device)
        # the tokens and whether each is kept, on the device: read once at the end (a step
        # reads only its stop check; `adjust` reads what the rows wrote, on the host)
        gen_BT = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
        kept_BT = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)
        step_in, steps = idx_BS, 0
        for t in range(max_new_tokens):
            cache.start(step_in.shape[1])
            x = self.embed(step_in)
            zero = torch.zeros((), device=device)
            aux = MoEAux(balance_loss=zero, aux_loss=zero, z_loss=zero)
            for i, block in enumerate(self.blocks):
                x = block(x, self.rope_cos, self.rope_sin, aux, cache, i)
            cache.length += step_in.shape[1]
            own_BV = logits_BV = self.lm_head(self.norm(x[:, -1])).float()
            if adjust is not None:  # the model's own logits stay what `scores` reads
                logits_BV = own_BV.clone()
                adjust(logits_BV, out)
            if temperature > 0:
                probs_BV = (logits_BV / temperature).softmax(-1)
                nxt_B = torch.multinomial(probs_BV, 1, generator=generator).squeeze(1)
            else:
                nxt_B = logits_BV.argmax(-1)
            if scores is not None:
                chosen_B = own_BV.log_softmax(-1).gather(1, nxt_B[:, None]).squeeze(1)
                logp_B += torch.where(done_B, 0.0, chosen_B)
            done_B |= torch.isin(nxt_B, stop)
            gen_BT[:, t], kept_BT[:, t], steps = nxt_B, ~done_B, t + 1
            if adjust is not None:
                alive_B = (~done_B).tolist()
                for b, (tok, alive) in enumerate(zip(nxt_B.tolist(), alive_B, strict=True)):
                    out[b] += [tok] * alive
            if bool(done_B.all()):  # the stop check: the one read a step
                break
            step_in = nxt_B[:, None]
        if scores is not None:
            scores.extend(logp_B.tolist())
        if adjust is None:
            rows = zip(gen_BT[:, :steps].tolist(), kept_BT[:, :steps].tolist(), strict=True)
            out = [[tok for tok, kept in zip(g, k, strict=True) if kept] for g, k in rows]
        return out

    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        stop_ids: set[int] | None = None,
        top_p: float = 0.0,
    ) -> list[int]:
        """Greedy decoding (top_p = 0) or nucleus sampling; stops at any id in stop_ids."""
        device = self.embed.weight.device
        ids = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            ctx = torch.tensor([ids[-self.cfg.seq_len :]], device=device)
            logits = self(ctx)[0][0, -1].float()
            if top_p > 0:
                probs = logits.softmax(-1)
                sorted_p, sorted_i = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < top_p
                choice = torch.multinomial(sorted_p * keep, 1)
                nxt = int(sorted_i[choice])
            else:
                nxt = int(logits.argmax())
            if stop_ids and nxt in stop_ids:
                break
            ids.append(nxt)
            out.append(nxt)
        return out
