"""Publish and download of the prepared data as a verified archive in the object store.

Publish packs the prepared folder into one tar stream compressed with zstandard (multi-threaded,
level in params), writes a manifest with the sha256 of every file and of the archive, and
uploads both under `datasets/NAME/VERSION/`, where VERSION is derived from the content, so the
same data always lands at the same address and a changed one never overwrites an old one.
Download fetches, checks the archive hash, unpacks into the cache and checks every file.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard
from prefect import task
from prefect.cache_policies import NONE

from moe.errors import InputError
from moe.hashing import sha256_file
from tasks.config import Config
from tasks.lineage import folder_digest
from tasks.storage import RETRIES, HfObjectStore, _check_key, open_store

log = logging.getLogger(__name__)


@dataclass
class Published:
    name: str
    version: str
    uri: str
    archive_key: str
    manifest_key: str
    archive_sha256: str
    raw_bytes: int
    archive_bytes: int
    token_bytes: int
    token_archive_ratio: float  # compressed / raw, measured on the token files alone
    seconds: float
    # The prepared data's digest as prepare's lineage record gives it (outputs.prepared): a
    # stage compares it with that record instead of hashing the data again (flows/stage.py).
    prepared_sha256: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _version(files: dict[str, dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]


def dataset_version(prepared: Path) -> str:
    """The version publish gives the prepared data in `prepared`: a digest of every file's
    name, sha256 and size."""
    return _version(_file_manifest(prepared))


def _zstd(level: int, threads: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)


def pack(folder: Path, archive: Path, level: int, threads: int) -> None:
    """Stream `folder` as tar through zstd into `archive` (memory bounded by zstd's window)."""
    with open(archive, "wb") as raw, _zstd(level, threads).stream_writer(raw) as zw:
        with tarfile.open(fileobj=zw, mode="w|") as tar:
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    tar.add(p, arcname=str(p.relative_to(folder)), recursive=False)


def _token_ratio(folder: Path, level: int, threads: int) -> tuple[int, float]:
    """zstd ratio on the .bin token files alone (the "70% smaller" claim for zstd is about these)."""
    raw = comp = 0
    for p in sorted(folder.glob("*.bin")):
        raw += p.stat().st_size
        counter = _CountingWriter()
        with open(p, "rb") as f, _zstd(level, threads).stream_writer(counter, closefd=False) as zw:
            shutil.copyfileobj(f, zw, 1 << 20)
        comp += counter.n
    return raw, (comp / raw if raw else 1.0)


class _CountingWriter(io.RawIOBase):
    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: bytes) -> int:  # type: ignore[override]
        self.n += len(b)
        return len(b)


@task(name="publish-dataset", cache_policy=NONE, **RETRIES)
def publish_dataset(cfg: Config, prepared: Path, work: Path) -> Published:
    """Archive + manifest into the object store; a re-run after a failure re-uses what is
    already stored and verified (content-addressed keys)."""
    t0 = time.perf_counter()
    s = cfg.storage
    files = _file_manifest(prepared)
    if "meta.json" not in files:
        raise InputError(f"{prepared}/meta.json is missing: run the prepare stage first")
    version = _version(files)
    base = f"datasets/{s.dataset_name}/{version}"
    store = open_store(s)
    work.mkdir(parents=True, exist_ok=True)
    archive = work / "data.tar.zst"
    manifest_key, archive_key = f"{base}/manifest.json", f"{base}/data.tar.zst"
    if store.exists(manifest_key) and store.exists(archive_key):
        manifest = json.loads(store.read_text(manifest_key))
        log.info(
            "dataset %s/%s is already published at %s; not uploading again",
            s.dataset_name,
            version,
            store.uri,
        )
    else:
        pack(prepared, archive, s.zstd_level, s.zstd_threads)
        token_bytes, ratio = _token_ratio(prepared, s.zstd_level, s.zstd_threads)
        manifest = {
            "name": s.dataset_name,
            "version": version,
            "files": files,
            "archive": {
                "key": "data.tar.zst",
                "sha256": sha256_file(archive),
                "bytes": archive.stat().st_size,
            },
            "zstd_level": s.zstd_level,
            "token_files": {"bytes": token_bytes, "zstd_ratio": round(ratio, 4)},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (work / "manifest.json").write_text(json.dumps(manifest, indent=1))
        store.put(archive, archive_key)
        store.put(work / "manifest.json", manifest_key)  # last: its presence means complete
        if isinstance(store, HfObjectStore):
            store.tag(f"{s.dataset_name}-{version}")
    # Measured once, when packing; a re-publish of stored data reads it from the manifest.
    if "token_files" in manifest:
        token_bytes, ratio = manifest["token_files"]["bytes"], manifest["token_files"]["zstd_ratio"]
    else:  # published by an earlier version that did not record it
        token_bytes, ratio = _token_ratio(prepared, s.zstd_level, s.zstd_threads)
    raw_bytes = sum(f["bytes"] for f in files.values())
    prepared_sha256 = folder_digest({rel: f["sha256"] for rel, f in files.items()})
    recorded = prepared_output_digest(prepared)
    if recorded is not None and recorded != prepared_sha256:
        log.warning(
            "%s changed since prepare recorded it in its lineage.json: published as it is now;"
            " a stage will refuse it until prepare runs again",
            prepared,
        )
    return Published(
        name=s.dataset_name,
        version=version,
        uri=store.uri,
        archive_key=archive_key,
        manifest_key=manifest_key,
        archive_sha256=manifest["archive"]["sha256"],
        raw_bytes=raw_bytes,
        archive_bytes=manifest["archive"]["bytes"],
        token_bytes=token_bytes,
        token_archive_ratio=round(ratio, 4),
        seconds=round(time.perf_counter() - t0, 3),
        prepared_sha256=prepared_sha256,
    )


def prepared_output_digest(prepared: Path) -> str | None:
    """What prepare's lineage record (prepared/lineage.json) says the prepared data is, with
    no file hashed; None where there is no record."""
    try:
        return json.loads((prepared / "lineage.json").read_text())["outputs"]["prepared"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cached_copy_intact(dest: Path, marker: Path, archive_sha256: str) -> bool:
    """Whether the unpacked copy in `dest` is the published version, file by file: the
    marker names the archive and every file's size and sha256 from the manifest, and each
    file is hashed again (a copy edited or truncated since it was unpacked is fetched anew)."""
    try:
        record = json.loads(marker.read_text())
        if record["archive_sha256"] != archive_sha256:
            return False
        for rel, meta in record["files"].items():
            _check_key(rel)
            p = dest / rel
            if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
                log.warning("%s changed since it was downloaded; fetching the dataset again", p)
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


@task(name="download-dataset", cache_policy=NONE, **RETRIES)
def download_dataset(cfg: Config, receipt: dict[str, Any]) -> Path:
    """Fetch, verify and unpack a published dataset into the cache; a verified copy is reused."""
    dest = Path(cfg.storage.cache_dir) / receipt["name"] / receipt["version"]
    marker = dest / ".verified"
    if _cached_copy_intact(dest, marker, receipt["archive_sha256"]):
        return dest
    store = open_store(cfg.storage)
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    manifest = json.loads(store.read_text(receipt["manifest_key"]))
    archive = tmp.parent / f"{receipt['version']}.tar.zst"
    store.get(receipt["archive_key"], archive)
    got = sha256_file(archive)
    if got != manifest["archive"]["sha256"] or got != receipt["archive_sha256"]:
        raise ValueError(
            f"{store.uri}/{receipt['archive_key']}: sha256 {got} does not match the manifest; the upload is damaged"
        )
    with open(archive, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as zr:
        with tarfile.open(fileobj=zr, mode="r|") as tar:
            tar.extractall(tmp, filter="data")
    archive.unlink()
    for rel, meta in manifest["files"].items():
        _check_key(rel)  # a manifest may not point outside the download folder
        p = tmp / rel
        if not p.is_file() or sha256_file(p) != meta["sha256"]:
            raise ValueError(
                f"{rel} in {receipt['archive_key']} does not match its sha256 in the manifest"
            )
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    marker.write_text(
        json.dumps({"archive_sha256": receipt["archive_sha256"], "files": manifest["files"]})
    )
    log.info("downloaded and verified %s/%s into %s", receipt["name"], receipt["version"], dest)
    return dest
