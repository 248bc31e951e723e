"""What every training stage shares: its retries, the model folder it writes and reads, the
fit-and-save around the trainer, and its price and resilience settings.

A retry of either task resumes from its newest valid checkpoint (the trainer looks for one
before it starts), so a machine that dies costs at most `checkpoint_every` steps. One that
gives notice by SIGTERM (a spot reclaim, an eviction) costs about one step: the step is
saved, then the process ends by the signal as it would have (`saving_on_sigterm`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from prefect.tasks import exponential_backoff

from moe.adapters.files import adapter_spec, save_adapter_dir
from moe.adapters.lora import (
    add_adapters,
    dequantize_base,
    has_adapters,
    merge_adapters,
    set_router_policy,
)
from moe.checkpoint.tensors import load_model_tensors
from moe.hf.model_dir import load_model_dir, save_model_dir
from moe.model.transformer import MoETransformer
from moe.train import distributed as D
from moe.train.resilience import AttemptJournal
from moe.train.trainer import Resilience, Trainer, TrainResult
from tasks import retry_unless_input_error
from tasks.checkpoints import offload_checkpoints
from tasks.config import Config, PoolSpec
from tasks.events import row_events
from tasks.progress import training_log

log = logging.getLogger(__name__)

TRAIN_RETRIES = dict(
    retries=2,
    retry_delay_seconds=exponential_backoff(backoff_factor=5),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_input_error,
)


def save_model(model: MoETransformer, out_dir: Path) -> Path:
    """The stage's model folder (moe/hf/model_dir.py): what the next stage, `model export` and
    `ask` read. A model started from model.init keeps the import's source record."""
    extra = {}
    if model.cfg.init and (Path(model.cfg.init) / "model.json").is_file():
        source = json.loads((Path(model.cfg.init) / "model.json").read_text()).get("source")
        extra = {"source": source} if source else {}
    elif model.cfg.init:
        extra = {"source": {"path": model.cfg.init, "model_type": _init_type(model.cfg.init)}}
    return save_model_dir(model, out_dir, extra)


def _init_type(init: str) -> str:
    try:
        return json.loads((Path(init) / "config.json").read_text()).get("model_type", "")
    except (OSError, json.JSONDecodeError):
        return ""


def load_model(model_dir: Path) -> MoETransformer:
    """A stage's model folder, in fp32 (what training updates)."""
    return load_model_dir(model_dir, dtype=torch.float32)


def write_metrics_csv(out_dir: Path) -> Path:
    """metrics.jsonl -> metrics.csv of the per-step training rows (for `dvc plots`)."""
    import csv

    cols = [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "tokens_per_s",
        "expert_cv",
        "expert_max_vio",
        "dropped_fraction",
        "cost",
    ]
    src, dest = out_dir / "metrics.jsonl", out_dir / "metrics.csv"
    rows = (
        [json.loads(line) for line in src.read_text().splitlines() if line] if src.is_file() else []
    )
    with open(dest, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(r for r in rows if "loss" in r)
    return dest


@contextlib.contextmanager
def saving_on_sigterm(trainer: Trainer, stage: str) -> Iterator[None]:
    """While `trainer` trains, a SIGTERM (a spot reclaim, an eviction) costs one step, not a
    checkpoint interval.

    - Under Prefect's handler (a flow run's own process) the handler stays: a worker that
      cancels a run checks that it is installed first, and a run it does not hear cancelled
      would be recorded Crashed. Its TerminationSignal, raised in a step's forward or
      backward, saves the step before (`Trainer.notice`); raised elsewhere, nothing is saved.
    - Otherwise (a rank under torchrun, which passes a SIGTERM on to them: tasks/launch.py;
      a stage run outside Prefect) a SIGTERM asks the trainer to save the step it is in and
      stop (`Trainer.interrupted`), and a second one acts at once. Then the handler that was
      there gets the signal, so the process ends as it would have, one checkpoint later.
    - Outside the main thread, or with SIGTERM ignored, nothing changes."""
    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import is_prefect_sigterm_handler_installed

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    if is_prefect_sigterm_handler_installed():
        trainer.notice = (TerminationSignal,)
        yield
        return
    if previous == signal.SIG_IGN:
        yield
        return
    got: list[int] = []

    def notice(signum: int, frame: object) -> None:
        if got:  # asked twice: no more waiting for the step
            signal.signal(signal.SIGTERM, previous)
            _deliver(previous, signum, frame)
        got.append(signum)

    signal.signal(signal.SIGTERM, notice)
    trainer.interrupted = lambda: bool(got)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if got:
        log.warning("%s: SIGTERM: the step in progress was saved; ending now", stage)
        _deliver(previous, signal.SIGTERM, None)
        # a handler that returned: end the stage anyway, unfinished (it must not be saved)
        raise SystemExit(128 + signal.SIGTERM)


def _deliver(handler: object, signum: int, frame: object) -> None:
    """What `handler` (a signal.getsignal value) would have done with the signal."""
    if callable(handler):
        handler(signum, frame)
    elif handler != signal.SIG_IGN:  # the default (or unknown: set outside Python): end
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def fit_and_save(
    cfg: Config, trainer: Trainer, out_dir: Path, run_key: str, init: Path | None = None
) -> TrainResult:
    """Train (resuming if a checkpoint fits), then write the final weights and the CSV log.
    Under torchrun every rank trains; the experts are gathered and rank 0 writes. A bar on a
    terminal and a Prefect progress artifact follow the steps (tasks/progress.py)."""
    stage = run_key.split("/", 1)[0]
    # A SIGTERM's step is saved and landed; then the signal ends the run (nothing below runs).
    with saving_on_sigterm(trainer, stage):
        try:
            with training_log(
                stage, trainer.cfg.max_steps, trainer.metrics.log_fn, row_events(cfg, stage)
            ) as trainer.metrics.log_fn:
                result = trainer.fit()
        finally:  # a failed run's checkpoint being written still lands (a retry resumes from it)
            trainer.checkpointer.store.close()
    model = trainer.model
    adapted = has_adapters(model)
    if trainer.ranks.meshes is not None:
        # The final weights whole (rank 0 alone keeps them; the optimizer stays sharded).
        full = D.full_tensors(D.unique_state(model), keep=trainer.ranks.rank == 0)
        if trainer.ranks.rank != 0:
            return result
        model = MoETransformer(model.cfg, model.mcfg, model.vocab_size)
        if adapted:  # the same structure, and the same parameters marked as trained
            add_adapters(model, trainer.cfg.lora, seed=trainer.cfg.seed)
            set_router_policy(model, trainer.cfg.router_policy())
        load_model_tensors(model, full)
    if cfg.checkpoint.offload:
        if (
            trainer.ranks.world > 1
        ):  # inside torchrun: no Prefect flow here; the parent task retries
            offload_checkpoints.fn(cfg, trainer.checkpointer.store.root, run_key)
        else:
            offload_checkpoints(cfg, trainer.checkpointer.store.root, run_key)
    model = model.to("cpu")
    if adapted:  # the adapters alone beside the model, then the model with them merged
        save_adapter_dir(
            model, out_dir, adapter_spec(trainer.cfg, trainer.checkpointer.base_sha256, init)
        )
        dequantize_base(model)  # QLoRA: the merge adds to the weights the adapters trained on
        merge_adapters(model)
    else:  # a full run where an adapter run wrote before: its adapters no longer apply
        for name in ("adapter.safetensors", "adapter.json"):
            (out_dir / name).unlink(missing_ok=True)
    save_model(model, out_dir)
    write_metrics_csv(out_dir)
    return result


def _pool(cfg: Config, stage: str) -> PoolSpec:
    return cfg.pools.definitions[cfg.pools.stages[stage]]


def stage_price(cfg: Config, stage: str) -> float:
    """What an hour of this stage costs: the pool's rate for each machine it spans."""
    return _pool(cfg, stage).rate * cfg.machines(stage)


def stage_resilience(cfg: Config, stage: str, ckpt_dir: Path, fingerprint: str) -> Resilience:
    """The attempt journal beside the checkpoints, this process's start (what a restart costs
    is measured from it) and, with checkpoint.every: auto, the pool's mean time between
    interruptions."""
    import psutil

    return Resilience(
        AttemptJournal(ckpt_dir / "attempts.json", fingerprint),
        # under torchrun: the stage's own process (tasks.launch.torchrun passes it), not the rank's
        float(os.environ.get("MOE_ATTEMPT_STARTED") or psutil.Process().create_time()),
        _pool(cfg, stage).mtbi_s if cfg.checkpoint.every == "auto" else None,
    )
