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
