"""Read back what an offline W&B run logged: the history rows in its `run-*.wandb` file.

The file is W&B's transaction log: a 7-byte header (":W&B", magic, version), then LevelDB
log records in 32 KiB blocks (crc32, length, type: full / first / middle / last), each
payload a `wandb_internal_pb2.Record`. W&B ships no reader for it in Python any more (its core
is in Go), and `wandb sync --view` prints for humans; this reads the history records only."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7


def history(run_file: Path) -> dict[int, dict[str, Any]]:
    """{step: {key: value}} of every `run.log` the run wrote (nested keys joined by '/')."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    pos, buf, rows = HEADER, b"", {}
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk, pos = data[pos + HEADER : pos + HEADER + length], pos + HEADER + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):  # a whole record
            rec = pb.Record()
            rec.ParseFromString(buf)
            if rec.WhichOneof("record_type") == "history":
                items = rec.history.item
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in items}
                rows.setdefault(rec.history.step.num, {}).update(row)
    return rows


def run_file(wandb_dir: Path, run_id: str) -> Path:
    """The offline run file of `run_id` under `wandb_dir` (the `wandb.dir` setting)."""
    found = list(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(found) == 1, f"one offline run {run_id} expected under {wandb_dir}, found {found}"
    return found[0]
