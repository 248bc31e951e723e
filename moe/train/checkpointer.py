"""The training state a checkpoint holds, collected from the parts that own it (the model,
the optimizer, the RNGs, the progress counters, the expert load, early stopping, growth) and
given back to them on resume. One process writes it whole and tiered; the sharded engine
writes each rank's shards (DCP, moe/checkpoint/sharded.py)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe.checkpoint.codec import dtype_from_name
from moe.checkpoint.store import CheckpointStore
from moe.checkpoint.tensors import (
    flatten_optimizer,
    load_model_tensors,
    model_tensors,
    unflatten_optimizer,
)
from moe.errors import InputError
from moe.model.growth import GrowthManager, experts_per_layer, resize_model
from moe.model.stats import ExpertLoad
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.early_stop import EarlyStopper
from moe.train.optim import init_optimizer_state, optimizer_shards, param_names
from moe.train.ranks import Ranks
from moe.train.rng import rng_state, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """How far training is: steps, training time, tokens, the best validation loss."""

    step: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0
    best_val: float | None = None


@dataclass
class TrainState:
    """The stateful parts of a run. `new_optimizer(model)` builds a fresh optimizer for the
    model as it is (a checkpoint of a grown or pruned model resizes it)."""

    model: MoETransformer
    optimizer: torch.optim.Optimizer
    load: ExpertLoad
    progress: Progress
    stopper: EarlyStopper | None
    growth: GrowthManager | None
    new_optimizer: Callable[[MoETransformer], torch.optim.Optimizer]


class Checkpointer:
    """Saves and restores a TrainState. With `base_sha256` (a LoRA or QLoRA stage) the model
    part is what trains plus the routing state: the frozen base is the stage's input, named
    by that digest, and a checkpoint of adapters for another base is refused."""

    def __init__(
        self,
        store: CheckpointStore,
        fingerprint: str,
        ranks: Ranks,
        state: TrainState,
        base_sha256: str | None = None,
    ) -> None:
        self.store, self.fingerprint, self.ranks, self.state = store, fingerprint, ranks, state
        self.base_sha256 = base_sha256

    def _held_names(self) -> set[str] | None:
        """The model tensors a checkpoint holds: all (None), or (adapters) the trainable
        ones and the buffers."""
        if self.base_sha256 is None:
            return None
        m = self.state.model
        keep = {n for n, p in m.named_parameters() if p.requires_grad}
        return keep | {n for n, _ in m.named_buffers()}

    def _held(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        keep = self._held_names()
        return tensors if keep is None else {k: v for k, v in tensors.items() if k in keep}

    # ------------------------------------------------------------------ save

    def save(self, val_loss: float | None) -> Path | None:
        """World size 1: the whole state, tiered. Sharded: each rank writes its own shards,
        across machines through the store's `share` (the multi-node mirror). Across machines
        without one, every rank takes part in gathering the state whole and rank 0 writes it."""
        st, ranks = self.state, self.ranks
        if ranks.meshes is not None and (D.single_node() or self.store.share is not None):
            return self._save_sharded(val_loss)
        names = param_names(st.model, st.optimizer)
        if ranks.meshes is not None:
            opt_tensors, opt_rest = optimizer_shards(st.model, st.optimizer)
            opt_tensors = D.full_tensors(opt_tensors, keep=ranks.rank == 0)
            model_t = D.full_tensors(self._held(D.unique_state(st.model)), keep=ranks.rank == 0)
            if ranks.rank != 0:
                return None
        else:
            opt_tensors, opt_rest = flatten_optimizer(st.optimizer.state_dict())
            model_t = model_tensors(st.model, self._held_names())
        rng_tensors, rng_meta = rng_state()
        return self.store.save(
            st.progress.step,
            model_t,
            opt_tensors,
            rng_tensors,
            self._state_json(val_loss, opt_rest, rng_meta),
            param_names=names,
            expert_load=self._expert_load(),
        )

    def _save_sharded(self, val_loss: float | None) -> Path:
        rng_tensors, rng_meta = rng_state()
        rng_tensors["meta"] = torch.frombuffer(
            bytearray(json.dumps(rng_meta).encode()), dtype=torch.uint8
        )
        tensors = {
            **self._sharded_targets(),
            **{f"rng.{self.ranks.rank}.{k}": v for k, v in rng_tensors.items()},
        }
        _, opt_rest = optimizer_shards(self.state.model, self.state.optimizer)
        return self.store.save_sharded(
            self.state.progress.step,
            tensors,
            self._state_json(val_loss, opt_rest, {"sharded": "per rank"}),
            expert_load=self._expert_load(),
        )

    def _state_json(self, val_loss: float | None, opt_rest: dict, rng_meta: dict) -> dict:
        """What a checkpoint holds besides tensors (state.json), from each part."""
        st = self.state
        adapter = {"adapter": {"base_sha256": self.base_sha256}} if self.base_sha256 else {}
        return {
            "step": st.progress.step,
            "fingerprint": self.fingerprint,
            "optimizer": opt_rest,
            "rng": rng_meta,
            "elapsed_s": st.progress.elapsed_s,
            "tokens": st.progress.tokens,
            "val_loss": val_loss,
            "best_val": st.progress.best_val,
            "expert_counts_total": [t.tolist() for t in st.load.total],
            "early_stop": st.stopper.state_dict() if st.stopper else None,
            "growth": st.growth.state_dict() if st.growth else None,
            **adapter,
        }

    def _sharded_targets(self) -> dict[str, torch.Tensor]:
        st = self.state
        init_optimizer_state(st.optimizer)
        model = {f"model.{k}": v for k, v in self._held(D.unique_state(st.model)).items()}
        return {**model, **optimizer_shards(st.model, st.optimizer, by_name=True)[0]}

    def _expert_load(self) -> dict[str, list[float]]:
        """MoE layer prefix -> tokens routed to each expert so far (hot/cold tiers)."""
        m = self.state.model
        prefixes = [f"blocks.{i}.ffn" for i, b in enumerate(m.blocks) if b.ffn in m.moe_layers]
        return {p: row.tolist() for p, row in zip(prefixes, self.state.load.total, strict=False)}

    # ------------------------------------------------------------------ resume

    def resume(self) -> int | None:
        """Restore the newest valid checkpoint of these inputs into every part; the step it
        resumes from, or None (no checkpoint, or checkpoints of other inputs: cleared)."""
        path = self._chosen()
        if path is None:
            return None
        manifest, state = self.store.read_state(path)
        if state.get("fingerprint") != self.fingerprint:
            log.warning(
                "checkpoints in %s come from other inputs or params; starting fresh (DVC's cache keeps the old outputs)",
                self.store.root,
            )
            if self.ranks.rank == 0:
                self.store.clear()
            if self.ranks.world > 1:
                dist.barrier()
            return None
        self._check_base(path, state)
        if self.ranks.meshes is not None:
            rng, rng_meta = self._restore_sharded(path, manifest, state)
        else:
            rng, rng_meta = self._restore_whole(path)
        set_rng_state(rng, rng_meta)
        st = self.state
        st.progress.step = manifest.step
        st.progress.elapsed_s = float(state["elapsed_s"])
        st.progress.tokens = int(state["tokens"])
        st.progress.best_val = state.get("best_val")
        st.load.total = [
            torch.tensor(row, dtype=torch.float64) for row in state["expert_counts_total"]
        ]
        if st.stopper and state.get("early_stop"):
            st.stopper.load_state_dict(state["early_stop"])
        log.info("resumed from %s (step %d)", path, st.progress.step)
        return st.progress.step

    def _check_base(self, path: Path, state: dict) -> None:
        """Adapters restore onto the base they were trained on, and only as adapters."""
        saved = (state.get("adapter") or {}).get("base_sha256")
        if saved == self.base_sha256:
            return
        if saved is None:
            raise InputError(
                f"checkpoint {path} holds a full model, not adapters: this stage trains adapters "
                f"on the base {self.base_sha256}; delete {path.parent} to start over"
            )
        raise InputError(
            f"checkpoint {path} holds adapters for the base model {saved}, but this stage's "
            f"base is {self.base_sha256 or '(none: a full finetune)'}: restore it onto the "
            f"model it was trained on, or delete {path.parent} to start over"
        )

    def _chosen(self) -> Path | None:
        """The newest valid checkpoint; rank 0's choice for every rank: folders on different
        machines could disagree (a rank that cannot read it then fails, not another step)."""
        path = self.store.latest_valid()
        if self.ranks.world > 1:
            chosen = [path.name if path is not None else None]
            dist.broadcast_object_list(chosen, src=0)
            path = self.store.root / chosen[0] if chosen[0] is not None else None
        return path

    def _restore_whole(self, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
        """World size 1: the checkpoint whole (a sharded one assembled) into the module."""
        st = self.state
        ckpt = self.store.load(path)
        if self.base_sha256 is None and resize_model(
            st.model, experts_per_layer(ckpt.model, st.model)
        ):
            # The checkpoint comes from a grown or pruned model: new parameters, new optimizer.
            st.optimizer = st.new_optimizer(st.model)
            st.load = ExpertLoad(len(st.model.moe_layers), st.model.experts_per_layer())
        if st.growth and ckpt.state.get("growth"):
            st.growth.load_state_dict(ckpt.state["growth"])
        if self.base_sha256 is None:
            load_model_tensors(st.model, ckpt.model)
        else:
            _load_held(st.model, ckpt.model, path)
        opt, rng, rng_meta = ckpt.optimizer, ckpt.rng, ckpt.state["rng"]
        if ckpt.sharded:  # moments by parameter name, RNG per rank: rank 0's carries on
            index = {n: i for i, n in param_names(st.model, st.optimizer).items()}
            opt = {f"{index[k.rsplit('.', 1)[0]]}.{k.rsplit('.', 1)[1]}": v for k, v in opt.items()}
            rng = {k[2:]: v for k, v in rng.items() if k.startswith("0.")}
            rng_meta = json.loads(bytes(rng.pop("meta").numpy()))
        st.optimizer.load_state_dict(unflatten_optimizer(opt, ckpt.state["optimizer"]))
        return rng, rng_meta

    def _restore_sharded(
        self, path: Path, manifest: Any, state: dict
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """World size > 1: each rank reads its shards of a sharded checkpoint (DCP reshards
        one written at another world size or expert-parallel degree), or its part of a whole
        one (written at world size 1 or across machines). Each rank's RNG carries on where
        the checkpoint has it, else rank 0's."""
        if manifest.sharded:
            return self._read_shards(path, manifest)
        st = self.state
        ckpt = self.store.load(path)  # whole: every rank keeps its part of each tensor
        buffers = {n for n, _ in st.model.named_buffers()}
        for k, t in self._held(D.unique_state(st.model)).items():
            if k in ckpt.model:
                D.load_full(t, ckpt.model[k])
            elif k not in buffers:
                raise ValueError(f"checkpoint {path} does not fit the model: it has no {k}")
        init_optimizer_state(st.optimizer)
        for k, t in optimizer_shards(st.model, st.optimizer)[0].items():
            if k in ckpt.optimizer:  # a parameter that had no gradient yet has no state
                D.load_full(t, ckpt.optimizer[k])
        return ckpt.rng, state["rng"]

    def _read_shards(self, path: Path, manifest: Any) -> tuple[dict[str, torch.Tensor], dict]:
        targets = self._sharded_targets()
        missing = sorted(set(targets) - set(manifest.dcp))
        if missing:
            raise ValueError(
                f"checkpoint {path} does not fit the model: it has no {', '.join(missing[:5])}"
            )
        mine = f"rng.{self.ranks.rank}."
        prefix = mine if any(k.startswith(mine) for k in manifest.dcp) else "rng.0."
        rng = {
            k: torch.empty(v["size"], dtype=dtype_from_name(v["dtype"]))
            for k, v in manifest.dcp.items()
            if k.startswith(prefix)
        }
        self.store.load_sharded(path, {**targets, **rng})
        rng = {k.removeprefix(prefix): v for k, v in rng.items()}
        return rng, json.loads(bytes(rng.pop("meta").numpy()))


def _load_held(model: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """An adapter checkpoint's tensors into the model: every trainable parameter must be
    there, nothing else may be."""
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lacking = sorted(set(missing) & trainable)
    if lacking or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit the adapted model: missing {lacking[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
