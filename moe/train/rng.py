"""Every random generator a step draws from (torch, CUDA, numpy, Python), as checkpoints hold
it: tensors beside the weights and a JSON rest."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    np_state = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(np_state[1].astype(np.int64))
    meta = {
        "numpy": [np_state[0], int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": random.getstate(),
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["torch"])
    if torch.cuda.is_available():
        states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("cuda"))]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    name, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state(
        (name, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached)
    )
    v, internal, g = meta["python"]
    random.setstate((v, tuple(internal), g))
