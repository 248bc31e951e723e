"""Our own model folder format (FORMAT): model.safetensors in our tensor names beside
model.json, the architecture and expert counts the weights need. What a training stage writes,
what `moe-pipeline model import` writes, and what `model export` and `model.init` read."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe.checkpoint.tensors import load_model_tensors, model_tensors
from moe.errors import InputError
from moe.hf.safetensors_io import DTYPES
from moe.model.buffers import init_buffers
from moe.model.config import GrowthConfig, ModelConfig, MoEConfig
from moe.model.growth import resize_model
from moe.model.transformer import MoETransformer

FORMAT = "moe-pipeline-model/1"


def save_model_dir(
    model: MoETransformer, out_dir: Path, extra: dict[str, Any] | None = None
) -> Path:
    """Our model folder: model.safetensors (our names) and model.json (the architecture)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(model_tensors(model), str(out_dir / "model.safetensors"))
    write_model_spec(model, out_dir, extra)
    return out_dir / "model.safetensors"


def save_stage_model(model: MoETransformer, out_dir: Path, start: Path | None = None) -> Path:
    """A stage's model folder: what the next stage, `model export` and `ask` read. It keeps
    the source record of the Hugging Face model it descends from: that of the model folder it
    started from (`start`: an earlier stage's, or one `model import` wrote), else of
    model.init (its model.json's, or the Hugging Face folder's path and model type)."""
    init = Path(model.cfg.init) if model.cfg.init else None
    for folder in (start, init):
        if folder is not None and (folder / "model.json").is_file():
            source = json.loads((folder / "model.json").read_text()).get("source")
            if source:
                return save_model_dir(model, out_dir, {"source": source})
    extra = {}
    if init is not None and not (init / "model.json").is_file():
        extra = {"source": {"path": model.cfg.init, "model_type": _init_type(init)}}
    return save_model_dir(model, out_dir, extra)


def _init_type(init: Path) -> str:
    try:
        return json.loads((init / "config.json").read_text()).get("model_type", "")
    except (OSError, json.JSONDecodeError):
        return ""


def write_model_spec(model: MoETransformer, out_dir: Path, extra: dict[str, Any] | None) -> None:
    """model.json: what the weights beside it are (the architecture, the expert counts)."""
    spec = {
        "format": FORMAT,
        "model": asdict(model.cfg),
        "moe": asdict(model.mcfg),
        "vocab_size": model.vocab_size,
        "experts_per_layer": model.experts_per_layer(),  # after growth / pruning
        **(extra or {}),
    }
    (Path(out_dir) / "model.json").write_text(json.dumps(spec, indent=1))


def read_model_spec(model_dir: Path) -> dict[str, Any]:
    """model.json of a model folder, refused when missing or not JSON."""
    spec_path = Path(model_dir) / "model.json"
    if not spec_path.is_file() and (Path(model_dir) / "config.json").is_file():
        raise InputError(
            f"{model_dir} is a Hugging Face folder, not a model folder: import it first"
            f" (moe-pipeline model import {model_dir} OUT), or start from it with model.init"
        )
    if not spec_path.is_file():
        raise InputError(f"{spec_path} is missing: run the stage that writes {model_dir} first")
    try:
        return json.loads(spec_path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{spec_path}: not JSON (line {e.lineno}: {e.msg})") from e


def model_dir_skeleton(model_dir: Path) -> MoETransformer:
    """The model a folder written by `save_model_dir` holds, on the meta device (shapes, no
    weights): for the sharded engine to fill each rank's part from `model.safetensors`."""
    spec = read_model_spec(Path(model_dir))
    moe_spec = dict(spec["moe"])
    growth = GrowthConfig(**moe_spec.pop("growth", {}))
    cfg = ModelConfig(**spec["model"])
    with torch.device("meta"):
        model = MoETransformer(cfg, MoEConfig(**moe_spec, growth=growth), spec["vocab_size"])
    if spec.get("experts_per_layer"):
        resize_model(model, spec["experts_per_layer"])
    return model


def load_model_dir(model_dir: Path, dtype: torch.dtype | None = None) -> MoETransformer:
    """A model folder written by `save_model_dir` (a stage's model or an import)."""
    model_dir = Path(model_dir)
    model = model_dir_skeleton(model_dir)
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        dtype = dtype or DTYPES[f.get_slice("embed.weight").get_dtype()]
        model = model.to_empty(device="cpu").to(dtype)
        init_buffers(model)
        load_model_tensors(model, {k: f.get_tensor(k) for k in f.keys()})
    return model
