"""The trainer: one loop for pretraining (warm-up + cosine) and finetuning (warm-up + linear
decay), a short list of calls to its named parts:

- where it runs (moe/train/ranks.py): device, autocast, ranks, the sharded engine's meshes;
- the optimizer and its schedule (moe/train/optim.py);
- validation (moe/train/validation.py) and the stop policy (moe/train/stop.py);
- the save cadence (moe/train/cadence.py) and the checkpointer over the stateful parts
  (moe/train/checkpointer.py);
- metrics (moe/train/metrics.py), expert growth (moe/model/growth.py).

A batch source is anything with `batch_at(step, micro) -> (x, y, loss_weight | None, ...)`, a
pure function of its arguments (a packed batch adds each token's example), so the data position
is the step and resume is exact: killed at any step and resumed, bit-identical weights on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch.distributed.tensor.experimental import implicit_replication

from moe.checkpoint.store import CheckpointStore
from moe.model.growth import GrowthManager
from moe.model.routing import AFTER_WARMUP
from moe.model.stats import ExpertLoad
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.cadence import SaveCadence
from moe.train.checkpointer import Checkpointer, Progress, TrainState
from moe.train.config import OptimConfig
from moe.train.early_stop import EarlyStopper
from moe.train.metrics import MetricsLog, Window
from moe.train.optim import LrSchedule, build_optimizer
from moe.train.ranks import Ranks
from moe.train.report import TrainResult, report
from moe.train.resilience import AttemptJournal, begin_attempt
from moe.train.rng import rng_state, set_rng_state
from moe.train.stop import Budget, Divergence, StopPolicy
from moe.train.validation import BatchSource, Validation, validation_loss

log = logging.getLogger(__name__)

# The stop reason when `Trainer.interrupted` asked for a stop (the machine is going away):
# the step's checkpoint is written and the attempt stays open in the journal (not finished).
INTERRUPTED = "interrupted"


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
    t0: float  # training time and step when this run started (auto interval: step time)
    step0: int
    params: list[torch.nn.Parameter]  # the trainable ones (growth replaces them)
    window: Window  # the current logging window
    steps: int = 0  # steps taken in this run
    last_loss: torch.Tensor | float = float("nan")  # on the device until read
    val_loss: float | None = None
    aux: Any = None  # the last forward's routing statistics
    saved: int | None = None  # the step of the newest checkpoint this run made or resumed
    # this rank's training time not yet agreed with the other ranks (world > 1: `_agree_time`)
    unagreed_s: float = 0.0
    diverged: Divergence = field(default_factory=Divergence)  # read where the host reads


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
        base_sha256: str | None = None,
        interrupted: Callable[[], bool] | None = None,
        notice: tuple[type[BaseException], ...] = (),
    ) -> None:
        """`model` may be built on the meta device when training under torchrun: it is then
        sharded first and each rank fills its shards only, from `weights` (a safetensors
        file in the model's names) or, without it, with the initialisation one process
        would draw after the same seed. `base_sha256`: the frozen base's digest when the
        model trains adapters (moe/adapters/method.py); checkpoints then hold what trains.
        `interrupted`: asked after each step whether to stop now (a SIGTERM's notice that
        the machine is going away, moe/recipes/context.py); then the step is saved at once and
        fit() returns with stop_reason INTERRUPTED. Every rank must pass one or none; at world
        > 1 it is asked at metrics rows only (log_every: keep log_every steps well inside the
        notice the machine gives).
        `notice`: exceptions that say the machine is going away (Prefect's TerminationSignal
        from a SIGTERM). One raised in a step's forward or backward, where the weights and
        the optimizer still hold the step before, saves that step and is raised again; one
        raised elsewhere (the update, a save) is raised as it is. One process only."""
        self.ranks = Ranks(cfg)
        self.ranks.place(model, cfg, weights)
        self.cfg, self.batches = cfg, batches
        self.expert_warmup = expert_warmup  # False for finetuning: no uniform routing again
        self.validation = validation
        self.metrics = MetricsLog(self.ranks.rank, log_fn, metrics_path)
        self.interrupted, self.notice = interrupted, notice
        self.stop_after = stop_after  # testing aid: return after this many steps (simulates a kill)
        # Every decision that reads the time (cost, budget stops, time_budget_s, the lr under a
        # time budget) reads this clock: tests inject one so they do not depend on CPU speed.
        self.clock = clock
        resilience = resilience or Resilience()
        self.journal, self.started_at = resilience.journal, resilience.started_at
        self.lr = LrSchedule(cfg, schedule, min_lr)
        self.stop = StopPolicy(cfg, budget, self.metrics.emit)
        self.cadence = SaveCadence(cfg, resilience.auto_mtbi_s, self.ranks, self.metrics.emit)
        early = getattr(cfg, "early_stop", None)
        self.state = TrainState(
            model=model,
            optimizer=build_optimizer(model, cfg, router_lr_mult),
            load=ExpertLoad(len(model.moe_layers), model.experts_per_layer()),
            progress=Progress(),
            stopper=EarlyStopper(early, cfg.lr)
            if early is not None and validation is not None
            else None,
            # Expert growth and pruning (moe/model/growth.py), pretraining only.
            growth=GrowthManager(model, model.mcfg.growth, seed=cfg.seed)
            if model.mcfg.growth.enabled and expert_warmup
            else None,
            # no lambda over self: a Trainer -> state -> closure -> Trainer cycle kept a
            # finished stage's model and optimizer until a full garbage collection
            new_optimizer=functools.partial(
                build_optimizer, cfg=cfg, router_lr_mult=router_lr_mult
            ),
        )
        self.checkpointer = Checkpointer(store, fingerprint, self.ranks, self.state, base_sha256)
        self.expert_events: list[dict[str, Any]] = []

    @property
    def model(self) -> MoETransformer:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def step(self) -> int:
        return self.state.progress.step

    def evaluate(self) -> float | None:
        """The validation loss now (None without validation batches)."""
        return validation_loss(self.model, self.validation, self.ranks)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> TrainResult:
        """Train from the newest valid checkpoint (or from scratch) until max_steps or a stop
        reason: each step is a forward/backward over its micro-batches, an optimizer step,
        then logging, the stop decision and, when due, a checkpoint."""
        run = self._begin()
        stop_reason = "max_steps"
        while self.step < self.cfg.max_steps:
            t_step = self.clock()
            with _saving_on_notice(self, run):
                lr = self._set_lr()
                loss, counts = self._forward_backward(run)
            grad_norm = self._optimizer_step(run, counts)
            _account_time(self, run, t_step)
            # no device read above: rows, saves and stops read it (moe/train/syncs.py)
            run.steps += 1
            run.last_loss = loss
            run.window.loss += loss
            if _row_step(self):
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
        first save."""
        t_restore = self.clock()
        resumed = self.checkpointer.resume()
        restore_s = self.clock() - t_restore if resumed is not None else 0.0
        if resumed is None:
            self.metrics.start_fresh()
        else:
            self.metrics.keep_until(resumed)
        if self.journal is not None and self.ranks.rank == 0:
            started = self.started_at if self.started_at is not None else self.journal.wall()
            begin_attempt(self.journal, started, self.step, restore_s, self.metrics.emit)
        self.cadence.start(self.step)
        self.model.train()
        return _Run(
            resumed=resumed,
            restore_s=restore_s,
            t0=self.state.progress.elapsed_s,
            step0=self.step,
            params=[p for p in self.model.parameters() if p.requires_grad],
            window=Window(self.clock()),
            saved=resumed,
        )

    def _set_lr(self) -> float:
        """This step's learning rate (and the routing schedule's position)."""
        lr = self.lr.set(self.optimizer, self.step, self.state.progress.elapsed_s)
        self.model.set_routing_step(
            self.step if self.expert_warmup else AFTER_WARMUP, self.step / self.cfg.max_steps
        )
        return lr

    def _forward_backward(self, run: _Run) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward and backward over the step's micro-batches; returns the mean loss (over
        ranks) and the step's tokens per expert per layer (summed over ranks), on the device.
        What the batch says (its loss tokens, the positions that carry loss) is read on the
        host, where the batch is, before it moves."""
        cfg, ranks = self.cfg, self.ranks
        loss_sum: torch.Tensor | float = 0.0
        step_counts: list[torch.Tensor] = []
        for micro in range(cfg.grad_accum):
            batch = self.batches.batch_at(self.step, micro)
            x, y, w, rows, n_tok, seg = ranks.to_device(batch)
            with ranks.autocast():
                _, loss, aux = self.model(x, y, w, logits=False, loss_rows=rows, segments_BS=seg)
                total = loss + aux.balance_loss
            (total / cfg.grad_accum).backward()
            loss_val, counts = ranks.reduce_micro(loss, aux.tokens_per_expert)
            loss_sum = loss_sum + loss_val
            self.state.load.add(counts, aux.dropped_fraction)
            add = zip(step_counts or [0] * len(counts), counts, strict=True)
            step_counts = [a + b for a, b in add]
            self.state.progress.tokens += n_tok
            run.window.count(batch, int(x.numel()) * ranks.world)
        run.aux = aux
        return loss_sum / cfg.grad_accum, step_counts

    def _optimizer_step(self, run: _Run, counts: list[torch.Tensor]) -> float:
        """Clip, step, update routing; grow or prune experts where due. Returns the
        gradient norm before clipping."""
        growth, meshes = self.state.growth, self.ranks.meshes
        if growth:
            growth.observe(counts)  # before the step: the gradients are here
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if meshes is not None:
            D.finish_expert_gradients(self.model, meshes)
            grad_norm = D.clip_grad_norm(run.params, clip)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(run.params, clip)
        self.optimizer.found_inf = run.diverged.observe(grad_norm, self.step)  # type: ignore[attr-defined]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.progress.step += 1
        D.sync_routing_load(self.model, self.ranks.world)
        with implicit_replication() if meshes else contextlib.nullcontext():
            # The gate recalibration scales sharded router rows by a replicated factor.
            self.model.update_routing(self.step)
        if growth:
            _grow(self, run, growth)
        return grad_norm

    def _log_window(self, run: _Run, lr: float, grad_norm: torch.Tensor) -> None:
        """One metrics row for the steps since the last one (and a log line)."""
        run.diverged.check()
        row = run.window.row(
            step=self.step,
            max_steps=self.cfg.max_steps,
            log_every=self.cfg.log_every,
            lr=lr,
            grad_norm=float(grad_norm),
            now=self.clock(),
            load=self.state.load,
            aux=run.aux,
            cost=self.stop.budget.cost(self.state.progress.elapsed_s),
        )
        self.metrics.emit(row)
        run.window = Window(self.clock())

    def _stop_decision(self, run: _Run, lr: float) -> str | None:
        """Why training stops after this step, or None: early stopping on a validation
        (validates when due), the stage's share of the cost budget, the time budget; first,
        a stop asked for from outside (no validation then: the notice may be short)."""
        reason = None
        v, progress = self.validation, self.state.progress
        if _asked_to_stop(self):
            self.stop.record(self.step, INTERRUPTED, progress.elapsed_s)
            return INTERRUPTED
        if v and v.every and (self.step % v.every == 0 or self.step == self.cfg.max_steps):
            run.val_loss = _validate(self)
            if run.val_loss is not None:
                reason = (
                    self.stop.early_stop(
                        self.state.stopper,
                        self.step,
                        run.val_loss,
                        lr,
                        progress.elapsed_s,
                        self.state.load,
                    )
                    or None
                )
        if reason is None:
            reason = self.stop.spending(self.step, progress.elapsed_s)
        if reason is not None:
            self.stop.record(self.step, reason, progress.elapsed_s)
        return reason

    def _checkpoint_if_due(self, run: _Run, stopping: str | None) -> None:
        """Save when due (and on a stop or the last step), then plan the next save; the
        journal follows the progress."""
        journal = self.journal if self.ranks.rank == 0 else None
        if not (stopping or self.cadence.due(self.step)):
            if journal is not None:
                journal.progress(self.step)
            return
        run.diverged.check()  # a checkpoint never holds a diverged step
        _agree_time(self, run)  # the save is collective: the ranks meet here anyway
        t_save = self.clock()
        self.checkpointer.save(run.val_loss)
        run.saved = self.step
        # What the save cost the training thread (the copy; encoding and writing happen on
        # the store's worker thread in background mode).
        stall = self.clock() - t_save
        self.metrics.emit({"step": self.step, "checkpoint_stall_s": stall})
        step_s = (self.state.progress.elapsed_s - run.t0) / max(1, self.step - run.step0)
        self.cadence.saved(self.step, stall, step_s, run.restore_s)
        if journal is not None:
            journal.progress(self.step, force=True)

    def _end(self, run: _Run, stop_reason: str) -> TrainResult:
        """Wait for the checkpoint writes, close the attempt in the journal, and report."""
        run.diverged.check()
        _agree_time(self, run)  # every rank ends here, at the same step
        store = self.checkpointer.store
        store.flush()  # background checkpoint writes are on disk before we report
        path = store.latest_valid()
        resilience: dict[str, Any] = {}
        if self.journal is not None and self.ranks.rank == 0:
            # stop_after stands in for a kill, and an interrupted attempt resumes: no "finished"
            if stop_reason not in ("stop_after", INTERRUPTED):
                self.journal.finish(self.step)
            resilience = self.journal.summary(self.state.progress.elapsed_s)
        if self.cadence.interval is not None:
            resilience["checkpoint_interval"] = self.cadence.interval.as_dict()
        val_loss = run.val_loss
        if val_loss is None and stop_reason != INTERRUPTED:  # no validation on short notice
            val_loss = self.evaluate()
        return report(self, run, stop_reason, path, val_loss, resilience)


def _row_step(trainer: Trainer) -> bool:
    """Whether this step ends with a metrics row (every log_every steps, and the last):
    where the host reads the device, and, at world > 1, where the ranks agree."""
    return trainer.step % trainer.cfg.log_every == 0 or trainer.step == trainer.cfg.max_steps


def _asked_to_stop(trainer: Trainer) -> bool:
    """Whether a stop was asked for from outside (`interrupted`): every step in one
    process; at world > 1 at metrics rows only, where the ranks agree (one signalled
    rank stops them all there: the save is collective) and read the host anyway."""
    if trainer.interrupted is None:
        return False
    if trainer.ranks.world == 1:
        return bool(trainer.interrupted())
    return _row_step(trainer) and bool(trainer.ranks.agree_max(float(trainer.interrupted())))


def _account_time(trainer: Trainer, run: _Run, t_step: float) -> None:
    """Add this step's time: at a metrics row after the GPU's backlog (it runs behind). In
    one process the training time moves every step; at world > 1 the ranks agree on it (the
    largest) at metrics rows, saves and the end only, so that no other step waits for the
    host: the time-based lr, the cost and time budgets and the save plan read the time agreed
    last, the same on every rank."""
    ranks = trainer.ranks
    row = _row_step(trainer)
    if row and ranks.device.type == "cuda":
        torch.cuda.synchronize(ranks.device)
    run.unagreed_s += trainer.clock() - t_step
    if ranks.world == 1 or row:
        _agree_time(trainer, run)


def _agree_time(trainer: Trainer, run: _Run) -> None:
    """Fold this rank's time since the last agreement into the training time, as the ranks
    agree on it (the largest; a collective at world > 1)."""
    progress = trainer.state.progress
    progress.elapsed_s = trainer.ranks.agree_max(progress.elapsed_s + run.unagreed_s)
    run.unagreed_s = 0.0


@contextlib.contextmanager
def _saving_on_notice(trainer: Trainer, run: _Run) -> Iterator[None]:
    """Save the step before when a `notice` exception cuts this step's forward or backward:
    the weights and optimizer are untouched yet, and the random generators and token count
    are put back to where the step began, as a save there would hold them."""
    if not trainer.notice or trainer.ranks.world > 1:  # ranks: `interrupted` (collective)
        yield
        return
    progress = trainer.state.progress
    rng, tokens = rng_state(), progress.tokens
    try:
        yield
    except trainer.notice:
        trainer.optimizer.zero_grad(set_to_none=True)
        set_rng_state(*rng)
        progress.tokens = tokens
        trainer.stop.record(trainer.step, INTERRUPTED, progress.elapsed_s)
        # a diverged step is never saved: the run resumes from the newest checkpoint before it
        if trainer.step not in (0, run.saved) and run.diverged.first_step() is None:
            trainer.checkpointer.save(run.val_loss)
            trainer.checkpointer.store.flush()
            if trainer.journal is not None:  # the next attempt's account starts from here
                trainer.journal.progress(trainer.step, force=True)
        raise


def _validate(trainer: Trainer) -> float | None:
    """The validation loss now, kept as the best one so far and logged."""
    val_loss = trainer.evaluate()
    if val_loss is None:
        return None
    progress = trainer.state.progress
    progress.best_val = val_loss if progress.best_val is None else min(progress.best_val, val_loss)
    ppl = math.exp(min(val_loss, 50))
    trainer.metrics.emit({"step": trainer.step, "val_loss": val_loss, "val_ppl": ppl})
    log.info("step %d val loss %.4f (ppl %.1f)", trainer.step, val_loss, ppl)
    return val_loss


def _grow(trainer: Trainer, run: _Run, growth: GrowthManager) -> None:
    """Grow or prune experts where due; the load, metrics and trainable list follow."""
    for event in growth.act(trainer.step, trainer.optimizer):
        trainer.state.load.resize(event["layer"], torch.tensor(event.pop("index")))
        trainer.metrics.emit({"step": trainer.step, "expert_event": event})
        trainer.expert_events.append(event)
        log.warning(
            "expert %s in layer %d at step %d: %s",
            event["kind"],
            event["layer"],
            trainer.step,
            event["trigger"],
        )
        run.params = [p for p in trainer.model.parameters() if p.requires_grad]
    growth.ramp(trainer.step)
