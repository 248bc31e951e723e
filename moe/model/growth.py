"""Expert growth and pruning: the MoE grows where the load is and sheds dead experts.

Dynamic orthogonal growth, and pruning by merging. Per MoE layer:

- importance: moving averages of each expert's activation frequency (its share of the
  layer's assignments) and of its gradient-norm share; importance_i = mean of the two, each
  scaled so a balanced layer scores 1.0 per expert;
- growth trigger: the top `top_fraction` of experts carry more than `top_load` of the
  load, or the variance of the importance exceeds `importance_var`, and in either case the
  load itself is uneven (its CV over `min_load_cv`: a balanced layer never grows, whatever
  its gradient norms say); at most one growth per
  `cooldown` steps per layer, up to `max_experts`;
- growth: one new expert whose weights are orthogonal to the span of the layer's experts
  (Gram-Schmidt against a QR basis of their flattened weights) and scaled to their mean norm;
  (`init: split` starts it instead as the hottest expert plus an orthogonal component of 10%
  of its norm); its router row is the hottest expert's row plus an orthogonal perturbation,
  so it competes
  for that expert's tokens (under aux_free balancing it also starts with that expert's
  routing bias). Departure from plain orthogonal growth: the new expert starts at zero combine
  weight (a router logit offset of -1e4: its softmax probability is exactly 0 in fp32), so the
  model's output right after growth equals the output before; the offset ramps from -20 to 0
  over `ramp_steps`, handing it traffic gradually;
- pruning: an expert under `u_min` of its fair share of the load for `prune_window`
  consecutive steps is merged into its most similar expert (cosine similarity of the
  flattened weights), weighted by their loads and the similarity, then removed;
- whatever changes size follows: expert weights, router rows and routing buffers, the
  optimizer's moments (new rows start at zero; removed rows are dropped) and the trainer's
  load statistics (`ExpertLoad.resize`). Every event is returned as a dict for the metrics,
  W&B and the lineage record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from moe.model.config import GrowthConfig
from moe.model.transformer import MoELayer, MoETransformer

NEW_EXPERT_OFFSET = -1e4  # exp(-1e4) == 0 in fp32: zero combine weight at birth
RAMP_START = -20.0


@dataclass
class LayerState:
    freq_E: torch.Tensor  # moving average of the share of assignments
    grad_E: torch.Tensor  # moving average of the share of expert gradient norm
    low_E: torch.Tensor  # consecutive observed steps under u_min
    born_E: torch.Tensor  # step each expert was added (-1 = an original expert)
    last_event: int = -(10**9)

    @classmethod
    def fresh(cls, E: int) -> LayerState:
        return cls(
            torch.full((E,), 1.0 / E),
            torch.full((E,), 1.0 / E),
            torch.zeros(E),
            torch.full((E,), -1.0),
        )

    def importance(self) -> torch.Tensor:
        E = self.freq_E.numel()
        return 0.5 * (self.freq_E * E) + 0.5 * (self.grad_E * E)

    def reindex(self, index: torch.Tensor, step: int) -> None:
        """Follow a layer's new expert order: index[e] = old expert, -1 = a new one."""
        E = len(index)
        known = index >= 0
        for name in ("freq_E", "grad_E", "low_E", "born_E"):
            old = getattr(self, name)
            new = torch.zeros(E)
            new[known] = old[index[known]]
            setattr(self, name, new)
        self.freq_E[~known] = 1.0 / E
        self.grad_E[~known] = 1.0 / E
        self.born_E[~known] = float(step)
        self.freq_E /= self.freq_E.sum()
        self.grad_E /= self.grad_E.sum()


def expert_grad_norms(layer: MoELayer) -> torch.Tensor:
    """Per-expert gradient norm over the expert's weights (E,), zeros without gradients."""
    sq = torch.zeros(layer.experts.num_experts, device=layer.experts.w13_EDG.device)
    for p in (layer.experts.w13_EDG, layer.experts.w2_EFD):
        if p.grad is not None:
            sq = sq + p.grad.detach().float().pow(2).flatten(1).sum(1)
    return sq.sqrt().cpu()


def grow_reason(state: LayerState, cfg: GrowthConfig) -> str | None:
    """Why this layer should grow now, or None (cooldown and size are checked by the caller).
    Only a layer whose load is uneven grows (load CV over `min_load_cv`): the importance
    variance also reads gradient norms, which differ between experts of a balanced layer, and
    growing such a layer only adds an expert that starts with no traffic."""
    if _cv(state.freq_E) <= cfg.min_load_cv:
        return None
    E = state.freq_E.numel()
    top_n = max(1, math.ceil(cfg.top_fraction * E))
    top_share = float(state.freq_E.sort(descending=True).values[:top_n].sum())
    if top_share > cfg.top_load:
        return (
            f"top {top_n} of {E} experts carry {top_share:.0%} of the load (> {cfg.top_load:.0%})"
        )
    var = float(state.importance().var(unbiased=False))
    if var > cfg.importance_var:
        return f"importance variance {var:.3f} > {cfg.importance_var}"
    return None


def orthogonal_to(existing: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor shaped like existing[0], orthogonal to every existing[e] (flattened), with
    their mean norm. Needs fewer experts than elements per expert."""
    E = existing.shape[0]
    M = existing.detach().float().reshape(E, -1)  # (E, N)
    Q, _ = torch.linalg.qr(M.T)  # (N, E): orthonormal basis of the span
    v = torch.randn(M.shape[1], generator=generator)
    for _ in range(2):  # twice is enough (Kahan-Parlett)
        v = v - Q @ (Q.T @ v)
    v = v / v.norm().clamp_min(1e-12) * M.norm(dim=1).mean()
    return v.view(existing.shape[1:]).to(existing.dtype)


def _replace_param(
    module: nn.Module,
    name: str,
    value: torch.Tensor,
    index: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Swap module.<name> for a new Parameter holding `value`; move its optimizer state
    along rows: new row e takes old row index[e], index -1 starts at zero."""
    old: nn.Parameter = getattr(module, name)
    new = nn.Parameter(value.detach().clone().to(old.device, old.dtype))
    setattr(module, name, new)
    if optimizer is None:
        return
    known = index >= 0
    for group in optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            if p is old:
                group["params"][i] = new
    state = optimizer.state.pop(old, None)
    if state:
        moved = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == old.shape:
                t = torch.zeros_like(new)
                t[known.to(t.device)] = v[index[known].to(v.device)]
                moved[k] = t
            else:
                moved[k] = v
        optimizer.state[new] = moved


def _resize_layer(
    layer: MoELayer,
    index: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    gate: torch.Tensor,
    optimizer: torch.optim.Optimizer | None,
    new_offset: float = NEW_EXPERT_OFFSET,
) -> None:
    """Give a layer the experts `index` describes (old ids; -1 = new), with the given
    weights for all of them; routing buffers follow."""
    E = len(index)
    known = index >= 0
    _replace_param(layer.experts, "w13_EDG", w13, index, optimizer)
    _replace_param(layer.experts, "w2_EFD", w2, index, optimizer)
    _replace_param(layer.router.gate, "weight", gate, index, optimizer)
    layer.experts.num_experts = E
    router = layer.router
    router.num_experts = E
    for name, fill in (
        ("expert_bias_E", 0.0),
        ("util_E", 1.0),
        ("load_E", 0.0),
        ("logit_offset_E", new_offset),
    ):
        old = getattr(router, name)
        buf = torch.full((E,), fill, dtype=old.dtype, device=old.device)
        buf[known.to(buf.device)] = old[index[known].to(old.device)]
        setattr(router, name, buf)


def grow(
    layer: MoELayer,
    state: LayerState,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    generator: torch.Generator | None = None,
    init: str = "orthogonal",
) -> dict[str, Any]:
    """Add one expert to the layer (see the module docstring); returns the event."""
    E = layer.experts.num_experts
    hot = int(state.freq_E.argmax())
    with torch.no_grad():
        new = []
        for w in (layer.experts.w13_EDG, layer.experts.w2_EFD):
            ortho = orthogonal_to(w, generator)
            if init == "split":  # the hot expert's function plus a new direction
                ortho = w[hot] + ortho / ortho.norm().clamp_min(1e-12) * w[hot].norm() * 0.1
            new.append(torch.cat([w, ortho[None]]))
        w13, w2 = new
        row = layer.router.gate.weight[hot]
        perturb = orthogonal_to(layer.router.gate.weight, generator)
        perturb = perturb / perturb.norm().clamp_min(1e-12) * row.norm() * 0.1
        gate = torch.cat([layer.router.gate.weight, (row + perturb)[None]])
    index = torch.cat([torch.arange(E), torch.tensor([-1])])
    _resize_layer(layer, index, w13, w2, gate, optimizer)
    with torch.no_grad():  # aux_free: it competes for its parent's tokens on equal terms
        layer.router.expert_bias_E[-1] = layer.router.expert_bias_E[hot]
    state.reindex(index, step)
    return {
        "kind": "grow",
        "experts_before": E,
        "experts_after": E + 1,
        "split_from": hot,
        "index": index.tolist(),  # new expert e = old index[e] (-1: new)
    }


def prune(
    layer: MoELayer,
    state: LayerState,
    expert: int,
    optimizer: torch.optim.Optimizer | None,
    step: int,
) -> dict[str, Any]:
    """Merge `expert` into its most similar expert (by the cosine similarity of their
    flattened weights), weighted by load and similarity, and remove it."""
    E = layer.experts.num_experts
    with torch.no_grad():
        flat = torch.cat(
            [layer.experts.w13_EDG.flatten(1), layer.experts.w2_EFD.flatten(1)], dim=1
        ).float()
        sim = F.cosine_similarity(flat[expert][None], flat, dim=1)
        sim[expert] = -2.0
        target = int(sim.argmax())
        s = max(float(sim[target]), 0.0)
        u_a, u_b = float(state.freq_E[expert]), float(state.freq_E[target])
        alpha = s * u_a / max(u_b + s * u_a, 1e-12)  # weight of the pruned expert in the merge
        w13 = layer.experts.w13_EDG.detach().clone()
        w2 = layer.experts.w2_EFD.detach().clone()
        w13[target] = (1 - alpha) * w13[target] + alpha * w13[expert]
        w2[target] = (1 - alpha) * w2[target] + alpha * w2[expert]
        keep = torch.tensor([e for e in range(E) if e != expert])
        gate = layer.router.gate.weight.detach()[keep]
        offset = layer.router.logit_offset_E.detach().clone()
    _resize_layer(layer, keep, w13[keep], w2[keep], gate, optimizer)
    layer.router.logit_offset_E.copy_(offset[keep.to(offset.device)])
    state.reindex(keep, step)
    return {
        "kind": "prune",
        "experts_before": E,
        "experts_after": E - 1,
        "expert": expert,
        "merged_into": target if target < expert else target - 1,
        "similarity": round(float(sim[target]), 4),
        "merge_weight": round(alpha, 4),
        "index": keep.tolist(),
    }


@dataclass
class GrowthManager:
    """Watches every MoE layer and grows or prunes it; the trainer calls `observe` after
    each backward pass and `act` after each optimizer step."""

    model: MoETransformer
    cfg: GrowthConfig
    states: list[LayerState] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.states:
            self.states = [LayerState.fresh(n) for n in self.model.experts_per_layer()]
        self._gen = torch.Generator().manual_seed(self.seed)

    def observe(self, tokens_per_expert: list[torch.Tensor]) -> None:
        m = self.cfg.ema
        for layer, st, counts in zip(
            self.model.moe_layers, self.states, tokens_per_expert, strict=True
        ):
            c = counts.detach().float().cpu()
            share = c / c.sum().clamp_min(1.0)
            g = expert_grad_norms(layer)
            gshare = g / g.sum() if float(g.sum()) > 0 else torch.full_like(g, 1.0 / g.numel())
            st.freq_E = m * st.freq_E + (1 - m) * share
            st.grad_E = m * st.grad_E + (1 - m) * gshare
            E = c.numel()
            low = share * E < self.cfg.u_min
            st.low_E = torch.where(low, st.low_E + 1, torch.zeros_like(st.low_E))

    def ramp(self, step: int) -> None:
        """Move the router offsets of recently grown experts toward 0."""
        for layer, st in zip(self.model.moe_layers, self.states, strict=True):
            young = st.born_E >= 0
            if not bool(young.any()):
                continue
            age = (step - st.born_E).clamp_min(0)
            off = torch.where(
                age <= 0,
                torch.full_like(age, NEW_EXPERT_OFFSET),
                RAMP_START * (1 - age / self.cfg.ramp_steps).clamp_min(0),
            )
            cur = layer.router.logit_offset_E
            cur.copy_(torch.where(young.to(cur.device), off.to(cur.device, cur.dtype), cur))

    def act(self, step: int, optimizer: torch.optim.Optimizer | None) -> list[dict[str, Any]]:
        """Grow or prune where due; returns the events (with load statistics before/after)."""
        if step % self.cfg.check_every:
            return []
        events = []
        for i, (layer, st) in enumerate(zip(self.model.moe_layers, self.states, strict=True)):
            E = layer.experts.num_experts
            before = {"cv": _cv(st.freq_E), "max_vio": _max_vio(st.freq_E)}
            event = None
            if self.cfg.prune and E > max(self.cfg.min_experts, self.model.mcfg.top_k):
                window = self.cfg.prune_window
                dead = [
                    e
                    for e in range(E)
                    if st.low_E[e] >= window
                    and (st.born_E[e] < 0 or step - st.born_E[e] > self.cfg.ramp_steps + window)
                ]
                if dead:
                    event = prune(layer, st, dead[0], optimizer, step)
                    event["trigger"] = (
                        f"expert under {self.cfg.u_min:.0%} of its fair share for "
                        f"{self.cfg.prune_window} steps"
                    )
            if (
                event is None
                and E < self.cfg.max_experts
                and step - st.last_event >= self.cfg.cooldown
            ):
                reason = grow_reason(st, self.cfg)
                if reason:
                    event = grow(layer, st, optimizer, step, self._gen, self.cfg.init)
                    event["trigger"] = reason
            if event is not None:
                st.last_event = step
                event.update(
                    step=step,
                    layer=i,
                    load_before=before,
                    load_after={"cv": _cv(st.freq_E), "max_vio": _max_vio(st.freq_E)},
                )
                events.append(event)
        return events

    def state_dict(self) -> dict[str, Any]:
        return {
            "layers": [
                {
                    "freq": s.freq_E.tolist(),
                    "grad": s.grad_E.tolist(),
                    "low": s.low_E.tolist(),
                    "born": s.born_E.tolist(),
                    "last_event": s.last_event,
                }
                for s in self.states
            ]
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.states = [
            LayerState(
                torch.tensor(x["freq"]),
                torch.tensor(x["grad"]),
                torch.tensor(x["low"]),
                torch.tensor(x["born"]),
                int(x["last_event"]),
            )
            for x in d["layers"]
        ]


def _cv(share: torch.Tensor) -> float:
    return round(float(share.std(unbiased=False) / share.mean().clamp_min(1e-12)), 4)


def _max_vio(share: torch.Tensor) -> float:
    return round(float(share.max() / share.mean().clamp_min(1e-12) - 1), 4)


def experts_per_layer(tensors: dict[str, torch.Tensor], model: MoETransformer) -> list[int]:
    """Expert count of each MoE layer in a state dict (checkpoints of a grown model)."""
    out = []
    for i, block in enumerate(model.blocks):
        if isinstance(block.ffn, MoELayer):
            out.append(int(tensors[f"blocks.{i}.ffn.experts.w13_EDG"].shape[0]))
    return out


def resize_model(model: MoETransformer, counts: list[int]) -> bool:
    """Give each MoE layer `counts[i]` experts (weights zeroed: a checkpoint load fills them
    next). Returns whether anything changed; rebuild the optimizer afterwards."""
    changed = False
    for layer, E in zip(model.moe_layers, counts, strict=True):
        old = layer.experts.num_experts
        if old == E:
            continue
        changed = True
        index = torch.tensor([e if e < old else -1 for e in range(E)])
        ex = layer.experts
        _resize_layer(
            layer,
            index,
            ex.w13_EDG.new_zeros(E, *ex.w13_EDG.shape[1:]),
            ex.w2_EFD.new_zeros(E, *ex.w2_EFD.shape[1:]),
            layer.router.gate.weight.new_zeros(E, layer.router.gate.weight.shape[1]),
            None,
            new_offset=0.0,
        )
    return changed
