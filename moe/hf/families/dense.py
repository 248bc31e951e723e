"""Dense Llama, Qwen2 and Qwen3, imported by upcycling (Komatsuzaki et al. 2022): every
feed-forward copied into each of moe.num_experts experts, routing renormalised so the combine
weights sum to one, so the upcycled model computes the dense one's function at step 0
whatever the router chooses (each upcycled layer's router starts fresh); with
moe.num_experts = 1 kept dense instead (a baseline at the same steps). Never exported to:
the trained model is exported as an MoE architecture. The three differ only in declared
fields, q/k/v biases (Qwen2's default) and q/k norm (Qwen3's, per head)."""

from __future__ import annotations

from typing import Any

from moe.errors import InputError
from moe.hf.families.protocol import Family, MoEShape
from moe.model.config import MoEConfig


class DenseUpcycled(Family):
    upcycled = True

    def __init__(
        self,
        model_type: str,
        config_fields: set[str],
        qkv_bias: bool = False,
        qk_norm: str = "none",
    ) -> None:
        self.model_type = model_type
        self.config_fields = frozenset(config_fields)
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm

    def moe_shape(self, hf: dict[str, Any], n_layer: int, moe_defaults: MoEConfig) -> MoEShape:
        E, K = moe_defaults.num_experts, moe_defaults.top_k
        if E == 1:  # kept dense: every layer the checkpoint's own feed-forward
            return MoEShape(
                num_experts=1,
                top_k=1,
                expert_hidden=int(hf["intermediate_size"]),
                renormalize=True,
                dense_layers=list(range(n_layer)),
            )
        if K < 2:
            raise InputError(
                f"moe.top_k = {K}: upcycling {self.model_type} needs top_k >= 2. The upcycled"
                " model equals the dense one because the renormalised weights of its K copies"
                " sum to 1; at K = 1 that weight would be a constant 1 and the router would"
                " never learn (moe.num_experts = 1 keeps the model dense)"
            )
        return MoEShape(
            num_experts=E, top_k=K, expert_hidden=int(hf["intermediate_size"]), renormalize=True
        )


LLAMA = DenseUpcycled("llama", {"attention_bias", "mlp_bias"})
QWEN2 = DenseUpcycled("qwen2", {"qkv_bias"}, qkv_bias=True)
QWEN3 = DenseUpcycled("qwen3", {"attention_bias"}, qk_norm="head")
