"""Object stores behind one interface (a local folder, S3, a Hugging Face Hub repo), and sets
of files moved through them: each file with its sha256 beside it, a manifest written last,
every file verified on the way back. The prepared data's archive: tasks/archive.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from prefect.tasks import exponential_backoff

from moe.errors import InputError
from moe.hashing import sha256_file
from tasks import retry_unless_input_error
from tasks.config import StorageConfig

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
