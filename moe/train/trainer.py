"""The trainer: AdamW with parameter groups, schedules, accumulation, bf16, clipping, resume.

One loop for pretraining (warm-up + cosine) and finetuning (warm-up + linear decay). A batch
source is anything with `batch_at(step, micro) -> (x, y, loss_weight | None)`, a pure function
of its arguments, so the data position is just the step and resume is exact: training killed
at any step and resumed ends with bit-identical weights on CPU.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental import implicit_replication

from moe.checkpoint.codec import dtype_from_name
from moe.checkpoint.store import (
    CheckpointStore,
    flatten_optimizer,
    load_model_tensors,
    model_tensors,
    unflatten_optimizer,
)
from moe.config import OptimConfig
from moe.model.growth import GrowthManager, experts_per_layer, resize_model
from moe.model.routing import AFTER_WARMUP
from moe.model.stats import ExpertLoad, summarize
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.early_stop import EarlyStopper
from moe.train.resilience import AttemptJournal, IntervalChoice, choose_interval

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


class BatchSource(Protocol):
    def batch_at(self, step: int, micro: int = 0) -> Batch: ...


def resolve_device(name: str, setting: str = "pretrain.device") -> torch.device:
    """auto: the GPU when there is one, else the CPU; `setting` names the knob in errors."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(
            f"{setting}={name!r} but CUDA is not available on this machine; use auto or cpu"
        )
    return torch.device(name)


def autocast_dtype(device: torch.device, dtype: str) -> torch.dtype | None:
    """bf16 autocast on CUDA by default; on CPU only when asked (`dtype: bfloat16`)."""
    if dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def build_optimizer(
    model: MoETransformer, cfg: OptimConfig, router_lr_mult: float, foreach: bool = False
) -> torch.optim.AdamW:
    """AdamW groups: decayed matrices, undecayed norms/biases, and the routers at a higher lr.
    `foreach` (the sharded engine): one multi-tensor op per group instead of one DTensor
    dispatch per parameter and op."""
    decay, no_decay, router = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if ".router." in name:
            router.append(p)
        elif p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "lr_mult": 1.0, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "lr_mult": 1.0, "name": "no_decay"},
        # routers learn 3-5x faster than the base rate; no weight decay on them.
        {"params": router, "weight_decay": 0.0, "lr_mult": router_lr_mult, "name": "router"},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False, foreach=foreach
    )


def lr_at(
    step: int,
    max_steps: int,
    lr: float,
    warmup: int,
    min_lr: float,
    schedule: Literal["cosine", "linear"],
) -> float:
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
    return lr + (min_lr - lr) * min(1.0, progress)


@dataclass
class TrainResult:
    steps: int
    resumed_from: int | None
    train_loss: float
    val_loss: float | None
    tokens: int
    wall_s: float
    stop_reason: str
    checkpoint: str
    tokens_per_s: float
    expert_share: list[list[float]] = field(default_factory=list)
    expert_cv: float = 0.0
    expert_events: list[dict[str, Any]] = field(default_factory=list)  # growth / pruning
    experts_per_layer: list[int] = field(default_factory=list)
    # Interruptions survived, their cost and goodput; the checkpoint interval and its inputs.
    resilience: dict[str, Any] = field(default_factory=dict)
    # The process group it trained in: "nccl" or "gloo" and how many processes ("" and 1 alone)
    backend: str = ""
    world: int = 1


def _rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
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


def _set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
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


@dataclass
class Budget:
    """What a run costs and may cost: the hourly price of the machines it runs on, and what
    is left of the pipeline's budget for this stage (0 = no budget): an alert at `alert` of
    it, a stop with a checkpoint when it is spent."""

    price_per_hour: float = 0.0
    left: float = 0.0
    alert: float = 0.8

    def cost(self, seconds: float) -> float:
        return seconds / 3600 * self.price_per_hour


@dataclass
class Validation:
    """The held-out loss: `batches` batches of `source` every `every` steps (and at the last
    step). It picks the best checkpoint and drives early stopping."""

    source: BatchSource
    every: int
    batches: int


@dataclass
class Resilience:
    """What carries a run across interruptions: the attempt journal beside its checkpoints,
    when this process started (what a restart costs is measured from it; None = now) and,
    for checkpoint.every: auto, the pool's mean time between interruptions in seconds
    (None = a save every cfg.checkpoint_every steps; 0 = no interruptions declared)."""

    journal: AttemptJournal | None = None
    started_at: float | None = None
    auto_mtbi_s: float | None = None


@dataclass
class _Run:
    """What one call of Trainer.fit tracks between its steps."""

    resumed: int | None  # the step it resumed from
    restore_s: float  # what reading that checkpoint took
    next_save: int
    t0: float  # training time and step when this run started (auto interval: step time)
    step0: int
    params: list[torch.nn.Parameter]  # the trainable ones (growth replaces them)
    window_t0: float  # the current logging window: since when, its loss and tokens
    window_loss: float = 0.0
    window_tokens: int = 0
    steps: int = 0  # steps taken in this run
    last_loss: float = float("nan")
    val_loss: float | None = None
    aux: Any = None  # the last forward's routing statistics


class Trainer:
    def __init__(
        self,
        model: MoETransformer,
        cfg: OptimConfig,
        batches: BatchSource,
        store: CheckpointStore,
        *,
        fingerprint: str,
        schedule: Literal["cosine", "linear"],
        min_lr: float = 0.0,
        expert_warmup: bool = True,
        router_lr_mult: float = 1.0,
        validation: Validation | None = None,
        budget: Budget | None = None,
        log_fn: Callable[[dict[str, Any]], None] | None = None,
        metrics_path: Path | None = None,
        stop_after: int | None = None,
        clock: Callable[[], float] = time.perf_counter,
        resilience: Resilience | None = None,
        weights: Path | None = None,
    ) -> None:
        """`model` may be built on the meta device when training under torchrun: it is then
        sharded first and each rank fills its shards only, from `weights` (a safetensors
        file in the model's names) or, without it, with the initialisation one process
        would draw after the same seed."""
        self.device = resolve_device(cfg.device)
        # Under torchrun: data parallel + expert parallel (moe/train/distributed.py). Each rank
        # trains on its rows of every global batch and holds 1/world of the experts.
        self.rank, self.world = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        )
        self.amp_dtype = autocast_dtype(self.device, cfg.dtype)
        # Under torchrun (even one process: the GPU path of tests/test_cuda.py) the model is
        # sharded (FSDP2 + expert parallelism); a plain run trains the module as it is.
        self.meshes: D.Meshes | None = None
        if dist.is_initialized():
            if self.device.type == "cuda":
                self.device = torch.device("cuda", torch.cuda.current_device())
            meta = D.on_meta(model)
            if not meta:
                model.to(self.device)
            ep = D.expert_degree(cfg.expert_parallel, self.world, model.mcfg.num_experts)
            self.meshes = D.make_meshes(self.device, ep)
            # bf16 (on CUDA by default, on CPU when asked): FSDP gathers bf16, reduces fp32.
            bf16 = self.amp_dtype == torch.bfloat16
            D.parallelize(model, self.meshes, param_dtype=torch.bfloat16 if bf16 else None)
            if meta:  # built on the meta device: each rank materialises its shards only
                from moe.hf.convert import init_buffers

                model.to_empty(device=self.device)
                init_buffers(model)
                if weights is not None:
                    D.load_safetensors(model, weights)
                else:
                    D.init_like_one_process(model)
            for layer in model.moe_layers:  # the balancing loss enters through each block
                layer.aux_grad_scale = 1.0 / cfg.grad_accum
                layer.router.balance_group = dist.group.WORLD  # of the global batch
        if getattr(cfg, "activation_checkpoint", False):
            for block in model.blocks:
                block.recompute = True
            for layer in model.moe_layers:  # the balancing loss inside the recomputed block
                layer.aux_grad_scale = 1.0 / cfg.grad_accum
        self.model = model.to(self.device)
        self.cfg, self.batches, self.store = cfg, batches, store
        self.fingerprint, self.schedule, self.min_lr = fingerprint, schedule, min_lr
        self.expert_warmup = expert_warmup  # False for finetuning: no uniform routing again
        self.validation = validation
        self.budget = budget or Budget()
        self._budget_warned = False
        self.log_fn = log_fn or (lambda row: None)
        self.metrics_path = metrics_path
        self.stop_after = stop_after  # testing aid: return after this many steps (simulates a kill)
        # Every decision that reads the time (cost, budget stops, time_budget_s, the lr under a
        # time budget) reads this clock: tests inject one so they do not depend on CPU speed.
        self.clock = clock
        resilience = resilience or Resilience()
        self.auto_mtbi_s = resilience.auto_mtbi_s
        self.interval: IntervalChoice | None = None
        self.journal, self.started_at = resilience.journal, resilience.started_at
        self.router_lr_mult = router_lr_mult
        self.optimizer = build_optimizer(
            model, cfg, router_lr_mult, foreach=self.meshes is not None
        )
        # Expert growth and pruning (moe/model/growth.py), pretraining only.
        self.growth = (
            GrowthManager(model, model.mcfg.growth, seed=cfg.seed)
            if model.mcfg.growth.enabled and expert_warmup
            else None
        )
        self.load = ExpertLoad(len(model.moe_layers), model.experts_per_layer())
        self.step = 0
        self.expert_events: list[dict[str, Any]] = []
        self.elapsed_s = 0.0
        self.tokens = 0
        self.best_val: float | None = None
        early = getattr(cfg, "early_stop", None)
        self.stopper = (
            EarlyStopper(early, cfg.lr) if early is not None and validation is not None else None
        )

    # ------------------------------------------------------------------ state

    def _train_state(self, val_loss: float | None, opt_rest: dict, rng_meta: dict) -> dict:
        """What a checkpoint holds besides tensors (state.json)."""
        return {
            "step": self.step,
            "fingerprint": self.fingerprint,
            "optimizer": opt_rest,
            "rng": rng_meta,
            "elapsed_s": self.elapsed_s,
            "tokens": self.tokens,
            "val_loss": val_loss,
            "best_val": self.best_val,
            "expert_counts_total": [t.tolist() for t in self.load.total],
            "early_stop": self.stopper.state_dict() if self.stopper else None,
            "growth": self.growth.state_dict() if self.growth else None,
        }

    def _save(self, val_loss: float | None) -> Path | None:
        """World size 1: the whole state, tiered. Sharded: each rank writes its own shards
        (DCP, moe/checkpoint/sharded.py), across machines through the store's `share` (the multi-node
        mirror). Across machines without one, every rank takes part in gathering the state
        whole and rank 0 writes it."""
        if self.meshes is not None and (D.single_node() or self.store.share is not None):
            return self._save_sharded(val_loss)
        names = self._param_names()
        if self.meshes is not None:
            opt_tensors, opt_rest = self._optimizer_shards()
            opt_tensors = D.full_tensors(opt_tensors, keep=self.rank == 0)
            model_t = D.full_tensors(D.unique_state(self.model), keep=self.rank == 0)
            if self.rank != 0:
                return None
        else:
            opt_tensors, opt_rest = flatten_optimizer(self.optimizer.state_dict())
            model_t = model_tensors(self.model)
        rng_tensors, rng_meta = _rng_state()
        return self.store.save(
            self.step,
            model_t,
            opt_tensors,
            rng_tensors,
            self._train_state(val_loss, opt_rest, rng_meta),
            param_names=names,
            expert_load=self._expert_load(),
        )

    def _optimizer_shards(self, by_name: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
        """This rank's optimizer moments ("<index>.<moment>", or "optim.<parameter>.<moment>"
        with by_name) and the JSON rest (param groups), as flatten_optimizer gives them."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        flat = [p for g in self.optimizer.param_groups for p in g["params"]]
        tensors: dict[str, torch.Tensor] = {}
        for i, p in enumerate(flat):
            for k, v in self.optimizer.state.get(p, {}).items():
                tensors[f"optim.{names[id(p)]}.{k}" if by_name else f"{i}.{k}"] = v
        groups = self.optimizer.state_dict()["param_groups"]
        return tensors, {"param_groups": groups, "scalars": {}}

    def _init_optimizer_state(self) -> None:
        """AdamW's state before its first step (zeros, step 0), so a restore has tensors of
        the right shards to read into."""
        for g in self.optimizer.param_groups:
            for p in g["params"]:
                if p not in self.optimizer.state or not self.optimizer.state[p]:
                    self.optimizer.state[p] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                    }

    def _sharded_targets(self) -> dict[str, torch.Tensor]:
        self._init_optimizer_state()
        model = {f"model.{k}": v for k, v in D.unique_state(self.model).items()}
        return {**model, **self._optimizer_shards(by_name=True)[0]}

    def _save_sharded(self, val_loss: float | None) -> Path:
        rng_tensors, rng_meta = _rng_state()
        rng_tensors["meta"] = torch.frombuffer(
            bytearray(json.dumps(rng_meta).encode()), dtype=torch.uint8
        )
        tensors = {
            **self._sharded_targets(),
            **{f"rng.{self.rank}.{k}": v for k, v in rng_tensors.items()},
        }
        _, opt_rest = self._optimizer_shards()
        return self.store.save_sharded(
            self.step,
            tensors,
            self._train_state(val_loss, opt_rest, {"sharded": "per rank"}),
            expert_load=self._expert_load(),
        )

    def _param_names(self) -> dict[str, str]:
        """Optimizer state index -> parameter name (torch numbers params across groups)."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        flat = [p for g in self.optimizer.param_groups for p in g["params"]]
        return {str(i): names.get(id(p), "") for i, p in enumerate(flat)}

    def _expert_load(self) -> dict[str, list[float]]:
        """MoE layer prefix -> tokens routed to each expert so far (hot/cold tiers)."""
        prefixes = [
            f"blocks.{i}.ffn"
            for i, b in enumerate(self.model.blocks)
            if b.ffn in self.model.moe_layers
        ]
        return {p: row.tolist() for p, row in zip(prefixes, self.load.total, strict=False)}

    def _try_resume(self) -> int | None:
        path = self.store.latest_valid()
        if self.world > 1:
            # Rank 0's choice for every rank: folders on different machines could disagree
            # (a rank that cannot read that checkpoint then fails, instead of another step).
            chosen = [path.name if path is not None else None]
            dist.broadcast_object_list(chosen, src=0)
            path = self.store.root / chosen[0] if chosen[0] is not None else None
        if path is None:
            return None
        manifest, state = self.store.read_state(path)
        if state.get("fingerprint") != self.fingerprint:
            log.warning(
                "checkpoints in %s come from other inputs or params; starting fresh (DVC's cache keeps the old outputs)",
                self.store.root,
            )
            if self.rank == 0:
                self.store.clear()
            if self.world > 1:
                dist.barrier()
            return None
        if self.meshes is not None:
            rng, rng_meta = self._restore_sharded(path, manifest, state)
        else:
            rng, rng_meta = self._restore_whole(path)
        _set_rng_state(rng, rng_meta)
        self.step = manifest.step
        self.elapsed_s = float(state["elapsed_s"])
        self.tokens = int(state["tokens"])
        self.best_val = state.get("best_val")
        self.load.total = [
            torch.tensor(row, dtype=torch.float64) for row in state["expert_counts_total"]
        ]
        if self.stopper and state.get("early_stop"):
            self.stopper.load_state_dict(state["early_stop"])
        log.info("resumed from %s (step %d)", path, self.step)
        if self.rank == 0 and self.metrics_path and self.metrics_path.is_file():
            rows = [
                r
                for r in self.metrics_path.read_text().splitlines()
                if r and json.loads(r)["step"] <= self.step
            ]
            self.metrics_path.write_text("".join(r + "\n" for r in rows))
        return self.step

    def _restore_whole(self, path: Path) -> tuple[dict[str, torch.Tensor], dict]:
        """World size 1: the checkpoint whole (a sharded one assembled) into the module."""
        ckpt = self.store.load(path)
        if resize_model(self.model, experts_per_layer(ckpt.model, self.model)):
            # The checkpoint comes from a grown or pruned model: new parameters, new optimizer.
            self.optimizer = build_optimizer(self.model, self.cfg, self.router_lr_mult)
            self.load = ExpertLoad(len(self.model.moe_layers), self.model.experts_per_layer())
        if self.growth and ckpt.state.get("growth"):
            self.growth.load_state_dict(ckpt.state["growth"])
        load_model_tensors(self.model, ckpt.model)
        opt, rng, rng_meta = ckpt.optimizer, ckpt.rng, ckpt.state["rng"]
        if ckpt.sharded:  # moments by parameter name, RNG per rank: rank 0's carries on
            index = {n: i for i, n in self._param_names().items()}
            opt = {f"{index[k.rsplit('.', 1)[0]]}.{k.rsplit('.', 1)[1]}": v for k, v in opt.items()}
            rng = {k[2:]: v for k, v in rng.items() if k.startswith("0.")}
            rng_meta = json.loads(bytes(rng.pop("meta").numpy()))
        self.optimizer.load_state_dict(unflatten_optimizer(opt, ckpt.state["optimizer"]))
        return rng, rng_meta

    def _restore_sharded(
        self, path: Path, manifest: Any, state: dict
    ) -> tuple[dict[str, torch.Tensor], dict]:
        """World size > 1: each rank reads its shards of a sharded checkpoint (DCP reshards
        one written at another world size or expert-parallel degree), or its part of a whole
        one (written at world size 1 or across machines). Each rank's RNG carries on where
        the checkpoint has it, else rank 0's."""
        if manifest.sharded:
            targets = self._sharded_targets()
            missing = sorted(set(targets) - set(manifest.dcp))
            if missing:
                raise ValueError(
                    f"checkpoint {path} does not fit the model: it has no {', '.join(missing[:5])}"
                )
            mine = f"rng.{self.rank}."
            prefix = mine if any(k.startswith(mine) for k in manifest.dcp) else "rng.0."
            rng = {
                k: torch.empty(v["size"], dtype=dtype_from_name(v["dtype"]))
                for k, v in manifest.dcp.items()
                if k.startswith(prefix)
            }
            self.store.load_sharded(path, {**targets, **rng})
            rng = {k.removeprefix(prefix): v for k, v in rng.items()}
            return rng, json.loads(bytes(rng.pop("meta").numpy()))
        ckpt = self.store.load(path)  # whole: every rank keeps its part of each tensor
        buffers = {n for n, _ in self.model.named_buffers()}
        for k, t in D.unique_state(self.model).items():
            if k in ckpt.model:
                D.load_full(t, ckpt.model[k])
            elif k not in buffers:
                raise ValueError(f"checkpoint {path} does not fit the model: it has no {k}")
        self._init_optimizer_state()
        for k, t in self._optimizer_shards()[0].items():
            if k in ckpt.optimizer:  # a parameter that had no gradient yet has no state
                D.load_full(t, ckpt.optimizer[k])
        return ckpt.rng, state["rng"]

    # ------------------------------------------------------------------ loop

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        v = self.validation
        if v is None or not v.batches:
            return None
        self.model.eval()
        losses = []
        for i in range(v.batches):
            x, y, w = self._rows(v.source.batch_at(0, i))
            with self._autocast():
                _, loss, _ = self.model(
                    x.to(self.device),
                    y.to(self.device),
                    None if w is None else w.to(self.device),
                    logits=False,
                )
            losses.append(float(self._mean_over_ranks(loss.detach().float())))
        self.model.train()
        return sum(losses) / len(losses)

    def _rows(self, batch: tuple) -> tuple:
        """This rank's rows of a global batch (all of it at world size 1)."""
        if self.world == 1:
            return batch
        x = batch[0]
        if x.shape[0] % self.world:
            raise ValueError(
                f"a batch of {x.shape[0]} rows does not split over {self.world} processes: "
                "make batch_size (plus replay rows when finetuning) a multiple of the process count"
            )
        n = x.shape[0] // self.world
        lo = self.rank * n
        return tuple(None if t is None else t[lo : lo + n] for t in batch)

    def _mean_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        t = t.clone()
        dist.all_reduce(t)
        return t / self.world

    def _emit(self, row: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.log_fn(row)
        if self.metrics_path:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def _validate(self) -> float | None:
        val_loss = self.evaluate()
        if val_loss is None:
            return None
        self.best_val = val_loss if self.best_val is None else min(self.best_val, val_loss)
        ppl = math.exp(min(val_loss, 50))
        self._emit({"step": self.step, "val_loss": val_loss, "val_ppl": ppl})
        log.info("step %d val loss %.4f (ppl %.1f)", self.step, val_loss, ppl)
        return val_loss

    def _early_stop(self, val_loss: float, lr: float) -> str | None:
        if self.stopper is None:
            return None
        util = float(self.load.eval_window()["utilisation"])
        cost_per_step = self.budget.cost(self.elapsed_s) / max(self.step, 1)
        steps_left = self.cfg.max_steps - self.step
        return self.stopper.update(self.step, val_loss, util, lr, cost_per_step, steps_left)

    def _schedule_step(self) -> int:
        """The step the lr schedule reads. With a time budget, the schedule follows whichever
        is further along, the steps or the training time used, so a run cut by its budget
        still ends its decay."""
        cfg = self.cfg
        budget = cfg.time_budget_s
        if budget <= 0 or self.step < cfg.warmup_steps:
            return self.step
        frac = min(1.0, self.elapsed_s / budget)
        return max(self.step, cfg.warmup_steps + int(frac * (cfg.max_steps - cfg.warmup_steps)))

    def _choose_interval(self, save_s: float, step_s: float, restore_s: float) -> None:
        """checkpoint.every: auto: Young/Daly from the stall this save cost, the mean step
        time of this run and the pool's mean time between interruptions (moe/train/resilience.py).
        Rank 0 decides and the others follow (a save is a collective)."""
        assert self.auto_mtbi_s is not None
        choice = choose_interval(
            save_s,
            step_s,
            self.auto_mtbi_s,
            self.cfg.checkpoint_every,
            self.cfg.max_steps,
            restore_s,
        )
        if self.world > 1:
            t = torch.tensor([choice.steps], dtype=torch.int64, device=self.device)
            dist.broadcast(t, 0)
            choice.steps = int(t)
        if self.interval is None or choice.steps != self.interval.steps:
            log.info(
                "checkpoint interval (auto): every %d steps (%s; save stall %.3f s, step %.3f s, "
                "mean time between interruptions %s, restore %.2f s)",
                choice.steps,
                choice.rule,
                save_s,
                step_s,
                f"{choice.mtbi_s / 3600:.2f} h" if choice.mtbi_s > 0 else "none declared",
                restore_s,
            )
            self._emit({"step": self.step, "checkpoint_interval": choice.as_dict()})
        self.interval = choice

    def fit(self) -> TrainResult:
        """Train from the newest valid checkpoint (or from scratch) until max_steps or a stop
        reason: each step is a forward/backward over its micro-batches, an optimizer step,
        then logging, the stop decision and, when due, a checkpoint."""
        run = self._begin()
        stop_reason = "max_steps"
        while self.step < self.cfg.max_steps:
            t_step = self.clock()
            lr = self._set_lr()
            loss, counts = self._forward_backward(run)
            grad_norm = self._optimizer_step(run, counts)
            self._account_time(t_step)
            run.steps += 1
            run.last_loss = loss
            run.window_loss += loss
            if self.step % self.cfg.log_every == 0 or self.step == self.cfg.max_steps:
                self._log_window(run, lr, grad_norm)
            reason = self._stop_decision(run, lr)
            self._checkpoint_if_due(run, reason)
            if reason is None and self.stop_after is not None and run.steps >= self.stop_after:
                reason = "stop_after"
            if reason is not None:
                stop_reason = reason
                break
        return self._end(run, stop_reason)

    # ------------------------------------------------------------------ fit, step by step

    def _begin(self) -> _Run:
        """Resume (timing the restore), start a fresh metrics log otherwise, record the
        attempt in the journal (and what the interruption before it cost), and plan the
        first save: a multiple of checkpoint_every, or (auto) an early save that measures
        the stall, then every interval chosen from it."""
        t_restore = self.clock()
        resumed = self._try_resume()
        restore_s = self.clock() - t_restore if resumed is not None else 0.0
        if resumed is None and self.rank == 0 and self.metrics_path and self.metrics_path.is_file():
            self.metrics_path.unlink()  # a fresh run starts a fresh log
        if self.journal is not None and self.rank == 0:
            started = self.started_at if self.started_at is not None else self.journal.wall()
            lost = self.journal.begin(started, self.step, restore_s)
            if lost:
                log.warning(
                    "attempt %d of this stage was interrupted at step %d: %d steps redone, "
                    "%.1f s lost (%.1f s redoing work, %.1f s down, %.1f s restarting, "
                    "%.1f s restoring)",
                    lost["attempt"],
                    lost["at_step"],
                    lost["steps_lost"],
                    lost["lost_s"],
                    lost["redo_s"],
                    lost["down_s"],
                    lost["restart_s"],
                    lost["restore_s"],
                )
                self._emit({"step": self.step, "interruption": lost})
        every = self.cfg.checkpoint_every
        auto = self.auto_mtbi_s is not None
        self.model.train()
        return _Run(
            resumed=resumed,
            restore_s=restore_s,
            next_save=self.step + min(every, 10) if auto else (self.step // every + 1) * every,
            t0=self.elapsed_s,
            step0=self.step,
            params=[p for p in self.model.parameters() if p.requires_grad],
            window_t0=self.clock(),
        )

    def _set_lr(self) -> float:
        """This step's learning rate (and the routing schedule's position)."""
        cfg = self.cfg
        lr = lr_at(
            self._schedule_step(),
            cfg.max_steps,
            cfg.lr,
            cfg.warmup_steps,
            self.min_lr,
            self.schedule,
        )
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g["lr_mult"]
        self.model.set_routing_step(
            self.step if self.expert_warmup else AFTER_WARMUP, self.step / cfg.max_steps
        )
        return lr

    def _forward_backward(self, run: _Run) -> tuple[float, list[torch.Tensor]]:
        """Forward and backward over the step's micro-batches; returns the mean loss (over
        ranks) and the step's tokens per expert per layer (summed over ranks)."""
        cfg = self.cfg
        loss_sum = 0.0
        step_counts: list[torch.Tensor] = []
        for micro in range(cfg.grad_accum):
            x, y, w = self._rows(self.batches.batch_at(self.step, micro))
            x, y = x.to(self.device), y.to(self.device)
            with self._autocast():
                _, loss, aux = self.model(
                    x, y, None if w is None else w.to(self.device), logits=False
                )
                total = loss + aux.balance_loss
            (total / cfg.grad_accum).backward()
            counts = aux.tokens_per_expert
            if self.world > 1:
                # One small all-reduce: loss, tokens, and every layer's expert counts.
                packed = torch.cat(
                    [
                        loss.detach().float().reshape(1),
                        (y != -100).sum().float().reshape(1),
                        *[c.float() for c in counts],
                    ]
                )
                dist.all_reduce(packed)
                loss_val, n_tok = float(packed[0]) / self.world, int(packed[1])
                counts = list(packed[2:].view(len(counts), -1)) if counts else []
            else:
                loss_val, n_tok = float(loss.detach()), int((y != -100).sum())
            loss_sum += loss_val
            self.load.add(counts, aux.dropped_fraction)
            step_counts = (
                [a + b for a, b in zip(step_counts, counts, strict=True)]
                if step_counts
                else list(counts)
            )
            self.tokens += n_tok
            run.window_tokens += int(x.numel()) * self.world
        run.aux = aux
        return loss_sum / cfg.grad_accum, step_counts

    def _optimizer_step(self, run: _Run, counts: list[torch.Tensor]) -> float:
        """Clip, step, update routing; grow or prune experts where due. Returns the
        gradient norm before clipping."""
        if self.growth:
            self.growth.observe(counts)  # before the step: the gradients are here
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if self.meshes is not None:
            D.finish_expert_gradients(self.model, self.meshes)
            grad_norm = D.clip_grad_norm(run.params, clip)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(run.params, clip))
        if not math.isfinite(grad_norm):
            raise FloatingPointError(
                f"non-finite gradient norm at step {self.step}: lower the learning rate or raise grad_clip"
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        D.sync_routing_load(self.model, self.world)
        with implicit_replication() if self.meshes else contextlib.nullcontext():
            # The gate recalibration scales sharded router rows by a replicated factor.
            self.model.update_routing(self.step)
        if self.growth:
            for event in self.growth.act(self.step, self.optimizer):
                self.load.resize(event["layer"], torch.tensor(event.pop("index")))
                self._emit({"step": self.step, "expert_event": event})
                self.expert_events.append(event)
                log.warning(
                    "expert %s in layer %d at step %d: %s",
                    event["kind"],
                    event["layer"],
                    self.step,
                    event["trigger"],
                )
                run.params = [p for p in self.model.parameters() if p.requires_grad]
            self.growth.ramp(self.step)
        return grad_norm

    def _account_time(self, t_step: float) -> None:
        self.elapsed_s += self.clock() - t_step
        if self.world > 1:
            # Ranks agree on the time used (lr under a time budget, cost-aware stop).
            t = torch.tensor([self.elapsed_s], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.elapsed_s = float(t)

    def _log_window(self, run: _Run, lr: float, grad_norm: float) -> None:
        """One metrics row for the steps since the last one (and a log line)."""
        cfg = self.cfg
        dt = self.clock() - run.window_t0
        stats = self.load.window()
        aux = run.aux
        row = {
            "step": self.step,
            "loss": run.window_loss / max(1, (self.step - 1) % cfg.log_every + 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": run.window_tokens / max(dt, 1e-9),
            "expert_cv": stats["cv"],
            "expert_max_vio": stats["max_vio"],
            "expert_utilisation": stats["utilisation"],
            "expert_dead": stats["dead"],
            "aux_loss": float(aux.aux_loss.detach()),
            "z_loss": float(aux.z_loss.detach()),
            "dropped_fraction": stats["dropped_fraction"],
            "cost": self.budget.cost(self.elapsed_s),
            "expert_share": stats["share"],
        }
        self._emit(row)
        log.info(
            "step %d/%d loss %.4f lr %.2e grad_norm %.3f %.0f tok/s expert CV %.3f",
            self.step,
            cfg.max_steps,
            row["loss"],
            lr,
            grad_norm,
            row["tokens_per_s"],
            stats["cv"],
        )
        run.window_loss, run.window_tokens, run.window_t0 = 0.0, 0, self.clock()

    def _stop_decision(self, run: _Run, lr: float) -> str | None:
        """Why training stops after this step, or None: early stopping on a validation
        (validates when due), the stage's share of the cost budget, the time budget. A stop
        is logged and recorded once, here; a budget nearly spent is an alert."""
        cfg = self.cfg
        reason = None
        v = self.validation
        if v and v.every and (self.step % v.every == 0 or self.step == cfg.max_steps):
            run.val_loss = self._validate()
            if run.val_loss is not None:
                reason = self._early_stop(run.val_loss, lr) or None
        spent, left = self.budget.cost(self.elapsed_s), self.budget.left
        if reason is None and left > 0:
            if spent >= left:
                reason = (
                    f"budget: this stage spent {spent:.4f} of the {left:.4f} left of cost.budget"
                )
            elif spent >= self.budget.alert * left and not self._budget_warned:
                self._budget_warned = True
                msg = f"{spent / left:.0%} of the budget left for this stage spent"
                log.warning("step %d: %s", self.step, msg)
                self._emit(
                    {"step": self.step, "budget_alert": msg, "cost": spent, "budget_left": left}
                )
        time_budget = self.cfg.time_budget_s
        if reason is None and time_budget > 0 and self.elapsed_s >= time_budget:
            reason = f"time budget of {time_budget:.0f} s used"
        if reason is not None:
            log.warning("stopping at step %d: %s", self.step, reason)
            self._emit({"step": self.step, "early_stop": reason, "cost": spent})
        return reason

    def _checkpoint_if_due(self, run: _Run, stopping: str | None) -> None:
        """Save when due (and on a stop or the last step), then plan the next save; the
        journal follows the progress."""
        due = stopping or self.step >= run.next_save or self.step == self.cfg.max_steps
        if not due:
            if self.journal is not None and self.rank == 0:
                self.journal.progress(self.step)
            return
        t_save = self.clock()
        self._save(run.val_loss)
        # What the save cost the training thread (the copy; encoding and writing happen on
        # the store's worker thread in background mode).
        stall = self.clock() - t_save
        self._emit({"step": self.step, "checkpoint_stall_s": stall})
        if self.auto_mtbi_s is not None:
            step_s = (self.elapsed_s - run.t0) / max(1, self.step - run.step0)
            self._choose_interval(stall, step_s, run.restore_s)
            assert self.interval is not None
            run.next_save = self.step + self.interval.steps
        else:
            every = self.cfg.checkpoint_every
            run.next_save = (self.step // every + 1) * every
        if self.journal is not None and self.rank == 0:
            self.journal.progress(self.step, force=True)

    def _end(self, run: _Run, stop_reason: str) -> TrainResult:
        """Wait for the checkpoint writes, close the attempt in the journal, and report."""
        self.store.flush()  # background checkpoint writes are on disk before we report
        path = self.store.latest_valid()
        resilience: dict[str, Any] = {}
        if self.journal is not None and self.rank == 0:
            if stop_reason != "stop_after":  # stop_after stands in for a kill: no "finished"
                self.journal.finish(self.step)
            resilience = self.journal.summary(self.elapsed_s)
        if self.interval is not None:
            resilience["checkpoint_interval"] = self.interval.as_dict()
        total = summarize(self.load.total)
        return TrainResult(
            steps=self.step,
            resumed_from=run.resumed,
            train_loss=run.last_loss,
            val_loss=run.val_loss if run.val_loss is not None else self.evaluate(),
            tokens=self.tokens,
            wall_s=self.elapsed_s,
            stop_reason=stop_reason,
            checkpoint=str(path) if path else "",
            tokens_per_s=self.tokens / max(self.elapsed_s, 1e-9),
            expert_share=total["share"],  # type: ignore[arg-type]
            expert_cv=float(total["cv"]),  # type: ignore[arg-type]
            expert_events=self.expert_events,
            experts_per_layer=self.model.experts_per_layer(),
            resilience=resilience,
            backend=str(dist.get_backend()) if dist.is_initialized() else "",
            world=self.world,
        )
