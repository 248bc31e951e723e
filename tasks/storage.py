"""Object store (local folder or S3), and publish/download of prepared data as a verified archive.

Publish packs the prepared folder into one tar stream compressed with zstandard (multi-threaded,
level in params), writes a manifest with the sha256 of every file and of the archive, and
uploads both under `datasets/NAME/VERSION/`, where VERSION is derived from the content, so the
same data always lands at the same address and a changed one never overwrites an old one.
Download fetches, checks the archive hash, unpacks into the cache and checks every file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import zstandard
from prefect import task
from prefect.cache_policies import NONE
from prefect.tasks import exponential_backoff

from moe.errors import InputError
from moe.hashing import sha256_file
from tasks import retry_unless_input_error
from tasks.config import Config, StorageConfig

log = logging.getLogger(__name__)

RETRIES = dict(
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_unless_input_error,
)


class ObjectStore(Protocol):
    uri: str

    def put(self, local: Path, key: str, storage_class: str = "") -> None: ...
    def get(self, key: str, local: Path) -> None: ...
    def exists(self, key: str) -> bool: ...
    def read_text(self, key: str) -> str: ...


class LocalObjectStore:
    """A folder that behaves like a bucket (atomic writes)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.uri = f"file://{self.root.resolve()}"

    def _path(self, key: str) -> Path:
        _check_key(key)
        return self.root / key

    def put(self, local: Path, key: str, storage_class: str = "") -> None:
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".part")
        shutil.copyfile(local, tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dest)

    def get(self, key: str, local: Path) -> None:
        src = self._path(key)
        if not src.is_file():
            raise InputError(f"{self.uri}/{key} does not exist: run the publish stage first")
        shutil.copyfile(src, local)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def read_text(self, key: str) -> str:
        return self._path(key).read_text()


class S3ObjectStore:
    """S3 (or any S3-compatible server) through boto3; multipart above `storage.multipart_mib`.

    Credentials come from the environment / AWS config, never from params.yaml.
    """

    def __init__(self, cfg: StorageConfig) -> None:
        import boto3
        from boto3.s3.transfer import TransferConfig

        self.bucket, self.prefix = cfg.bucket, cfg.prefix.strip("/")
        self.client = boto3.client(
            "s3", endpoint_url=cfg.endpoint_url or None, region_name=cfg.region
        )
        part = cfg.multipart_mib << 20
        self.transfer = TransferConfig(multipart_threshold=part, multipart_chunksize=part)
        self.uri = f"s3://{self.bucket}/{self.prefix}"

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, local: Path, key: str, storage_class: str = "") -> None:
        extra = {"StorageClass": storage_class} if storage_class else None
        self.client.upload_file(
            str(local), self.bucket, self._key(key), Config=self.transfer, ExtraArgs=extra
        )

    def get(self, key: str, local: Path) -> None:
        self.client.download_file(self.bucket, self._key(key), str(local), Config=self.transfer)

    def exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def read_text(self, key: str) -> str:
        return (
            self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read().decode()
        )


class HfObjectStore:
    """A Hugging Face Hub dataset repo through `huggingface_hub` (token from HF_TOKEN).

    Published versions are also tagged (`tag()`), so a dataset version is a Hub revision too.
    """

    def __init__(
        self,
        cfg: StorageConfig,
        api: Any = None,
        repo: str = "",
        repo_type: str = "dataset",
        prefix: str | None = None,
    ) -> None:
        """`repo`, `repo_type`, `prefix`: another repo than storage.hf_repo, e.g. the model
        repo a published model goes to (files at its root, as from_pretrained reads them)."""
        from huggingface_hub import HfApi

        self.api = api if api is not None else HfApi()
        self.repo, self.revision = repo or cfg.hf_repo, cfg.hf_revision or None
        self.repo_type = repo_type
        self.prefix = (cfg.prefix if prefix is None else prefix).strip("/")
        kind = "datasets/" if repo_type == "dataset" else ""
        self.uri = f"hf://{kind}{self.repo}" + (f"/{self.prefix}" if self.prefix else "")

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, local: Path, key: str, storage_class: str = "") -> None:
        self.api.create_repo(self.repo, repo_type=self.repo_type, exist_ok=True, private=True)
        self.api.upload_file(
            path_or_fileobj=str(local),
            path_in_repo=self._key(key),
            repo_id=self.repo,
            repo_type=self.repo_type,
            revision=self.revision,
            commit_message=f"moe-pipeline: {key}",
        )

    def get(self, key: str, local: Path) -> None:
        cached = self.api.hf_hub_download(
            self.repo, self._key(key), repo_type=self.repo_type, revision=self.revision
        )
        shutil.copyfile(cached, local)

    def exists(self, key: str) -> bool:
        return bool(
            self.api.file_exists(
                self.repo, self._key(key), repo_type=self.repo_type, revision=self.revision
            )
        )

    def read_text(self, key: str) -> str:
        return Path(
            self.api.hf_hub_download(
                self.repo, self._key(key), repo_type=self.repo_type, revision=self.revision
            )
        ).read_text()

    def tag(self, tag: str) -> None:
        self.api.create_tag(
            self.repo, tag=tag, repo_type=self.repo_type, revision=self.revision, exist_ok=True
        )


def _check_key(key: str) -> None:
    """Object keys are relative paths inside the store: no '..', no absolute paths."""
    parts = key.replace("\\", "/").split("/")
    if key.startswith("/") or ".." in parts or not key:
        raise InputError(f"object key {key!r} is not a relative path inside the store")


def open_store(cfg: StorageConfig) -> ObjectStore:
    if cfg.backend == "s3":
        return S3ObjectStore(cfg)
    if cfg.backend == "hf":
        return HfObjectStore(cfg)
    return LocalObjectStore(cfg.root)


# ------------------------------------------------------------------ sets of files


def put_text(store: ObjectStore, key: str, text: str) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    try:
        store.put(Path(f.name), key)
    finally:
        os.unlink(f.name)


@contextlib.contextmanager
def _frozen(path: Path) -> Iterator[Path]:
    """The file as it is now, whatever replaces it meanwhile: a hard link to its current
    content beside it (a copy where the filesystem has no links), removed afterwards. Files
    that change here are replaced atomically, so the link keeps the content it was made on."""
    snap = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.snap")
    snap.unlink(missing_ok=True)
    try:
        os.link(path, snap)
    except OSError:
        shutil.copy2(path, snap)
    try:
        yield snap
    finally:
        snap.unlink(missing_ok=True)


def push_files(
    store: ObjectStore,
    prefix: str,
    files: dict[str, Path],
    extra: dict[str, Any] | None = None,
    digests: dict | None = None,
    addressed: bool = False,
) -> dict[str, Any]:
    """Upload `files` (key relative to `prefix`/files -> local path) with a `.sha256` beside
    each, then `prefix`/manifest.json listing them, written last: its presence means the set
    is complete. A file whose sidecar already holds its digest is not sent again, so a retry
    (or the next sync of a growing set) sends only what is new. `digests` caches sha256s of
    unchanged files between calls (pass the same dict each time).

    `addressed`: a set that is pushed again and again while its files change (a checkpoint
    folder) stores each content once under `prefix`/objects/<sha256> instead: an object
    never changes once written, so the manifest always describes objects that match it,
    even when a push dies half-way and the last complete manifest is the one read."""
    listed: dict[str, dict[str, Any]] = {}
    for rel, path in sorted(files.items()):
        _check_key(rel)
        # hashed and sent from one snapshot: a file replaced meanwhile (the attempt journal,
        # `latest`: both are rewritten with os.replace while training goes on) must not be
        # sent with another content than its digest says
        with _frozen(path) as snap:
            stat = snap.stat()
            cache_key = (path, stat.st_ino, stat.st_size, stat.st_mtime_ns)
            digest = digests.get(cache_key) if digests is not None else None  # type: ignore[call-overload]
            if digest is None:
                digest = sha256_file(snap)
                if digests is not None:
                    digests[cache_key] = digest  # type: ignore[index]
            if addressed:
                key = f"{prefix}/objects/{digest}"
                if not store.exists(key):
                    store.put(snap, key)
                listed[rel] = {"sha256": digest, "bytes": stat.st_size, "key": key}
                continue
            key = f"{prefix}/files/{rel}"
            if not (store.exists(f"{key}.sha256") and store.read_text(f"{key}.sha256") == digest):
                store.put(snap, key)
                put_text(store, f"{key}.sha256", digest)
        listed[rel] = {"sha256": digest, "bytes": stat.st_size}
    manifest = {**(extra or {}), "files": listed, "created": time.time()}
    put_text(store, f"{prefix}/manifest.json", json.dumps(manifest, indent=1))
    return manifest


def pull_files(store: ObjectStore, prefix: str, dest_root: Path, missing: str) -> int:
    """Fetch every file of `prefix`/manifest.json into dest_root/<key>, each verified against
    its sha256 before it replaces anything; a file already there intact is not fetched.
    Returns how many were fetched; no manifest is an InputError saying `missing`."""
    import tempfile

    if not store.exists(f"{prefix}/manifest.json"):
        raise InputError(f"{store.uri}/{prefix}/manifest.json is missing: {missing}")
    manifest = json.loads(store.read_text(f"{prefix}/manifest.json"))
    fetched = 0
    for rel, meta in manifest["files"].items():
        _check_key(rel)  # a manifest may not point outside dest_root
        _check_key(meta.get("key") or rel)
        dest = dest_root / rel
        if dest.is_file() and sha256_file(dest) == meta["sha256"]:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            key = meta.get("key") or f"{prefix}/files/{rel}"
            store.get(key, tmp)
            got = sha256_file(tmp)
            if got != meta["sha256"]:
                raise ValueError(
                    f"{store.uri}/{key}: sha256 {got} does not match the "
                    f"manifest ({meta['sha256']}); the upload is damaged"
                )
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        fetched += 1
    return fetched


# --------------------------------------------------------------------------- publish


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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _file_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    return {
        str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


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
    version = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
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
    )


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
