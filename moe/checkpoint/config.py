"""The checkpoint section: tiers, codecs, retention and the offload to cheap storage
(moe/checkpoint/store.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe.config import knob


@dataclass
class CheckpointConfig:
    """Tiered checkpoints: see moe/checkpoint/store.py."""

    max_retain: int = knob(3, ge=1)  # keep the last 3 (plus the best, plus the bases they need)
    keep_best: bool = True  # also keep the checkpoint with the lowest validation loss
    hot_every: int = knob(
        100, ge=1
    )  # steps between full writes of L0 (shared) and L1 (hot experts)
    cold_every: int = knob(1000, ge=1)  # steps between full writes of L2 (cold experts)
    cold_threshold: float = knob(
        0.5, ge=0, le=1
    )  # an expert below this x its layer's mean load is cold
    # Codec of the hot tiers L0/L1: byte-grouped zstd or raw.
    hot_codec: Literal["bg-zstd", "raw"] = "bg-zstd"
    hot_level: int = knob(1, ge=1, le=22, note=" (zstd levels)")  # fast (~220 MB/s here)
    # fp16-zstd is LOSSY (an option for the cold tier): marked in the manifest and on restore.
    cold_codec: Literal["bg-zstd", "bg-lzma", "fp16-zstd"] = "bg-zstd"
    # L2 is written rarely: slow; ~3% smaller than level 1 on bf16 (bench/RESULTS.md).
    cold_level: int = knob(19, ge=1, le=22, note=" (zstd levels)")
    background: bool = True  # encode and write on a worker thread; training only copies
    # Cold data to cheap object storage. After each save and at the end of a
    # training stage, move the newest checkpoint's cold tier (L2) and every older
    # checkpoint's tensors to the `storage` object store; restore fetches them back.
    offload: bool = False
    cold_storage_class: str = "STANDARD_IA"  # S3 storage class of offloaded files ("" = default)
    # How often a training stage saves. "stage": every checkpoint_every steps of the stage.
    # "auto": Young/Daly (moe/train/resilience.py) from the measured save stall, the step time and
    # the stage pool's mean_hours_between_interruptions; the first save comes after at most
    # 10 steps to measure the stall, and a pool declaring no interruptions keeps the stage's
    # checkpoint_every. The choice and its inputs are logged and kept in the lineage record.
    every: Literal["stage", "auto"] = "stage"
