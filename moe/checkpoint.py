"""Checkpoint store: every checkpoint is one consistent, verified training state.

Layout: ROOT/step_00000100/{model,optimizer,rng}.safetensors + state.json + manifest.json.
A write goes to a temporary folder, every file is fsynced, the manifest (sha256 of every
file) is written last, then the folder is renamed into place and `latest` is updated.
Restore verifies every hash and skips, with a warning naming it, a damaged or incomplete
checkpoint. Nothing is read with pickle: tensors through safetensors, state through JSON.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict without aliases (tied embeddings appear once), contiguous, on CPU."""
    seen: dict[int, str] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        key = t.data_ptr()
        if key in seen and t.numel() > 0:
            continue
        seen[key] = name
        out[name] = t.detach().to("cpu").contiguous()
    return out


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Tied weights were saved once; everything else must match exactly.
    tied = {
        n
        for n in missing
        if n == "lm_head.weight" and getattr(model, "cfg", None) and model.cfg.tie_embeddings
    }
    if set(missing) - tied or unexpected:
        raise ValueError(
            f"checkpoint does not fit the model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}"
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
    state: dict[int, dict[str, Any]] = {}
    for name, t in tensors.items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = t
    for name, v in rest["scalars"].items():
        idx, key = name.split(".", 1)
        state.setdefault(int(idx), {})[key] = v
    return {"state": state, "param_groups": rest["param_groups"]}


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    state: dict[str, Any]


class CheckpointStore:
    """Write, verify, retain and restore training checkpoints under one folder."""

    def __init__(self, root: str | Path, keep_last: int = 3) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def _dirs(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.glob("step_*") if p.is_dir()), reverse=True)

    def save(
        self,
        step: int,
        model: dict[str, torch.Tensor],
        optimizer: dict[str, torch.Tensor],
        rng: dict[str, torch.Tensor],
        state: dict[str, Any],
    ) -> Path:
        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {
            "model.safetensors": model,
            "optimizer.safetensors": optimizer,
            "rng.safetensors": rng,
        }
        for name, tensors in files.items():
            save_file(tensors, str(tmp / name))
            with open(tmp / name, "rb+") as f:
                os.fsync(f.fileno())
        _fsync_write(tmp / "state.json", json.dumps(state, indent=1, sort_keys=True).encode())
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "time": time.time(),
            "files": {
                p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                for p in sorted(tmp.iterdir())
            },
        }
        _fsync_write(
            tmp / MANIFEST, json.dumps(manifest, indent=1).encode()
        )  # last: marks complete
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_write(self.root / ".latest.tmp", final.name.encode())
        os.replace(self.root / ".latest.tmp", self.root / "latest")
        _fsync_dir(self.root)
        self._retain()
        log.info("checkpoint step %d written to %s in %.2fs", step, final, time.perf_counter() - t0)
        return final

    def _retain(self) -> None:
        for old in self._dirs()[self.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)

    def verify(self, path: Path) -> str | None:
        """None when `path` is a complete checkpoint whose files match its manifest; else why not."""
        mpath = path / MANIFEST
        if not mpath.is_file():
            return "no manifest.json (the write did not finish)"
        try:
            manifest = json.loads(mpath.read_text())
            files = manifest["files"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            return f"unreadable manifest.json ({e})"
        for name, meta in files.items():
            f = (path / name).resolve()
            if f.parent != path.resolve():
                return f"manifest names a file outside the checkpoint folder: {name!r}"
            if not f.is_file():
                return f"{name} is missing"
            if sha256_file(f) != meta["sha256"]:
                return f"{name} does not match its sha256 (damaged)"
        return None

    def latest_valid(self) -> Path | None:
        """Newest checkpoint that verifies; damaged ones are skipped with a warning."""
        for path in self._dirs():
            why = self.verify(path)
            if why is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, why)
        return None

    def load(self, path: Path) -> Checkpoint:
        why = self.verify(path)
        if why is not None:
            raise ValueError(f"checkpoint {path} failed verification: {why}")
        state = json.loads((path / "state.json").read_text())
        return Checkpoint(
            path=path,
            step=int(state["step"]),
            model=load_file(str(path / "model.safetensors")),
            optimizer=load_file(str(path / "optimizer.safetensors")),
            rng=load_file(str(path / "rng.safetensors")),
            state=state,
        )

    def clear(self) -> None:
        for p in self._dirs():
            shutil.rmtree(p, ignore_errors=True)
        (self.root / "latest").unlink(missing_ok=True)
