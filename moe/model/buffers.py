"""What a model built on the meta device lacks once `to_empty` gives it storage: the rotary
tables, the routers' state, and the tie of the output head to the embedding. Every path that
builds a model without its weights first (import, our model folders, `model.init`, the
sharded engine's ranks) fills them here."""

from __future__ import annotations

from moe.model.transformer import MoETransformer


def init_buffers(model: MoETransformer) -> None:
    """What a meta-device build leaves unset: rotary tables, routing state, and the tie of
    the output head to the embedding (`to_empty` gives each module its own storage)."""
    c = model.cfg
    if c.tie_embeddings and model.lm_head.weight is not model.embed.weight:
        model.lm_head.weight = model.embed.weight
    model.set_context(c.seq_len)  # the rotary tables
    for layer in model.moe_layers:
        r = layer.router
        r.expert_bias_E.zero_()
        r.util_E.fill_(1.0)
        r.logit_offset_E.zero_()
        r.load_E.zero_()
