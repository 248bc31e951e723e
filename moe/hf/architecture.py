"""What a Hugging Face config.json means for our model: reading it (`read_config`), and our
ModelConfig and MoEConfig for it (`read_architecture` -> `Architecture`). Its family
(moe/hf/families/) maps its own fields; the fields every family shares are read here. A field
that changes the forward pass and that we do not implement (a RoPE scaling, sliding windows,
qkv clipping, another activation...) is refused by name, never ignored."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moe.config import Problems, validate
from moe.errors import InputError
from moe.hf.errors import refuse
from moe.hf.families.protocol import Family, MoEShape
from moe.hf.families.registry import FAMILIES
from moe.model.config import YARN_KEYS, GrowthConfig, ModelConfig, MoEConfig

# Config fields every architecture may carry without changing the forward pass.
HARMLESS = {
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "_name_or_path",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_cache",
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "attention_dropout",
    "max_window_layers",
    "layer_types",
    "pretraining_tp",
    "router_jitter_noise",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "hidden_act",
    "tie_word_embeddings",
    "sliding_window",
    "use_sliding_window",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "tokenizer_class",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "problem_type",
    "torchscript",
    "use_return_dict",
    "router_z_loss_coef",
    # Hub metadata with no bearing on the weights: SmolLM2's config.json carries both
    # (`is_llama_config`, and transformers.js's ONNX export settings)
    "is_llama_config",
    "transformers.js_config",
}


# MoEConfig fields that are the experts' architecture (gpt-oss's; MoEShape.moe_fields sets
# them): a checkpoint without them has them at their defaults, whatever params.yaml says.
EXPERT_ARCHITECTURE = (
    "activation",
    "act_alpha",
    "act_limit",
    "expert_proj_bias",
    "router_logit_bias",
)


@dataclass
class Architecture:
    """What a Hugging Face config means for our model."""

    model_type: str
    model: ModelConfig
    moe: MoEConfig
    vocab_size: int
    upcycled: bool
    max_position_embeddings: int
    special_ids: dict[str, int | None] = field(default_factory=dict)


def read_config(folder: Path) -> dict[str, Any]:
    """config.json of a Hugging Face model folder, refused when it is not one."""
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.exists():
        hint = (
            " (it looks like a Hugging Face Hub id: this machine cannot download from the Hub;"
            " download it elsewhere with `huggingface-cli download` and name the folder)"
            if str(folder).count("/") == 1 and not str(folder).startswith((".", "/"))
            else ""
        )
        raise InputError(f"model.init = {str(folder)!r}: no such folder{hint}")
    if not path.is_file():
        raise refuse(folder, "no config.json: not a Hugging Face model folder")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise refuse(path, f"not JSON (line {e.lineno}: {e.msg})") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise refuse(path, "has no model_type")
    return cfg


def _family(path: Path, mtype: Any) -> Family:
    supported = tuple(FAMILIES)
    if mtype not in supported:
        moe = [t for t, f in FAMILIES.items() if not f.upcycled]
        dense = [t for t, f in FAMILIES.items() if f.upcycled]
        raise refuse(
            path,
            f"model_type {mtype!r} is not supported; supported: {', '.join(moe)} (MoE)"
            f" and {', '.join(dense)} (dense, upcycled to MoE)",
        )
    return FAMILIES[mtype]


def _check_fields(path: Path, hf: dict[str, Any], family: Family) -> None:
    """Refuse a field the family does not declare, and what we do not implement."""
    mtype = family.model_type
    for key, value in hf.items():
        if key in HARMLESS or key in family.config_fields or key.startswith("_"):
            continue
        if value in (None, False, 0, 0.0, [], {}, ""):
            continue
        raise refuse(path, f"field {key!r} = {value!r} is not supported for {mtype}")
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise refuse(path, f"hidden_act {hf['hidden_act']!r} is not supported (only silu)")
    if family.sliding_window(hf):
        raise refuse(path, "sliding-window attention is not implemented")
    if hf.get("clip_qkv") is not None:
        raise refuse(path, f"clip_qkv = {hf['clip_qkv']} is not implemented")
    if hf.get("mlp_bias"):
        raise refuse(path, "mlp_bias = true is not implemented")
    why = family.refusal(hf)
    if why:
        raise refuse(path, why)


# YaRN's fields in rope_parameters (or rope_scaling), beside rope_type and rope_theta: the
# keys ModelConfig.rope_scaling holds.
YARN_FIELDS = set(YARN_KEYS)


def _rope_theta(path: Path, hf: dict[str, Any], family: Family) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for what in (params, scaling):
        kind = what.get("rope_type", what.get("type", "default"))
        if kind not in ("default", None) and not (kind == "yarn" and family.yarn):
            raise refuse(
                path,
                f"RoPE scaling {kind!r} is not implemented for {family.model_type} (only plain"
                " RoPE, and YaRN where the family has it); the model cannot be imported exactly",
            )
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0 and not family.partial_rotary:
        raise refuse(path, f"partial_rotary_factor = {factor} is not implemented for this family")
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    return float(theta)


def _rope_scaling(path: Path, hf: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """(ModelConfig.rope_type, rope_scaling): YaRN's numbers as transformers reads them
    (standardize_rope_params: original_max_position_embeddings defaults to
    max_position_embeddings, factor to their ratio); an unknown YaRN field refused by name."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) != "yarn":
        return "default", {}
    known = YARN_FIELDS | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    for key in params:
        if key not in known:
            raise refuse(path, f"YaRN field {key!r} is not implemented")
    out = {k: float(v) for k, v in params.items() if k in YARN_FIELDS and v is not None}
    max_pos = float(hf.get("max_position_embeddings") or 0)
    out.setdefault("original_max_position_embeddings", max_pos)
    if "factor" not in out and out["original_max_position_embeddings"]:
        out["factor"] = max_pos / out["original_max_position_embeddings"]
    return "yarn", out


def _dimensions(path: Path, hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """ModelConfig's attention and width fields, read (and refused) before the MoE shape."""
    D, H = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    n_layer = int(hf["num_hidden_layers"])
    head_dim = int(hf.get("head_dim") or 0)
    if head_dim == D // H:
        head_dim = 0
    theta = _rope_theta(path, hf, family)
    rope_type, rope_scaling = _rope_scaling(path, hf)
    # attention_bias where config.json says it (false too: gpt-oss's default is true), else
    # qkv_bias (Qwen2-MoE), else the family's own (Qwen2 always has q/k/v biases)
    said = [hf.get(k) for k in ("attention_bias", "qkv_bias") if hf.get(k) is not None]
    attn_bias = bool(said[0]) if said else family.qkv_bias
    return {
        "n_layer": n_layer,
        "n_head": H,
        "head_dim": head_dim,
        "d_model": D,
        "qk_norm": family.qk_norm,
        "attn_bias": attn_bias,
        "rope_theta": theta,
        "rope_type": rope_type,
        "rope_scaling": rope_scaling,
    }


def _model_config(
    folder: Path, hf: dict[str, Any], dims: dict[str, Any], shape: MoEShape, seq_len: int
) -> ModelConfig:
    H = dims["n_head"]
    model = ModelConfig(
        init=str(folder),
        n_layer=dims["n_layer"],
        n_head=H,
        n_kv_head=int(hf.get("num_key_value_heads") or H),
        head_dim=dims["head_dim"],
        d_model=dims["d_model"],
        seq_len=seq_len,
        moe_every=shape.moe_every,
        dense_layers=shape.dense_layers,
        dense_hidden=int(hf["intermediate_size"]),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=dims["qk_norm"],
        attn_bias=dims["attn_bias"],
        rope_theta=dims["rope_theta"],
        rope_type=dims["rope_type"],
        rope_scaling=dims["rope_scaling"],
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )
    if model.n_kv_head == H:
        model.n_kv_head = 0
    return model


def _moe_config(moe_defaults: MoEConfig, shape: MoEShape) -> MoEConfig:
    moe = MoEConfig(**{**asdict(moe_defaults), "growth": GrowthConfig()})
    moe.num_experts, moe.top_k, moe.expert_hidden = (
        shape.num_experts,
        shape.top_k,
        shape.expert_hidden,
    )
    moe.renormalize = shape.renormalize
    moe.shared_expert, moe.shared_expert_hidden = shape.shared_expert, shape.shared_expert_hidden
    moe.shared_expert_gate = shape.shared_expert_gate
    moe.score_func = shape.score_func  # type: ignore[assignment]
    moe.n_group, moe.topk_group, moe.routed_scale = (
        shape.n_group,
        shape.topk_group,
        shape.routed_scale,
    )
    if shape.shared_expert_hidden == shape.expert_hidden:
        moe.shared_expert_hidden = 0
    plain = MoEConfig()  # the experts' own architecture is the checkpoint's, never params'
    for key in EXPERT_ARCHITECTURE:
        setattr(moe, key, getattr(plain, key))
    for key, value in shape.moe_fields.items():
        setattr(moe, key, value)
    return moe


def _check_consistent(
    path: Path, hf: dict[str, Any], model: ModelConfig, moe: MoEConfig, family: Family
) -> None:
    """Fields that contradict each other, refused by their config.json names before any
    tensor is read; then every range our sections declare (moe/model/config.py)."""
    H, KV = model.n_head, model.kv_heads
    if not family.upcycled and moe.top_k > moe.num_experts:
        raise refuse(
            path,
            f"it routes each token to {moe.top_k} experts (num_experts_per_tok or its "
            f"family's field) of {moe.num_experts}: more than there are",
        )
    if H < 1 or KV < 1 or H % KV:
        raise refuse(
            path,
            f"num_key_value_heads={KV} does not divide num_attention_heads={H}",
        )
    if not hf.get("head_dim") and model.d_model % H:
        raise refuse(
            path,
            f"num_attention_heads={H} does not divide hidden_size={model.d_model} and no "
            "head_dim is given",
        )
    p = Problems(filename=str(path))
    for name, section in (("model", model), ("moe", moe)):
        with p.section(name):
            validate(section, p)
    if p.items:
        raise refuse(path, "fields out of range, as our model reads them: " + "; ".join(p.items))


def read_architecture(folder: Path, moe_defaults: MoEConfig, seq_len: int) -> Architecture:
    """Our ModelConfig and MoEConfig for the Hugging Face model in `folder`. A dense model is
    upcycled with `moe_defaults.num_experts` experts and top_k; routing and balancing knobs
    (how it will train) come from `moe_defaults`, the shape from the checkpoint."""
    folder = Path(folder)
    hf = read_config(folder)
    path = folder / "config.json"
    family = _family(path, hf["model_type"])
    _check_fields(path, hf, family)
    dims = _dimensions(path, hf, family)
    shape = family.moe_shape(hf, dims["n_layer"], moe_defaults)
    model = _model_config(folder, hf, dims, shape, seq_len)
    for name, value in family.dimensions(hf).items():  # its attention's own shape
        setattr(model, name, value)
    for key, value in family.model_fields(hf).items():
        setattr(model, key, value)
    moe = _moe_config(moe_defaults, shape)
    _check_consistent(path, hf, model, moe, family)
    ids = {k: hf.get(f"{k}_token_id") for k in ("bos", "eos", "pad")}
    return Architecture(
        family.model_type,
        model,
        moe,
        int(hf["vocab_size"]),
        family.upcycled,
        int(hf.get("max_position_embeddings") or seq_len),
        {k: v if isinstance(v, int) else None for k, v in ids.items()},
    )
