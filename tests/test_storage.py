"""Contract of tasks/storage.py and tasks/archive.py: publish writes a content-addressed zstd
archive + sha256 manifest; download verifies every hash and refuses damaged data; S3 is tested
against a real S3 API (moto's server mode on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from moe.errors import InputError
from tasks.archive import download_dataset, publish_dataset
from tasks.config import Config, StorageConfig
from tasks.storage import HfObjectStore, LocalObjectStore
from tests.conftest import ROOT, free_port, read_line


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


def test_local_round_trip(tmp_path: Path) -> None:
    _round_trip(_cfg(tmp_path), tmp_path)


def test_an_intact_cached_copy_is_reused_and_a_changed_one_fetched_again(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prepared = _prepared(tmp_path)
    pub = publish_dataset.fn(cfg, prepared, tmp_path / "work")
    got = download_dataset.fn(cfg, pub.to_dict())
    archive = tmp_path / "store" / pub.archive_key
    stored = archive.read_bytes()
    archive.unlink()  # the store cannot serve it: only the cached copy can answer
    assert download_dataset.fn(cfg, pub.to_dict()) == got
    archive.write_bytes(stored)
    # A cached file edited with its size kept, then one truncated: both are fetched anew.
    for damage in (lambda b: bytes([b[0] ^ 1]) + b[1:], lambda b: b[:-1]):
        target = got / "train.bin"
        target.write_bytes(damage(target.read_bytes()))
        archive.unlink()
        with pytest.raises(InputError, match="does not exist"):  # it had to go to the store
            download_dataset.fn(cfg, pub.to_dict())
        archive.write_bytes(stored)
        assert download_dataset.fn(cfg, pub.to_dict()) == got
        assert target.read_bytes() == (prepared / "train.bin").read_bytes()


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


def test_every_file_is_checked_against_its_own_sha256(tmp_path: Path) -> None:
    """An archive whose own sha256 is consistent (manifest and receipt agree) but which holds
    a file other than the one the manifest lists (content republished under the same
    version) is refused, naming the file, and nothing is left in the cache."""
    from moe.hashing import sha256_file
    from tasks.archive import pack

    cfg = _cfg(tmp_path)
    prepared = _prepared(tmp_path)
    pub = publish_dataset.fn(cfg, prepared, tmp_path / "work")
    (prepared / "sql" / "pairs.jsonl").write_text('{"q": 2}\n')
    store = tmp_path / "store"
    archive = store / pub.archive_key
    pack(prepared, archive, 3, 1)
    manifest = json.loads((store / pub.manifest_key).read_text())
    manifest["archive"].update(sha256=sha256_file(archive), bytes=archive.stat().st_size)
    (store / pub.manifest_key).write_text(json.dumps(manifest))
    receipt = {**pub.to_dict(), "archive_sha256": manifest["archive"]["sha256"]}
    with pytest.raises(ValueError, match="sql/pairs.jsonl in .* does not match its sha256"):
        download_dataset.fn(cfg, receipt)
    assert not (tmp_path / "cache" / pub.name / pub.version).exists()


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "a/../../b", ""])
def test_stores_refuse_keys_outside_their_root(tmp_path: Path, key: str) -> None:
    with pytest.raises(InputError, match="not a relative path"):
        LocalObjectStore(tmp_path / "s").exists(key)
    with pytest.raises(InputError, match="not a relative path"):
        HfObjectStore(
            _cfg(tmp_path, backend="hf", hf_repo="me/data").storage, api=FakeHfApi(tmp_path)
        ).exists(key)


def test_s3_corrupted_object_is_refused(tmp_path: Path, moto_server: str) -> None:
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    s3.create_bucket(Bucket="moe-corrupt")
    cfg = _cfg(tmp_path, backend="s3", bucket="moe-corrupt", endpoint_url=moto_server, prefix="")
    pub = publish_dataset.fn(cfg, _prepared(tmp_path), tmp_path / "work")
    body = bytearray(s3.get_object(Bucket="moe-corrupt", Key=pub.archive_key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket="moe-corrupt", Key=pub.archive_key, Body=bytes(body))
    with pytest.raises(ValueError, match="does not match the manifest"):
        download_dataset.fn(cfg, pub.to_dict())
    assert not (tmp_path / "cache" / pub.name / pub.version).exists()


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


class FakeHfApi:
    """Stands in for huggingface_hub.HfApi: the Hub cannot be reached from this machine, so the
    hf backend is tested at the huggingface_hub call boundary (same method names and arguments),
    with files kept in a local folder per (repo, revision)."""

    def __init__(self, root: Path) -> None:
        self.root, self.calls, self.tags = root / "fake-hub", [], []

    def _path(self, repo_id: str, filename: str, revision: str | None) -> Path:
        return self.root / repo_id / (revision or "main") / filename

    def create_repo(self, repo_id: str, *, repo_type: str, exist_ok: bool, private: bool) -> None:
        assert repo_type in ("dataset", "model") and exist_ok
        self.calls.append(("create_repo", repo_id, repo_type))

    def upload_file(
        self,
        *,
        path_or_fileobj: str,
        path_in_repo: str,
        repo_id: str,
        repo_type: str,
        revision: str | None,
        commit_message: str,
    ) -> None:
        assert repo_type in ("dataset", "model")
        dest = self._path(repo_id, path_in_repo, revision)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(Path(path_or_fileobj).read_bytes())
        self.calls.append(("upload_file", path_in_repo))

    def hf_hub_download(
        self, repo_id: str, filename: str, *, repo_type: str, revision: str | None
    ) -> str:
        path = self._path(repo_id, filename, revision)
        if not path.is_file():
            raise FileNotFoundError(filename)
        return str(path)

    def file_exists(
        self, repo_id: str, filename: str, *, repo_type: str, revision: str | None
    ) -> bool:
        return self._path(repo_id, filename, revision).is_file()

    def create_tag(
        self, repo_id: str, *, tag: str, repo_type: str, revision: str | None, exist_ok: bool
    ) -> None:
        self.tags.append(tag)


def test_hf_backend_round_trip_at_the_call_boundary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = FakeHfApi(tmp_path)
    monkeypatch.setattr("huggingface_hub.HfApi", lambda: api)
    cfg = _cfg(tmp_path, backend="hf", hf_repo="me/moe-data", prefix="")
    _round_trip(cfg, tmp_path)
    uploaded = [c[1] for c in api.calls if c[0] == "upload_file"]
    assert uploaded[-1].endswith("manifest.json")  # the manifest goes last
    assert len(api.tags) == 1 and api.tags[0].startswith("stdlib-code-")


OUTAGE_SCRIPT = """
import json, logging, sys, time
from pathlib import Path
from tasks.config import Config, StorageConfig
from tasks.archive import publish_dataset, download_dataset
work, endpoint = Path(sys.argv[1]), sys.argv[2]
cfg = Config(storage=StorageConfig(backend="s3", bucket="outage", endpoint_url=endpoint, cache_dir=str(work / "cache")))


class HoldTheRetry(logging.Handler):
    # The test's hand on the clock: Prefect announces the k-th retry before it waits out the
    # back-off; the announcement is held here until the test has brought S3 back (file
    # up-k), so the retried attempt meets S3 up on any machine, however slow its start.
    announced = 0

    def emit(self, record):
        if " - Retry " in record.getMessage():
            HoldTheRetry.announced += 1
            (work / f"retry-{HoldTheRetry.announced}").write_text(record.getMessage())
            while not (work / f"up-{HoldTheRetry.announced}").exists():
                time.sleep(0.05)


logging.getLogger("prefect.task_runs").addHandler(HoldTheRetry())
# the shipped tasks, with their own retry policy (tasks.storage.RETRIES)
pub = publish_dataset(cfg, work / "prepared", work / "w")
(work / "published").write_text(json.dumps(pub.to_dict()))
while not (work / "download").exists():  # the test takes S3 down again first
    time.sleep(0.1)
got = download_dataset(cfg, pub.to_dict())
print(json.dumps({"version": pub.version, "verified": json.loads((got / ".verified").read_text())["archive_sha256"] == pub.archive_sha256}))
"""


SWITCHABLE_MOTO = """
import sys
from moto.server import ThreadedMotoServer
port, server = int(sys.argv[1]), None
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "up":
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        server.start()
    elif line.strip() == "down":
        server.stop()
    print(line.strip(), flush=True)
"""


def _first_backoff_bounds() -> tuple[float, float]:
    """The range the shipped policy (tasks.storage.RETRIES) draws the first retry's delay
    from: its first delay, less and more Prefect's jitter clamps."""
    from prefect.utilities.math import lower_clamp_multiple

    from tasks.storage import RETRIES

    first = RETRIES["retry_delay_seconds"](RETRIES["retries"])[0]
    upper = 1 + RETRIES["retry_jitter_factor"]
    return first * max(0.0, lower_clamp_multiple(upper)), first * upper


def test_s3_outage_is_ridden_out_by_task_retries(
    tmp_path: Path, prefect_server: dict[str, str]
) -> None:
    """The shipped retry policy (3 retries, exponential back-off from 2 s) rides out an S3
    server that is down when an upload starts, and again when a download starts. The server
    is moto in a process of its own; its objects survive the outage, as S3's do. No race
    with the back-off: the job holds each retry Prefect announces until the test has brought
    S3 back (OUTAGE_SCRIPT's HoldTheRetry), so each outage costs exactly one attempt."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    _prepared(tmp_path)
    moto = subprocess.Popen(
        [sys.executable, "-c", SWITCHABLE_MOTO, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def switch(state: str) -> None:
        moto.stdin.write(state + "\n")
        moto.stdin.flush()
        while read_line(moto, timeout=60) != state:  # moto says a word of its own first
            pass

    env = {**os.environ, **prefect_server, "PYTHONPATH": str(ROOT), "AWS_MAX_ATTEMPTS": "1"}
    out_f, err_f = tmp_path / "job.out", tmp_path / "job.err"
    try:
        assert read_line(moto, timeout=120) == "ready"
        with open(out_f, "w") as o, open(err_f, "w") as e:
            job = subprocess.Popen(
                [sys.executable, "-c", OUTAGE_SCRIPT, str(tmp_path), endpoint],
                env=env,
                stdout=o,
                stderr=e,
                text=True,
            )

        def wait_for(path: Path) -> None:
            deadline = time.monotonic() + 180  # a bound on the wait, not the verdict
            while not path.exists():
                assert job.poll() is None, err_f.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {path.name}: " + err_f.read_text()[-3000:]
                time.sleep(0.1)

        wait_for(tmp_path / "retry-1")  # S3 is down when the upload starts: an attempt failed
        switch("up")  # ... and comes back
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="outage"
        )
        (tmp_path / "up-1").touch()
        wait_for(tmp_path / "published")
        switch("down")  # down again when the download starts ...
        (tmp_path / "download").write_text("go")
        wait_for(tmp_path / "retry-2")
        switch("up")  # ... and back, with its objects
        (tmp_path / "up-2").touch()
        job.wait(timeout=180)
    finally:
        moto.kill()
        moto.wait(timeout=10)
    out, err = out_f.read_text(), err_f.read_text()
    assert job.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["verified"]
    log = out + err
    assert "Retries are exhausted" not in log
    # each task failed once on the closed port, and its first retry went through
    for n, name in enumerate(("publish-dataset", "download-dataset"), 1):
        announced = (tmp_path / f"retry-{n}").read_text()
        assert "EndpointConnectionError" in announced, announced
        # ... after the policy's first back-off (the delay Prefect drew, not a time measured)
        delay = re.search(r"Retry 1/3 will start ([0-9.]+) second\(s\) from now", announced)
        low, high = _first_backoff_bounds()
        assert 0 < low and delay and low <= float(delay[1]) <= high, (announced, low, high)
        assert f"Task run '{name}" in log, log[-3000:]
    assert log.count(" - Retry ") == 2 and not (tmp_path / "retry-3").exists(), log[-3000:]


def test_s3_multipart_above_the_part_size(tmp_path: Path, moto_server: str) -> None:
    """A file above storage.multipart_mib goes up in parts (the ETag of a multipart object
    ends in -<parts>) and comes back byte for byte; a small one goes up whole."""
    from tasks.storage import open_store

    boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1").create_bucket(
        Bucket="parts"
    )
    cfg = _cfg(tmp_path, backend="s3", bucket="parts", endpoint_url=moto_server, multipart_mib=5)
    store = open_store(cfg.storage)
    big, small = tmp_path / "big.bin", tmp_path / "small.bin"
    big.write_bytes(os.urandom(12 << 20))  # 12 MiB: parts of 5, 5 and 2
    small.write_bytes(os.urandom(1 << 20))
    store.put(big, "x/big.bin")
    store.put(small, "x/small.bin")
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    assert (
        s3.head_object(Bucket="parts", Key="moe-pipeline/x/big.bin")["ETag"]
        .strip('"')
        .endswith("-3")
    )
    assert "-" not in s3.head_object(Bucket="parts", Key="moe-pipeline/x/small.bin")["ETag"]
    store.get("x/big.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()


def test_a_file_replaced_while_it_is_pushed_goes_up_as_it_was_hashed(tmp_path: Path) -> None:
    """The checkpoint mirror pushes the attempt journal while training rewrites it (with
    os.replace): a push that hashed one content and sent the next left an object whose
    content did not match its name, and new machines could not resume from the mirror (seen
    under load in tests/test_multinode.py). Here the journal is replaced exactly between the
    hash and the upload, every time; what comes back is the content that was hashed."""
    from tasks.storage import pull_files, push_files

    src = tmp_path / "ckpt"
    src.mkdir()
    journal = src / "attempts.json"
    journal.write_text('{"last_step": 4}')

    class RewrittenOnUpload(LocalObjectStore):
        def put(self, local: Path, key: str, storage_class: str = "") -> None:
            tmp = journal.with_name("attempts.json.tmp")
            tmp.write_text('{"last_step": 5}')
            os.replace(tmp, journal)  # the trainer moved on
            super().put(local, key, storage_class)

    store = RewrittenOnUpload(tmp_path / "store")
    for addressed in (True, False):
        prefix = f"mirror-{addressed}"
        journal.write_text('{"last_step": 4}')
        push_files(store, prefix, {"attempts.json": journal}, addressed=addressed)
        out = tmp_path / f"restored-{addressed}"
        assert pull_files(store, prefix, out, "") == 1  # verified against its digest
        assert json.loads((out / "attempts.json").read_text()) == {"last_step": 4}
    assert not list(src.glob(".*"))  # no snapshot left behind
