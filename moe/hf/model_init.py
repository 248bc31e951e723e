"""`model.init` for training: the configuration with the named model's architecture in place
of ours (`init_architecture`), and the model itself, whole in fp32 (`build_init_model`) or on
the meta device with the safetensors file each rank of the sharded engine reads its part from
(`init_model_skeleton`). The folder is a Hugging Face one (imported on the fly) or ours
(moe/hf/model_dir.py)."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from moe.checkpoint.tensors import load_model_tensors
from moe.config import Problems
from moe.errors import InputError
from moe.hf.architecture import EXPERT_ARCHITECTURE, read_architecture, read_config
from moe.hf.families.registry import FAMILIES
from moe.hf.importer import load_hf_model, stream_hf_weights
from moe.hf.model_dir import read_model_spec
from moe.hf.tokenizer_files import check_tokenizer
from moe.model.buffers import init_buffers
from moe.model.config import ModelConfig, MoEConfig
from moe.model.transformer import MoETransformer

log = logging.getLogger(__name__)

# The MoE fields a checkpoint fixes; the others (balancing, capacity, ...) say how to train.
MOE_SHAPE = (
    "num_experts",
    "top_k",
    "expert_hidden",
    "renormalize",
    "shared_expert",
    "shared_expert_hidden",
    "shared_expert_gate",
    "score_func",
    "n_group",
    "topk_group",
    "routed_scale",
    *EXPERT_ARCHITECTURE,
)


def resolve_init(params: Any, p: Problems, tokenizer: bool = True) -> None:
    """A params tree (moe/recipes/params.py) with model.init: the model's architecture in place
    of the model and moe sections' shape fields, and its tokenizer as tokenizer.path (unless
    one is given); what is wrong with the folder goes to `p` under model.init.
    `tokenizer=False` (a plan) takes a folder with its config.json alone."""
    try:
        params.model, params.moe = init_architecture(params.model, params.moe, tokenizer)
        own = Path(params.model.init) / "tokenizer.json"
        if not params.tokenizer.path and (tokenizer or own.is_file()):
            params.tokenizer.path = str(own)
    except InputError as e:  # its own "model.init = '...': " once, from p
        said = f"model.init = {str(params.model.init)!r}: "
        p.add("model.init", params.model.init, str(e).removeprefix(said))


def init_architecture(
    model: ModelConfig, moe: MoEConfig, tokenizer: bool = True
) -> tuple[ModelConfig, MoEConfig]:
    """The configuration with `model.init`'s architecture in place of the model section's
    shape fields and the MoE shape fields; the training length (seq_len), the routing and
    balancing knobs stay the user's. A dense model is upcycled to moe.num_experts, top_k."""
    folder = Path(model.init)
    if (folder / "model.json").is_file():  # a folder written by `model import` or a stage
        spec = read_model_spec(folder)
        counts = spec.get("experts_per_layer") or []
        if len(set(counts)) > 1:
            raise InputError(
                f"{folder}: its MoE layers have unequal expert counts {counts} (after growth);"
                " start from it with the checkpoint tools, not model.init"
            )
        arch_model = ModelConfig(**spec["model"])
        shape = {k: spec["moe"][k] for k in MOE_SHAPE if k in spec["moe"]}
    else:
        arch = read_architecture(folder, moe, model.seq_len)
        arch_model = arch.model
        shape = {k: getattr(arch.moe, k) for k in MOE_SHAPE}
    if tokenizer and not (folder / "tokenizer.json").is_file():
        raise InputError(
            f"model.init = {model.init!r}: no tokenizer.json in it; the model must be trained"
            " with its own tokenizer"
        )
    check_tokenizer(folder)
    source_type = _source_type(folder)
    balancing = list(moe.balancing)
    # An architecture with a selection bias (ERNIE-4.5-MoE, DeepSeek-V3, GLM-4.5) keeps
    # aux_free: its correction bias is ours. A dense model upcycled (or ours) exports with the
    # bias as ERNIE-4.5-MoE, which has no q/k norm, no gated shared expert and always
    # renormalises.
    ernie_fits = (
        arch_model.qk_norm == "none" and not shape["shared_expert_gate"] and shape["renormalize"]
    )
    family = FAMILIES.get(source_type)
    moe_family = family is not None and not family.upcycled
    from_moe = moe_family and not family.selection_bias  # type: ignore[union-attr]
    keeps_bias = moe_family and bool(family.selection_bias)  # type: ignore[union-attr]
    if "aux_free" in balancing and not keeps_bias and (from_moe or not ernie_fits):
        # The imported architecture has no selection bias: a model trained with one could
        # not be exported back to it (export_plan refuses). Train it as it was made instead.
        balancing = [m for m in balancing if m != "aux_free"]
        if "aux_loss" not in balancing:
            balancing.insert(0, "aux_loss")
        log.warning(
            "model.init is %s, whose router has no selection bias: moe.balancing aux_free"
            " replaced by aux_loss (%s), so the trained model exports back to %s exactly",
            source_type,
            balancing,
            source_type,
        )
    shape["balancing"] = balancing
    arch_model.init = model.init
    arch_model.init_pretrain = model.init_pretrain
    arch_model.seq_len = model.seq_len
    arch_model.init_std = model.init_std
    new_moe = MoEConfig(**{**asdict(moe), "growth": moe.growth, **shape})
    return arch_model, new_moe


def _source_type(folder: Path) -> str:
    """The Hugging Face model_type a model.init folder came from ("" if none)."""
    if (folder / "model.json").is_file():
        return (read_model_spec(folder).get("source") or {}).get("model_type", "")
    return str(read_config(folder).get("model_type", ""))


def _stream_once(model: ModelConfig, moe: MoEConfig, folder: Path, weights: Path) -> None:
    """The Hugging Face folder streamed into `weights` by the first process of each machine;
    every rank learns of a failure instead of waiting for the file."""
    failed: BaseException | None = None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        try:
            weights.parent.mkdir(parents=True, exist_ok=True)
            stream_hf_weights(folder, weights, moe, model.seq_len, torch.float32)
        except Exception as e:  # every rank learns of it, instead of waiting for it
            failed = e
            with contextlib.suppress(OSError):  # the scratch folder it made, left empty
                weights.parent.rmdir()
    if dist.is_initialized():
        on_gpu = dist.get_backend() == "nccl"
        flag = torch.tensor(
            [float(failed is not None)],
            device=torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu",
        )
        dist.all_reduce(flag)
        if failed is None and float(flag) > 0:
            raise InputError(
                f"model.init = {model.init!r}: the import failed on another machine's first"
                " process (its log says why)"
            )
    if failed is not None:
        raise failed


def init_model_skeleton(
    model: ModelConfig, moe: MoEConfig, scratch: Path
) -> tuple[MoETransformer, Path]:
    """`model.init` for the sharded engine: the model on the meta device and the safetensors
    file each rank reads its part from. A folder of ours has one; a Hugging Face folder is
    streamed once into `scratch` (by the first process of each machine; the caller waits for
    it) in fp32, as `build_init_model` would load it."""
    folder = Path(model.init)
    if (folder / "model.json").is_file():
        vocab = int(read_model_spec(folder)["vocab_size"])
        weights = folder / "model.safetensors"
    else:
        vocab = read_architecture(folder, moe, model.seq_len).vocab_size
        weights = Path(scratch) / "model.safetensors"
        _stream_once(model, moe, folder, weights)
    with torch.device("meta"):
        out = MoETransformer(model, moe, vocab)
    return out, weights


def build_init_model(model: ModelConfig, moe: MoEConfig) -> MoETransformer:
    """The model `model.init` names, in fp32 for training, built with the pipeline's
    (resolved) configuration: the checkpoint's weights under the pipeline's training knobs."""
    folder = Path(model.init)
    if not (folder / "model.json").is_file():
        hf_model, _ = load_hf_model(folder, moe, model.seq_len, torch.float32)
        hf_model.cfg.init, hf_model.cfg.init_pretrain = model.init, model.init_pretrain
        hf_model.cfg.init_std = model.init_std
        return hf_model
    spec = read_model_spec(folder)
    with torch.device("meta"):
        out = MoETransformer(model, moe, int(spec["vocab_size"]))
    out = out.to_empty(device="cpu")
    init_buffers(out)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        load_model_tensors(out, {k: f.get_tensor(k).float() for k in f.keys()})
    return out
