"""tasks/progress.py: without a terminal, long work says how far it is in plain log lines (a
tenth at a time); inside a flow run, a Prefect progress artifact follows it (test_e2e.py reads
the training stages' artifacts at 100%)."""

from __future__ import annotations

import logging

import pytest

from tasks.progress import progress, training_log


def test_without_a_terminal_progress_is_a_log_line_per_tenth(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="tasks.progress"):
        with progress("evaluate-demo", 50, "questions", tty=False) as update:
            for i in range(1, 51):
                update(i)
    lines = [r.getMessage() for r in caplog.records if r.name == "tasks.progress"]
    assert lines[0] == "evaluate-demo: 5 of 50 questions" and len(lines) == 10
    assert lines[-1] == "evaluate-demo: 50 of 50 questions"


def test_training_rows_move_the_progress_and_reach_the_logger(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen = []
    with caplog.at_level(logging.INFO, logger="tasks.progress"):
        with training_log("pretrain", 20, seen.append) as log_fn:
            log_fn({"step": 10, "loss": 3.0})
            log_fn({"step": 10, "val_loss": 2.9})
    assert seen == [{"step": 10, "loss": 3.0}, {"step": 10, "val_loss": 2.9}]  # W&B gets all
    # the trainer logs its own lines: the progress adds none
    assert not [r for r in caplog.records if r.name == "tasks.progress"]


def test_on_a_terminal_the_bar_renders_and_without_one_plain_lines(tmp_path) -> None:
    """The same progress call in a child process on a pseudo-terminal (stdout, where rich
    draws, and stderr, which decides) draws the bar (counts and the bar's glyphs); with
    stderr a pipe it writes log lines instead."""
    import os
    import pty
    import subprocess
    import sys

    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.INFO, stream=sys.stderr, format='%(message)s')\n"
        "from tasks.progress import progress\n"
        "with progress('evaluate-demo', 20, 'questions') as update:\n"
        "    for i in range(1, 21):\n"
        "        update(i)\n"
    )
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm", "PYTHONPATH": os.getcwd()}
    primary, secondary = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.DEVNULL,
        stdout=secondary,
        stderr=secondary,
        env=env,
    )
    os.close(secondary)
    chunks = []
    while True:
        try:
            data = os.read(primary, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=120) == 0
    os.close(primary)
    tty_out = b"".join(chunks).decode("utf-8", "replace")
    assert "20/20" in tty_out and "━" in tty_out, tty_out[-500:]
    assert "evaluate-demo: 20 of 20 questions" not in tty_out  # the bar, not log lines
    piped = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert "evaluate-demo: 20 of 20 questions" in piped.stderr
    assert "━" not in piped.stderr + piped.stdout
