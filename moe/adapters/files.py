"""A stage's adapters on disk, beside its merged model: adapter.safetensors (what trained)
and adapter.json (how they were made, the base's digest and path, each adapted projection's
output segments), what `model export` turns into a PEFT folder (moe/adapters/peft.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from moe.adapters.config import Adapted
from moe.adapters.lora import LoRALinear
from moe.model.transformer import MoETransformer

ADAPTER_FORMAT = "moe-pipeline-adapter/1"


def adapter_spec(cfg: Adapted, base_sha256: str | None, init: Path | None) -> dict[str, Any]:
    """adapter.json's body: the method and its settings, the router policy, the base."""
    return {
        "method": cfg.method,
        "lora": dataclasses.asdict(cfg.lora),
        "router": cfg.router_policy(),
        "base_sha256": base_sha256,
        "base": str(init) if init else None,
    }


def save_adapter_dir(model: MoETransformer, out_dir: Path, spec: dict[str, Any]) -> Path:
    """adapter.safetensors (what trained: the adapters, and any base weight the stage let
    learn, such as trained router gates) and adapter.json (`spec`, the format and each
    adapted projection's output segments), beside a stage's merged model."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters() if p.requires_grad
    }
    save_file(tensors, str(out_dir / "adapter.safetensors"))
    segments = {n: list(m.segments) for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    body = {"format": ADAPTER_FORMAT, **spec, "segments": segments}
    (out_dir / "adapter.json").write_text(json.dumps(body, indent=1))
    return out_dir / "adapter.safetensors"
