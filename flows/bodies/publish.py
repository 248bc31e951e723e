"""The publish stage: archive the prepared data with zstd and upload it with a sha256
manifest (CPU)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from flows.stage import PUBLISHED, Done, Stage, files, log
from moe.errors import InputError
from tasks.archive import publish_dataset
from tasks.config import Config
from tasks.lineage import StageRecord, write_json
from tasks.storage import open_store


def _prepared(cfg: Config) -> dict[str, Path]:
    prepared = Path(cfg.data.out_dir)
    if not (prepared / "meta.json").is_file():
        raise InputError(
            f"{prepared}/meta.json is missing: run the prepare stage first (moe-pipeline stage prepare)"
        )
    return {"prepared": prepared}


def _in_store(cfg: Config) -> bool:
    """An emptied bucket (or another one) needs a new upload."""
    receipt = json.loads((PUBLISHED / "receipt.json").read_text())
    store = open_store(cfg.storage)
    return all(store.exists(receipt[k]) for k in ("manifest_key", "archive_key"))


def _publish(cfg: Config, record: StageRecord) -> Done:
    """Archive the prepared data with zstd and upload it with a sha256 manifest (CPU)."""
    work = Path(".cache/publish")
    published = publish_dataset(cfg, Path(cfg.data.out_dir), work)
    shutil.rmtree(work, ignore_errors=True)
    write_json(PUBLISHED / "receipt.json", published.to_dict())
    log.info(
        "published %s/%s to %s: %d -> %d bytes; token files alone compress to %.1f%% of their size",
        published.name,
        published.version,
        published.uri,
        published.raw_bytes,
        published.archive_bytes,
        100 * published.token_archive_ratio,
    )
    return Done(published.to_dict(), {"receipt": PUBLISHED / "receipt.json"})


PUBLISH = Stage(
    "publish",
    "storage",
    "Archive the prepared data with zstd and upload it with a sha256 manifest (CPU).",
    out=lambda cfg: PUBLISHED,
    inputs=_prepared,
    handoff=lambda cfg: files(PUBLISHED),
    body=_publish,
    done="data/published/receipt.json",
    reads=lambda cfg: [(Path(cfg.data.out_dir) / "meta.json", "prepare")],
    still_there=_in_store,
)
