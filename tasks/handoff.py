"""Hand-off between stages that run on different machines: through the object store only.

With `dispatch: deployments` each stage runs on its own pool's worker, which has its own disk.
After a stage, the outputs that later stages read (the receipt, models, summaries, lineage
records, the report) go to `runs/<run>/<stage>/` in the object store with a manifest of their
sha256 digests, written last (its presence means the upload is complete). Before a stage, the
hand-offs of every earlier stage are fetched and verified. A file already present with the
right digest is not fetched again, so a stage re-run after its worker died downloads nothing
twice, and stages that share a pool's disk fetch nothing at all.

The training data itself does not travel this way: publish uploads it once, and training
stages download and verify it from the receipt (tasks/archive.py).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.errors import InputError
from tasks.config import Config
from tasks.pools import STAGES
from tasks.storage import RETRIES, _check_key, open_store, pull_files, push_files

log = logging.getLogger(__name__)


def _prefix(run: str, stage: str) -> str:
    _check_key(run)
    if "/" in run:
        raise InputError(f"hand-off run key {run!r} may not contain '/'")
    return f"runs/{run}/{stage}"


@task(name="hand-off-outputs", cache_policy=NONE, **RETRIES)
def push_outputs(cfg: Config, stage: str, run: str, outputs: list[Path]) -> dict[str, Any]:
    """Upload `stage`'s outputs (its declaration's hand-off files, flows/stages.py, relative
    to the working folder) under runs/<run>/<stage>/, the manifest last."""
    store, prefix = open_store(cfg.storage), _prefix(run, stage)
    files: dict[str, Path] = {}
    t0 = time.perf_counter()
    for path in outputs:
        if not path.is_file():
            raise InputError(f"{path} is missing after the {stage} stage; nothing was handed off")
        files[path.as_posix()] = path
    manifest = push_files(store, prefix, files, {"stage": stage, "run": run})
    total = sum(f["bytes"] for f in manifest["files"].values())
    log.info(
        "handed off %d files (%.1f MB) of %s to %s/%s in %.1f s",
        len(files),
        total / 1e6,
        stage,
        store.uri,
        prefix,
        time.perf_counter() - t0,
    )
    return manifest


@task(name="fetch-hand-offs", cache_policy=NONE, **RETRIES)
def pull_inputs(cfg: Config, stage: str, run: str, upto: list[str] | None = None) -> int:
    """Fetch and verify the hand-offs of every stage before `stage` (or those in `upto`);
    returns the number of files downloaded. Missing upstream hand-offs are an InputError."""
    store = open_store(cfg.storage)
    earlier = upto if upto is not None else list(STAGES[: STAGES.index(stage)])
    fetched = 0
    for up in earlier:
        fetched += pull_files(
            store,
            _prefix(run, up),
            Path("."),
            f"the {up} stage of run {run} has not finished; run it first (its outputs reach "
            f"{stage} only through the object store)",
        )
    if fetched:
        log.info("fetched %d hand-off files of %s for %s", fetched, ", ".join(earlier), stage)
    return fetched
