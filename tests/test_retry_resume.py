"""A training task that fails mid-run is retried by Prefect and the retry resumes from the
newest checkpoint: the final weights equal an uninterrupted run's (run against a real Prefect
server, in a subprocess so it has its own Prefect settings)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# A tiny corpus in the work folder (made once), a 10-step pretrain config (CHECKPOINT_EVERY and
# LOG_EVERY filled in by each script) and the digest of a folder's newest checkpoint.
SETUP = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    from moe.checkpoint.store import CheckpointStore
    from moe.checkpoint.tensors import weights_digest
    from moe.data.tokens import token_dtype, write_token_store
    from tasks.config import load_config
    from tasks.pretraining import pretrain_model

    work = Path(sys.argv[1])
    data = work / "data"
    if not data.is_dir():
        data.mkdir()
        rng = np.random.default_rng(0)
        docs = [rng.integers(1, 60, 300).tolist() for _ in range(20)]
        counts = write_token_store(iter(map(str, range(20))), lambda b: [docs[int(i)] for i in b], 0, 64, data, {"val": 0.2}, 1)
        (data / "meta.json").write_text(json.dumps({"dtype": str(token_dtype(64)), "vocab_size": 64, "splits": counts}))
    cfg = load_config(None, [
        "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16", "model.dense_hidden=32",
        "moe.num_experts=4", "moe.expert_hidden=32", "pretrain.max_steps=10", "pretrain.batch_size=4", "pretrain.device=cpu",
        "pretrain.checkpoint_every=CHECKPOINT_EVERY", "pretrain.log_every=LOG_EVERY", "pretrain.eval_every=5", "pretrain.eval_batches=1",
        "finetune_sql.max_len=16", "finetune_domain.max_len=16",
    ])
    digest = lambda d: weights_digest(CheckpointStore(d / "checkpoints").load(CheckpointStore(d / "checkpoints").latest_valid()).model)
    """
)


def _script(checkpoint_every: int, log_every: int, body: str) -> str:
    setup = SETUP.replace("CHECKPOINT_EVERY", str(checkpoint_every))
    return setup.replace("LOG_EVERY", str(log_every)) + textwrap.dedent(body)


SCRIPT = _script(
    4,
    2,
    """
    task = pretrain_model.with_options(retries=1, retry_delay_seconds=0, retry_jitter_factor=None)
    crashed = []

    def crash_once(row):
        if row.get("step") == 6 and not crashed:
            crashed.append(row["step"])
            raise RuntimeError("injected failure at step 6 (the machine died)")

    resumed = task(cfg, data, work / "crashy", crash_once)
    straight = task(cfg, data, work / "straight", lambda row: None)
    same = digest(work / "crashy") == digest(work / "straight")
    # Same folder, another learning rate: the checkpoints there belong to other params.
    import dataclasses
    other = dataclasses.replace(cfg, pretrain=dataclasses.replace(cfg.pretrain, lr=cfg.pretrain.lr / 2))
    relr = task(other, data, work / "straight", lambda row: None)
    print(json.dumps({"crashed": crashed, "resumed_from": resumed.resumed_from, "straight_from": straight.resumed_from,
                      "steps": resumed.steps, "other_lr_from": relr.resumed_from, "same": same}))
    """,
)


def test_prefect_retry_resumes_from_checkpoint(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    env = {**os.environ, **prefect_server, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["crashed"] == [6]
    assert out["resumed_from"] == 4  # the retry started from the step-4 checkpoint, not from 0
    assert out["straight_from"] is None and out["steps"] == 10
    assert out["other_lr_from"] is None  # another lr in the same folder starts from step 0
    assert out["same"], "resumed weights differ from the uninterrupted run"
    assert "injected failure at step 6" in r.stdout + r.stderr  # Prefect logged the failed attempt


def test_the_training_fingerprint_covers_params_data_and_start_model(tmp_path: Path) -> None:
    """What decides whether a checkpoint is resumed (tasks.runs.training_fingerprint, the
    function both training tasks use): each input that changes the training changes it; the
    process count and other stages' sections do not."""
    from moe.recipes.fit import training_fingerprint
    from tasks.config import load_config

    data, init = tmp_path / "data", tmp_path / "init"
    data.mkdir()
    init.mkdir()
    (data / "meta.json").write_text('{"splits": {"train": {"sha256": "a"}}}')
    (init / "model.safetensors").write_bytes(b"weights-1")

    def fp(stage: str, *sets: str) -> str:
        return training_fingerprint(load_config(None, list(sets)), stage, data, init)

    pre, sql = fp("pretrain"), fp("finetune_sql")
    for changed in ("pretrain.lr=0.01", "model.d_model=64", "moe.top_k=1", "pretrain.seed=7"):
        assert fp("pretrain", changed) != pre, changed
    for same in ("pretrain.nproc=1", "finetune_sql.lr=0.01", "evaluate.batch_size=3"):
        assert fp("pretrain", same) == pre, same
    # Machines come and go: a run moved to 2 nodes (or back) resumes its checkpoint.
    multi = ("storage.backend=s3", "storage.bucket=bkt")
    assert fp("pretrain", *multi, "pretrain.nodes=2") == fp("pretrain", *multi)
    assert fp("finetune_sql", *multi, "finetune_sql.nodes=2") == fp("finetune_sql", *multi)
    assert fp("finetune_sql", "finetune_sql.lr=0.01") != sql
    assert fp("finetune_sql", "finetune_sql.replay_ratio=0") != sql
    assert fp("finetune_sql", "finetune_domain.lr=0.01", "finetune_sql.nproc=1") == sql
    assert fp("finetune_domain") != sql  # each stage has its own section
    (init / "model.safetensors").write_bytes(b"weights-2")  # another start model
    assert fp("finetune_sql") != sql and fp("pretrain") == pre
    (data / "meta.json").write_text('{"splits": {"train": {"sha256": "b"}}}')  # other data
    assert fp("pretrain") != pre and fp("finetune_sql") != sql


def test_checkpoint_every_auto_reaches_the_trainer_from_the_stage_pool(tmp_path: Path) -> None:
    """checkpoint.every: auto through the real pretrain task: the stage's pool's
    mean_hours_between_interruptions is what the trainer's interval rule reads (not a field
    set on the trainer by hand), and the chosen interval is in the stage's result."""
    import numpy as np

    from moe.data.tokens import token_dtype, write_token_store
    from tasks.config import load_config
    from tasks.pretraining import pretrain_model

    data = tmp_path / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 60, 300).tolist() for _ in range(20)]
    counts = write_token_store(
        iter(map(str, range(20))),
        lambda b: [docs[int(i)] for i in b],
        0,
        64,
        data,
        {"val": 0.2},
        1,
    )
    (data / "meta.json").write_text(
        json.dumps({"dtype": str(token_dtype(64)), "vocab_size": 64, "splits": counts})
    )
    small = [
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.seq_len=16",
        "model.dense_hidden=32",
        "moe.num_experts=4",
        "moe.expert_hidden=32",
        "pretrain.max_steps=12",
        "pretrain.batch_size=4",
        "pretrain.device=cpu",
        "pretrain.log_every=2",
        "pretrain.eval_every=6",
        "pretrain.eval_batches=1",
        "finetune_sql.max_len=16",
        "finetune_domain.max_len=16",
        "checkpoint.every=auto",
    ]
    intervals = {}
    for hours in (0.5, 4.0):
        cfg = load_config(None, small)
        pool = cfg.pools.definitions[cfg.pools.stages["pretrain"]]
        pool.mean_hours_between_interruptions = hours
        result = pretrain_model.fn(cfg, data, tmp_path / f"out-{hours}", lambda row: None)
        intervals[hours] = result.resilience["checkpoint_interval"]
        assert intervals[hours]["mtbi_s"] == hours * 3600
    assert intervals[0.5]["rule"] == intervals[4.0]["rule"]


SIGTERM_SCRIPT = _script(
    100,
    1,
    """
    import os, signal

    mode = sys.argv[2]
    if mode == "signal":  # the machine gives notice at step 6 (a rank's case: no Prefect here)
        def notice(row):
            if row.get("step") == 6 and "loss" in row:
                print("SIGTERM at step 6", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)

        pretrain_model.fn(cfg, data, work / "cut", notice)
        print("the stage returned", flush=True)
    elif mode == "flow":  # in a Prefect flow run: the notice comes during step 7's forward
        from prefect import flow
        from moe.train.trainer import Trainer

        forward_backward = Trainer._forward_backward

        def noticed(self, run):
            if self.step == 6:
                print("SIGTERM in step 7", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)  # Prefect's handler raises here
            return forward_backward(self, run)

        Trainer._forward_backward = noticed
        flow(name="stage")(lambda: pretrain_model(cfg, data, work / "cut", lambda row: None))()
        print("the stage returned", flush=True)
    else:  # the stage's next run, and one never interrupted
        again = pretrain_model.fn(cfg, data, work / "cut", lambda row: None)
        straight = pretrain_model.fn(cfg, data, work / "straight", lambda row: None)
        cut_at = [i["at_step"] for i in again.resilience["interruptions"]]
        print(json.dumps({"resumed_from": again.resumed_from, "steps": again.steps, "cut_at": cut_at,
                          "same": digest(work / "cut") == digest(work / "straight")}))
    """,
)


@pytest.mark.parametrize("where", ["rank", "flow"])
def test_a_sigterm_saves_the_step_in_progress_and_the_next_run_resumes_from_it(
    tmp_path: Path, prefect_server: dict[str, str], where: str
) -> None:
    """A spot reclaim or an eviction gives notice by SIGTERM, which torchrun passes to its
    ranks: a training task outside a Prefect flow run, as a rank runs it. With checkpoints
    due only every 100 steps, the SIGTERM sent at step 6 of 10 (from the training itself: a
    condition, not a time) still leaves a checkpoint of step 6; the process ends by the
    signal, with no final model written; the stage's next run resumes from step 6 and ends
    with the weights of a run never interrupted.

    `flow`: the stage's task in a Prefect flow run, whose SIGTERM handler stays (a worker's
    cancel needs it): the signal, sent as step 7's forward begins, raises Prefect's
    TerminationSignal there; step 6 is saved, the run is Crashed and the process ends by the
    signal, as Prefect ends it."""
    import signal

    from moe.checkpoint.store import CheckpointStore

    env = {**os.environ, **prefect_server, "PYTHONPATH": str(ROOT)}

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", SIGTERM_SCRIPT, str(tmp_path), mode],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    cut = run("signal" if where == "rank" else "flow")
    said = cut.stdout + cut.stderr
    assert cut.returncode == -signal.SIGTERM, said[-3000:]
    assert "SIGTERM" in said and "the stage returned" not in said
    assert "stopping at step 6: interrupted" in said, said[-3000:]
    if where == "flow":
        assert "Crashed" in said and "termination signal" in said, said[-3000:]
    store = CheckpointStore(tmp_path / "cut" / "checkpoints")
    assert store.latest_valid() is not None and store.latest_valid().name == "step_00000006"
    assert not list((tmp_path / "cut").glob("*.safetensors"))  # not a finished stage

    after = run("resume")
    assert after.returncode == 0, after.stderr[-3000:]
    out = json.loads(after.stdout.strip().splitlines()[-1])
    # the journal says where the attempt was cut: step 6, not the step it last noted
    assert out == {"resumed_from": 6, "steps": 10, "cut_at": [6], "same": True}


ORPHANS_SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import psutil
    from prefect import flow, task
    from flows.cli import exit_on_sigterm

    if sys.argv[1] == "cli":
        exit_on_sigterm()

    @task
    def work():
        me = psutil.Process()
        servers = [p.pid for p in me.children() if "uvicorn" in " ".join(p.cmdline())]
        print("servers", *servers, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    flow(name="stage")(lambda: work())()
    """
)


@pytest.mark.parametrize("handler", ["cli", "default"])
def test_a_sigterm_stops_prefects_temporary_server_with_the_command(
    tmp_path: Path, handler: str
) -> None:
    """Without PREFECT_API_URL a command's flow run starts Prefect's temporary server as a
    child process. SIGTERM's default action ends the command without atexit, so that server
    ran on, orphaned (`default`: the check that it still does, so the test can fail). With
    the CLI's handler (`moe-pipeline` installs it) the command exits 143 and the server
    stops with it."""
    import signal
    import time

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "out.log"
    with open(out, "w") as f:  # a file, not a pipe: an orphaned server would hold a pipe open
        r = subprocess.run(
            [sys.executable, "-c", ORPHANS_SCRIPT, handler],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    said = out.read_text()
    [line] = [x for x in said.splitlines() if x.startswith("servers")]
    servers = [psutil.Process(int(pid)) for pid in line.split()[1:] if psutil.pid_exists(int(pid))]
    assert line.split()[1:], said[-3000:]  # the command had started its temporary server
    try:
        deadline = time.monotonic() + 30  # what an exit's stop of the server may take
        while handler == "cli" and any(p.is_running() for p in servers):
            assert time.monotonic() < deadline, [p.pid for p in servers]
            time.sleep(0.2)
        left = [p.pid for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if handler == "cli":
            assert r.returncode == 128 + signal.SIGTERM, said[-3000:]
            assert not left, left
        else:
            assert r.returncode == -signal.SIGTERM and left, (r.returncode, servers)
    finally:
        for p in servers:
            if p.is_running():
                p.kill()
