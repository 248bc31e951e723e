"""What a training run in other processes (torchrun ranks, the pods of a multi-node Job)
wrote, replayed where the flow run is (the fingerprint that decides whether a checkpoint is
resumed is the recipes': moe/recipes/fit.py `training_fingerprint`). A leaf of tasks/:
the launchers (tasks/launch.py, tasks/multinode.py) read it, and it imports none of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def replay_metrics(
    out_dir: Path,
    log_fn: Callable[[dict[str, Any]], None],
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """Send the metrics rows a run in other processes wrote (metrics.jsonl) to log_fn (W&B)
    and `on_row` (the events, which its ranks, outside the flow run, could not emit)."""
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            if line:
                row = json.loads(line)
                log_fn(row)
                if on_row is not None:
                    on_row(row)
