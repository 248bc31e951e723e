"""Checkpoint storage tiers: hot data on fast disk, cold data in cheap object storage.

`offload_checkpoints` keeps the newest checkpoint's shared and hot tiers (L0, L1) and its
state on local disk, and moves to the `storage` object store its cold tier (L2) and every
older checkpoint's tensor files, on S3 with `checkpoint.cold_storage_class` (e.g.
STANDARD_IA). Each file is uploaded, checked to exist, recorded in its checkpoint's manifest
(`locations`), and only then deleted locally; manifests stay local, so `checkpoint ls`
shows where everything is. A restore fetches what is missing and verifies its sha256
(`CheckpointStore(fetch=...)`, which `checkpoint_store` wires up).

The training tasks run it after each save on the checkpoint writer's thread (off the
training thread; errors are logged and the next pass picks the file up again) and once
more, as a Prefect task with retries, when they finish. Objects of checkpoints that
retention later deletes stay in the store: expire them with a bucket lifecycle rule.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from moe.checkpoint.store import CheckpointStore
from tasks.config import Config
from tasks.multinode import share_object, sync_checkpoints
from tasks.storage import RETRIES, ObjectStore, open_store

log = logging.getLogger(__name__)


def checkpoint_store(cfg: Config, root: Path, run_key: str | None = None) -> CheckpointStore:
    """The stage's checkpoint store. With offload on it fetches offloaded files back, and
    given the run's key it also offloads after each save (on the writer thread)."""
    store = CheckpointStore.from_config(root, cfg.checkpoint)
    hooks: list[Callable[[], Any]] = []
    if cfg.checkpoint.offload:
        objects = open_store(cfg.storage)
        store.fetch = lambda key, dest: objects.get(key, dest)
        if run_key is not None:
            hooks.append(
                lambda: offload(store, objects, run_key, cfg.checkpoint.cold_storage_class)
            )
    if run_key is not None and os.environ.get("MOE_CHECKPOINT_MIRROR") == run_key:
        # a node of a multi-node Job (tasks/multinode.py): the next machines resume from the
        # mirror, so it follows every save (after the offload, which it then reflects)
        mirror, digests = open_store(cfg.storage), {}
        hooks.append(lambda: sync_checkpoints(mirror, store.root, run_key, digests))
        # Sharded saves: each rank's files go up as the mirror's objects before the manifest
        # is written (they name them), and a restore fetches those this machine lacks.
        store.share = lambda path, digest: share_object(mirror, run_key, path, digest)
        store.fetch = lambda key, dest: mirror.get(key, dest)  # the offload's store too
    if hooks:
        store.on_saved = lambda _path: _run_hooks(hooks)
    return store


def _run_hooks(hooks: list[Callable[[], Any]]) -> None:
    """Each after-save hook on its own: an offload that fails does not skip the mirror."""
    for hook in hooks:
        try:
            hook()
        except Exception as e:  # noqa: BLE001 - the next save's pass picks the files up
            log.warning("after-save step failed (the next save retries it): %s", e)


def offload(
    store: CheckpointStore, objects: ObjectStore, run_key: str, storage_class: str
) -> dict[str, Any]:
    """Move cold tiers and older checkpoints to the object store. Idempotent: a file already
    recorded (or already gone) is skipped, so a retry resumes where a failure stopped."""
    # Not store.latest_valid(): that waits for the writer thread, which may be running us.
    newest = next((p for p in store.checkpoint_dirs() if store.verify(p) is None), None)
    # The newest checkpoint and the bases its deltas need stay on fast disk (hot tiers): the
    # next resume reads them, and the next save diffs against them.
    hot = {newest} if newest else set()
    if newest is not None:  # its manifest names its bases (no second hashing pass)
        hot |= {store.step_dir(b) for b in store.bases(newest)}
    moved: list[str] = []
    kept_bytes = 0
    for path in store.checkpoint_dirs():
        if store.verify(path) is not None:
            continue  # never offload a damaged or half-written checkpoint
        record: dict[str, str] = {}
        for name in store.offloadable(path, hot=path in hot):
            f = path / name
            key = f"checkpoints/{run_key}/{path.name}/{name}"
            objects.put(f, key, storage_class=storage_class)
            if not objects.exists(key):
                raise RuntimeError(f"upload of {f} to {objects.uri}/{key} did not land")
            record[name] = key
        if record:
            store.set_locations(path, record)  # recorded before anything is deleted
            for name in record:
                (path / name).unlink()
                moved.append(f"{path.name}/{name}")
        kept_bytes += sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    if moved:
        log.info("offloaded %d checkpoint files to %s: %s", len(moved), objects.uri, moved)
    return {"moved": moved, "local_bytes": kept_bytes, "store": objects.uri}


@task(name="offload-checkpoints", cache_policy=NONE, **RETRIES)
def offload_checkpoints(cfg: Config, root: Path, run_key: str) -> dict[str, Any]:
    store = checkpoint_store(cfg, root)
    return offload(store, open_store(cfg.storage), run_key, cfg.checkpoint.cold_storage_class)
