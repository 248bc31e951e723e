"""Tiering: which tier each tensor goes to, and how and how often each tier is written.

- L0: the shared (non-expert) parameters, their optimizer state and the RNG state;
- L1: the hot experts (load >= `cold_threshold` x the layer's mean load);
- L2: the cold experts.

An expert weight is a parameter under `<layer>.experts.` with its experts along dim 0; its
optimizer moments go with it. Each tier has its codec and compression level (L2 the cold
ones, L0 and L1 the hot ones) and is written in full every `hot_every` (L0, L1) or
`cold_every` (L2) steps. Both the whole (moe/checkpoint/whole.py) and the sharded
(moe/checkpoint/sharded.py) writers ask here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from moe.checkpoint.manifest import Manifest

TIERS = ("L0", "L1", "L2")

# Expert weights: 3-D parameters under `<layer>.experts.`, experts along dim 0; their LoRA
# adapters (`<layer>.experts.lora.`, moe/adapters/lora.py) too, so they share their expert's tier.
_EXPERT_PARAM = re.compile(r"^(?P<layer>.+)\.experts\.(?:lora\.)?[A-Za-z0-9_]+$")


def expert_layer(param_name: str) -> str | None:
    """The MoE layer prefix of an expert parameter (e.g. 'blocks.0.ffn'), else None."""
    m = _EXPERT_PARAM.match(param_name)
    return m.group("layer") if m else None


def tensor_layer(group: str, name: str, t: torch.Tensor, param_names: dict[str, str]) -> str | None:
    """The expert layer a tensor of a whole checkpoint belongs to (split along dim 0), else
    None (L0). param_names maps an optimizer tensor's parameter index to its name."""
    if group == "model":
        pname = name
    elif group == "optimizer":
        idx = name.split(".", 1)[0]
        pname = param_names.get(idx, "")
    else:
        return None
    layer = expert_layer(pname)
    return layer if layer is not None and t.dim() >= 2 else None


def expert_tier(expert_tiers: dict[str, dict[str, list[int]]], layer: str, expert: int) -> str:
    """The tier of one expert of an MoE layer: L2 if it is cold, else L1."""
    return "L2" if expert in expert_tiers.get(layer, {}).get("cold", []) else "L1"


@dataclass
class TierPolicy:
    """How each tier is stored (codec, level) and how often in full; which experts are cold."""

    hot_every: int = 100
    cold_every: int = 1000
    cold_threshold: float = 0.5
    hot_codec: str = "bg-zstd"
    cold_codec: str = "bg-zstd"
    hot_level: int = 1
    cold_level: int = 19

    def codec(self, tier: str) -> str:
        """The codec of a full write of `tier`."""
        return self.cold_codec if tier == "L2" else self.hot_codec

    def level(self, tier: str) -> int:
        """The compression level of `tier`."""
        return self.cold_level if tier == "L2" else self.hot_level

    def full_tiers(self, step: int, last_full: dict[str, Manifest]) -> set[str]:
        """The tiers written in full this time (the others as deltas where that pays): a tier
        never written in full, or whose last full write is its interval ago."""
        every = {"L0": self.hot_every, "L1": self.hot_every, "L2": self.cold_every}
        return {
            tier
            for tier in TIERS
            if tier not in last_full or step - last_full[tier].step >= every[tier]
        }

    def expert_tiers(self, expert_load: dict[str, list[float]]) -> dict[str, dict[str, list[int]]]:
        """Hot and cold experts per layer: cold below cold_threshold of the layer's mean load."""
        tiers: dict[str, dict[str, list[int]]] = {}
        for layer, load in expert_load.items():
            mean = sum(load) / max(1, len(load))
            cold = {e for e, v in enumerate(load) if mean > 0 and v < self.cold_threshold * mean}
            tiers[layer] = {
                "hot": [e for e in range(len(load)) if e not in cold],
                "cold": sorted(cold),
            }
        return tiers


def expert_counts(expert_tiers: dict[str, dict[str, list[int]]]) -> dict[str, int]:
    """The number of experts of each MoE layer (the manifest's `expert_counts`)."""
    return {layer: len(t["hot"]) + len(t["cold"]) for layer, t in expert_tiers.items()}
