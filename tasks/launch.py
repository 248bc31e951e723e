"""The one seam where a training stage is launched (issue: the launch code in one place).

`run_training` decides where a stage's training runs, from its config: in this process
(one process: the trainer is called directly), under torchrun on this machine (`nproc` > 1:
data + expert parallel, `torchrun` below), or as a Kubernetes Indexed Job across machines
(`nodes` > 1: tasks/multinode.py). The training tasks (tasks/training.py) call it with the
work to do in this process; the fingerprint and the metrics replay that every launcher
needs live in tasks/runs.py, so no two of these modules import each other.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moe.errors import InputError
from moe.train.report import TrainResult
from tasks.config import Config
from tasks.events import row_events
from tasks.multinode import run_on_cluster
from tasks.runs import replay_metrics

log = logging.getLogger(__name__)


def run_training(
    cfg: Config,
    stage: str,
    here: Callable[[], TrainResult],
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    init_dir: Path | None = None,
    pairs_file: str = "",
    budget_left: float = 0.0,
    receipt: dict[str, Any] | None = None,
) -> TrainResult:
    """Train `stage` where its config says: `here()` in this process (also inside a torchrun
    rank or a node's pod, where the process group is already up), torchrun on this machine,
    or a Job across `nodes` machines (which fetch the data the receipt names)."""
    inside = torch.distributed.is_initialized()
    if getattr(cfg, stage).nodes > 1 and not inside:
        if receipt is None:
            raise InputError("a multi-node stage needs the dataset receipt (its nodes fetch it)")
        return run_on_cluster(
            cfg, stage, receipt, data_dir, out_dir, log_fn, init_dir, pairs_file, budget_left
        )
    if processes(cfg, stage) > 1 and not inside:
        return torchrun(cfg, stage, data_dir, out_dir, log_fn, init_dir, pairs_file, budget_left)
    return here()


def processes(cfg: Config, stage: str) -> int:
    """How many training processes this stage launches here: `Config.processes` (nproc, or
    with nproc 0 one per GPU of the stage's pool), but one where nproc is 0 and this machine
    trains on the CPU (a laptop running the pipeline locally)."""
    from moe.train.ranks import resolve_device

    sec = getattr(cfg, stage)
    n = cfg.processes(stage)
    if sec.nproc == 0 and n > 1 and resolve_device(sec.device).type != "cuda":
        log.info("%s: no GPU here, one process instead of the pool's %d", stage, n)
        return 1
    if sec.nproc == 0 and torch.cuda.is_available() and n > torch.cuda.device_count():
        raise InputError(
            f"{stage}: its pool gives {n} GPUs (pools.definitions), this machine has "
            f"{torch.cuda.device_count()}: fix the pool's gpus, or set {stage}.nproc"
        )
    return n


# What rank 0 of a torchrun writes when the stage refused its input (moe.errors.InputError):
# the launcher raises the same InputError, so the task is not retried.
INPUT_ERROR = "input_error.txt"


RANKS_GRACE_S = 120.0  # how long the ranks get to save the step they are in


def _stop_ranks(proc: subprocess.Popen[bytes]) -> None:
    """torchrun passes a SIGTERM on to the ranks, which save the step they are in and end
    (moe/recipes/context.py saving_on_sigterm); killed after RANKS_GRACE_S or a second interrupt.
    (subprocess.run would SIGKILL torchrun at once and leave the ranks training, orphaned.)"""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=RANKS_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
    except BaseException:
        proc.kill()
        raise


def torchrun(
    cfg: Config,
    stage: str,
    data_dir: Path,
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    init_dir: Path | None = None,
    pairs_file: str = "",
    budget_left: float = 0.0,
) -> TrainResult:
    """Run this training stage under torchrun with `nproc` processes on this machine (data
    parallel + expert parallel, moe/train/distributed.py); rank 0 writes the outputs. The metrics
    rows are replayed into log_fn (W&B) afterwards. A rank that dies fails the launch."""
    import sys

    nproc = processes(cfg, stage)
    work = out_dir / ".dist"
    work.mkdir(parents=True, exist_ok=True)
    cfg.dump(work / "params.yaml")
    result_file = work / "result.json"
    result_file.unlink(missing_ok=True)
    refused = work / INPUT_ERROR
    refused.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        # once one rank has exited, torchrun stops the others at its next check: every 2 s
        # (not 0.1 s), so each rank's own error reaches the log first
        "--monitor-interval=2",
        "-m",
        "tasks.dist_entry",
        stage,
        str(work / "params.yaml"),
        str(data_dir),
        str(out_dir),
        str(init_dir or ""),
        pairs_file,
        str(budget_left),
    ]
    log.info("launching %s on %d processes: %s", stage, nproc, " ".join(cmd))
    import psutil

    env = {**os.environ, "MOE_ATTEMPT_STARTED": str(psutil.Process().create_time())}
    proc = subprocess.Popen(cmd, cwd=Path.cwd(), env=env)
    try:
        proc.wait()
    except BaseException:  # a SIGTERM (Prefect's TerminationSignal) or Ctrl-C reached us
        _stop_ranks(proc)
        raise
    if refused.is_file():
        raise InputError(refused.read_text())
    if proc.returncode != 0 or not result_file.is_file():
        raise RuntimeError(
            f"{stage} under torchrun ({nproc} processes) failed with exit code "
            f"{proc.returncode}; its log is above. A retry resumes from the newest checkpoint."
        )
    result = TrainResult(**json.loads(result_file.read_text()))
    replay_metrics(out_dir, log_fn, row_events(cfg, stage))
    return result
