"""Contract of tasks/storage.py: publish writes a content-addressed zstd archive + sha256
manifest; download verifies every hash and refuses damaged data; S3 is tested against a real
S3 API (moto's server mode on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import boto3
import pytest

from moe.config import Config, StorageConfig
from tasks.storage import LocalObjectStore, download_dataset, publish_dataset


def _prepared(tmp_path: Path) -> Path:
    d = tmp_path / "prepared"
    (d / "sql").mkdir(parents=True)
    (d / "meta.json").write_text(json.dumps({"vocab_size": 10}))
    (d / "train.bin").write_bytes(bytes(range(256)) * 400)
    (d / "sql" / "pairs.jsonl").write_text('{"q": 1}\n')
    return d


def _cfg(tmp_path: Path, **storage: object) -> Config:
    return Config(
        storage=StorageConfig(
            root=str(tmp_path / "store"), cache_dir=str(tmp_path / "cache"), **storage
        )
    )


def _round_trip(cfg: Config, tmp_path: Path) -> None:
    prepared = _prepared(tmp_path)
    pub = publish_dataset.fn(cfg, prepared, tmp_path / "work")
    assert 0 < pub.archive_bytes < pub.raw_bytes
    assert 0 < pub.token_archive_ratio < 1
    again = publish_dataset.fn(cfg, prepared, tmp_path / "work2")
    assert (
        again.version == pub.version and again.archive_sha256 == pub.archive_sha256
    )  # same content, same address
    got = download_dataset.fn(cfg, pub.to_dict())
    for f in prepared.rglob("*"):
        if f.is_file():
            assert (got / f.relative_to(prepared)).read_bytes() == f.read_bytes()
    assert download_dataset.fn(cfg, pub.to_dict()) == got  # verified copy reused


def test_local_round_trip(tmp_path: Path) -> None:
    _round_trip(_cfg(tmp_path), tmp_path)


def test_changed_data_gets_a_new_version(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prepared = _prepared(tmp_path)
    v1 = publish_dataset.fn(cfg, prepared, tmp_path / "w").version
    (prepared / "train.bin").write_bytes(b"other")
    assert publish_dataset.fn(cfg, prepared, tmp_path / "w").version != v1


def test_damaged_archive_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    pub = publish_dataset.fn(cfg, _prepared(tmp_path), tmp_path / "work")
    archive = tmp_path / "store" / pub.archive_key
    data = bytearray(archive.read_bytes())
    data[len(data) // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match"):
        download_dataset.fn(cfg, pub.to_dict())
    assert not (tmp_path / "cache" / pub.name / pub.version).exists()


def test_local_store_refuses_keys_outside_root(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "s")
    with pytest.raises(ValueError, match="escapes"):
        store.exists("../../etc/passwd")


def test_s3_round_trip_against_moto_server(tmp_path: Path, moto_server: str) -> None:
    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="moe-test"
    )
    cfg = _cfg(tmp_path, backend="s3", bucket="moe-test", endpoint_url=moto_server, prefix="runs/a")
    _round_trip(cfg, tmp_path)
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=moto_server).list_objects_v2(Bucket="moe-test")[
            "Contents"
        ]
    ]
    assert any(
        k.startswith("runs/a/datasets/stdlib-code/") and k.endswith("manifest.json") for k in keys
    )
