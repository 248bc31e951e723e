"""A training state as flat dicts of CPU tensors, the form a checkpoint stores: a model's
tensors without aliases (and back into a model), an optimizer's state split into tensors and
JSON, and the digest that names a set of weights."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def model_tensors(model: torch.nn.Module, names: set[str] | None = None) -> dict[str, torch.Tensor]:
    """state_dict without aliases (tied embeddings appear once), contiguous, on CPU; only
    `names` when given (a LoRA checkpoint: nothing of the frozen base is copied)."""
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if names is not None and name not in names:
            continue
        key = t.data_ptr()
        if key in seen and t.numel() > 0:
            continue
        seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    return out


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load `tensors` into `model` in place; they must fit its parameters exactly."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights were saved once; routing-state buffers added since a file was written
    # keep their defaults; every parameter must match exactly.
    tied = {
        n
        for n in missing
        if n == "lm_head.weight" and getattr(model, "cfg", None) and model.cfg.tie_embeddings
    }
    buffers = {n for n, _ in model.named_buffers()}
    defaulted = sorted(n for n in missing if n in buffers)
    if defaulted:
        log.warning("tensors without these buffers (they keep their defaults): %s", defaulted)
    if set(missing) - tied - set(defaulted) or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing {sorted(set(missing) - tied - set(defaulted))}, unexpected {sorted(unexpected)}"
        )


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """torch optimizer state_dict -> (tensors for safetensors, JSON-able rest)."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for idx, pstate in state["state"].items():
        for key, value in pstate.items():
            name = f"{idx}.{key}"
            if torch.is_tensor(value):
                tensors[name] = value.detach().to("cpu").contiguous()
            else:
                scalars[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], rest: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten_optimizer`: a torch optimizer state_dict."""
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = t
    for name, v in rest["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = v
    return {"state": state, "param_groups": rest["param_groups"]}
