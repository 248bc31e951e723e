"""Safetensors files in and out: the shards of a checkpoint folder (with or without its index),
read lazily through memory maps (`Shards`); a file written one tensor at a time, in any order
(`StreamingSafetensors`); and Hugging Face weight shards of at most SHARD_BYTES each, with an
index when there are several (`write_shards`). Knows file layouts, not model names."""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe.hf.errors import refuse

# safetensors' dtype names
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
SHARD_BYTES = 2 << 30
INDEX = "model.safetensors.index.json"


def shard_files(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The safetensors files of a checkpoint folder (named by its index when it has one) and
    the index's tensor -> file map ({} without an index)."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError) as e:
            raise refuse(index, f"not JSON with a weight_map ({e})") from e
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise refuse(index, "its weight_map is not a mapping of tensor names to files")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        weight_map = {}
    if not files:
        raise refuse(folder, "no *.safetensors weights (a .bin checkpoint: convert it first)")
    return files, weight_map


class Shards:
    """The tensors of a folder's safetensors files, read lazily through memory maps."""

    def __init__(self, folder: Path) -> None:
        files, weight_map = shard_files(folder)
        self.folder = folder
        self.handles = {}
        for name in files:
            if not (folder / name).is_file():
                raise refuse(folder / INDEX, f"names the shard {name}, which is missing")
            try:
                self.handles[name] = safe_open(str(folder / name), framework="pt")
            except Exception as e:  # safetensors' own error for a damaged header
                raise refuse(
                    folder / name, f"not a readable safetensors file ({e}): download it again"
                ) from e
        self.where: dict[str, str] = {}  # tensor -> the file that holds it
        held: dict[str, str] = {}
        for name, h in self.handles.items():
            for k in h.keys():
                if k in held:  # which copy would be read depends on the order of the files
                    raise refuse(
                        folder,
                        f"tensor {k!r} is in both {held[k]} and {name}: keep one (the index "
                        "names one file per tensor)",
                    )
                held[k] = name
                self.where[k] = name
        for k, name in weight_map.items():  # the index is what transformers reads
            if held.get(k) != name:
                where = f"it is in {held[k]}" if k in held else "no shard holds it"
                raise refuse(
                    folder / INDEX,
                    f"maps tensor {k!r} to {name}, which does not hold it ({where})",
                )
        self.used: set[str] = set()
        self.last = ""  # the tensor read last (what a shape error inside a reader was about)
        self.read: list[str] = []  # the tensors read since the caller last cleared it

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        if key not in self.where:
            raise refuse(self.folder, f"tensor {key!r} is missing from the checkpoint")
        self.used.add(key)
        self.last = key
        self.read.append(key)
        file = self.where[key]
        try:
            t = self.handles[file].get_tensor(key)
        except Exception as e:  # the bytes of a truncated or damaged file
            raise refuse(
                self.folder / file, f"tensor {key!r} cannot be read ({e}): download it again"
            ) from e
        if not t.is_floating_point():
            raise refuse(
                self.folder / file,
                f"tensor {key!r} is {t.dtype}, not a floating-point weight: a quantised or "
                "damaged checkpoint; import the model's float (bf16/fp16/fp32) weights",
            )
        if not bool(torch.isfinite(t).all()):
            raise refuse(
                self.folder / file,
                f"tensor {key!r} holds non-finite values (NaN or inf): training would start "
                "from them; use an undamaged copy of the checkpoint",
            )
        return t

    def get_packed(self, key: str) -> torch.Tensor:
        """A quantised tensor's bytes as stored (uint8: MXFP4 blocks and scales), for the
        family that dequantises them (moe/hf/families/gpt_oss.py)."""
        if key not in self.where:
            raise refuse(self.folder, f"tensor {key!r} is missing from the checkpoint")
        self.used.add(key)
        self.last = key
        self.read.append(key)
        t = self.handles[self.where[key]].get_tensor(key)
        if t.dtype != torch.uint8:
            raise refuse(self.folder / self.where[key], f"tensor {key!r} is {t.dtype}, not uint8")
        return t

    def shape(self, key: str) -> tuple[int, ...]:
        """A tensor's shape from the file's header, without reading the tensor."""
        return tuple(self.handles[self.where[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        """A tensor's dtype from the file's header, without reading the tensor."""
        if key not in self.where:
            raise refuse(self.folder, f"tensor {key!r} is missing from the checkpoint")
        name = self.handles[self.where[key]].get_slice(key).get_dtype()
        if name not in DTYPES:
            raise refuse(
                self.folder / self.where[key],
                f"tensor {key!r} is stored as {name}; weights import from "
                f"{', '.join(sorted(DTYPES))}",
            )
        return DTYPES[name]

    def unused(self) -> list[str]:
        return sorted(set(self.where) - self.used)


class StreamingSafetensors:
    """A safetensors file written one tensor at a time, in any order: the header (every
    name, dtype, shape and offset, known from the model's shapes) first, then each tensor's
    bytes at its offset as it comes. `safetensors.torch.save_file` needs every tensor in
    memory at once; an import of a 30B-parameter model cannot afford that. What it writes is
    read back by safetensors itself (tests/test_hf.py)."""

    def __init__(self, path: Path, layout: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
        names = {v: k for k, v in DTYPES.items()}
        header: dict[str, Any] = {}
        offset = 0
        for name, (dtype, shape) in layout.items():
            n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": names[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.layout, self.header, self.left = layout, header, set(layout)
        self.path = Path(path)
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.base = 8 + len(raw)
        self.f.truncate(self.base + offset)

    def write(self, name: str, t: torch.Tensor) -> None:
        dtype, shape = self.layout[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, the file expects {shape}")
        start, end = self.header[name]["data_offsets"]
        data = t.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == end - start
        self.f.seek(self.base + start)
        self.f.write(data.numpy().tobytes())
        self.left.discard(name)

    def close(self) -> None:
        if self.left:
            raise ValueError(f"{self.path}: no data for {sorted(self.left)[:5]}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_shards(tensors: Iterable[tuple[str, torch.Tensor]], out: Path) -> list[str]:
    """Safetensors shards of at most SHARD_BYTES each, with an index when there are several."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        names.append(name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    return names
