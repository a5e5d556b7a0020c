"""The storage layer against a real S3-compatible server (moto) behind a fault-injecting proxy."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from helpers import FAST_RETRY, batch_ids, write_dataset

import shardloader as sl
from shardloader.errors import ChecksumError, ObjectNotFoundError, StorageError
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store

pytestmark = pytest.mark.subprocess  # the moto S3 server process

POLICY = FAST_RETRY
SIZE = 300_000


def put(s3_client: Any, bucket: str, key: str, data: bytes) -> str:
    s3_client.put_object(Bucket=bucket, Key=key, Body=data)
    return f"s3://{bucket}/{key}"


@pytest.fixture
def blob() -> bytes:
    return os.urandom(SIZE)


@pytest.fixture
def via_proxy(fault_proxy: FaultProxy) -> dict[str, str]:
    return {"endpoint_url": fault_proxy.endpoint}


FAULTS = ["503", "500", "429", "reset", "reset_mid", "close_mid", "stall", "stall_mid"]


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_reads_survive_intermittent_faults_byte_identical(
    fault: str,
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    blob: bytes,
    tmp_path: Path,
) -> None:
    url = put(s3_client, s3_bucket, "ds/shard-00000.tar.zst", blob)
    times = 1 if fault.startswith("stall") else 2  # a stall costs a read timeout

    fault_proxy.inject(fault, method="GET", times=times)
    assert Store(url, via_proxy, POLICY).read_bytes() == blob

    fault_proxy.inject(fault, method="GET", times=times)
    with Store(url, via_proxy, POLICY).open_read() as f:
        parts = []
        while chunk := f.read(70_000):
            parts.append(chunk)
    assert b"".join(parts) == blob

    assert sum(r.fault is not None for r in fault_proxy.requests) == 2 * times


def test_lower_stack_makes_one_attempt_per_request(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, via_proxy: dict[str, str]
) -> None:
    """s3fs and botocore left alone retry 5 x 5 times; through filesystem() they try once."""
    url = put(s3_client, s3_bucket, "k", b"x" * 1000)
    fs, path = Store(url, via_proxy, POLICY).filesystem()
    fault_proxy.inject("500", method="GET", times=None)
    with pytest.raises(OSError):
        fs.cat_file(path)
    assert fault_proxy.count("GET") == 1


def test_persistent_fault_ends_in_one_storage_error_within_budget(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    url = put(s3_client, s3_bucket, "ds/shard-00001.tar.zst", b"y" * 5000)
    fault_proxy.inject("503", method="GET", times=None)
    start = time.monotonic()
    with pytest.raises(StorageError) as info:
        Store(url, via_proxy, POLICY).read_bytes()
    elapsed = time.monotonic() - start
    assert elapsed < 10.0  # 5 attempts, backoff <= 0.05 s each (plus s3fs's 0.1 s pause)
    assert fault_proxy.count("GET") == POLICY.max_attempts
    msg = str(info.value)
    assert url in msg and f"{POLICY.max_attempts} attempts" in msg and "SlowDown" in msg
    assert not isinstance(info.value, ChecksumError)


@pytest.mark.slow
def test_stalled_server_is_bounded_by_timeouts_and_budget(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, via_proxy: dict[str, str]
) -> None:
    url = put(s3_client, s3_bucket, "k", b"z" * 1000)
    policy = RetryPolicy(
        max_attempts=3, initial_backoff=0.01, max_backoff=0.01, read_timeout=0.3, connect_timeout=1
    )
    fault_proxy.inject("stall", method="GET", times=None)
    start = time.monotonic()
    with pytest.raises(StorageError, match="3 attempts") as info:
        Store(url, via_proxy, policy).read_bytes()
    assert time.monotonic() - start < 5.0
    assert "Timeout" in str(info.value)


@pytest.mark.parametrize("fault", ["403"])
def test_forbidden_fails_at_once_with_remedy(
    fault: str,
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    url = put(s3_client, s3_bucket, "k", b"z" * 1000)
    fault_proxy.inject(fault, method="GET", times=None)
    with pytest.raises(StorageError, match="access denied.*credentials.*bucket policy") as info:
        Store(url, via_proxy, POLICY).read_bytes()
    assert url in str(info.value)
    assert fault_proxy.count("GET") == 1


def test_missing_object_and_bucket_fail_at_once(
    s3_bucket: str, fault_proxy: FaultProxy, via_proxy: dict[str, str], tmp_path: Path
) -> None:
    missing = f"s3://{s3_bucket}/ds/index.json"
    for call in (
        lambda: Store(missing, via_proxy, POLICY).read_bytes(),
        lambda: Store(missing, via_proxy, POLICY).open_read(),
    ):
        fault_proxy.clear()
        with pytest.raises(ObjectNotFoundError, match="does not exist") as info:
            call()
        assert missing in str(info.value)
        assert isinstance(info.value, FileNotFoundError)
        assert fault_proxy.count("GET") <= 1  # HEAD 404, then one listing to tell a prefix
        assert len(fault_proxy.requests) <= 2
    no_bucket = "s3://no-such-bucket-here/ds/index.json"
    with pytest.raises(ObjectNotFoundError, match="bucket 'no-such-bucket-here' does not exist"):
        Store(no_bucket, via_proxy, POLICY).read_bytes()
    assert Store(missing, via_proxy, POLICY).exists() is False


def test_many_objects_under_random_faults_each_arrive_exactly_once(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    """An epoch's worth of shard and index reads with ~15% of requests failing."""
    objects = {f"ds/shard-{i:05d}.tar.zst": os.urandom(20_000 + 997 * i) for i in range(24)}
    for key, data in objects.items():
        put(s3_client, s3_bucket, key, data)
    for seed, fault in enumerate(["503", "500", "reset", "reset_mid", "close_mid"]):
        fault_proxy.inject(fault, times=None, probability=0.03, seed=seed)
    policy = RetryPolicy(max_attempts=10, initial_backoff=0.005, max_backoff=0.02, read_timeout=1.0)
    base = f"s3://{s3_bucket}/ds"
    listed = Store(base, via_proxy, policy).list_files()
    assert listed == sorted(k[len("ds/") :] for k in objects)
    seen: dict[str, bytes] = {}
    for name in listed:
        url = f"{base}/{name}"
        data = objects[f"ds/{name}"]
        assert name not in seen
        seen[name] = Store(url, via_proxy, policy).read_bytes(limit=len(data))
    assert seen == {k[len("ds/") :]: v for k, v in objects.items()}
    assert any(r.fault for r in fault_proxy.requests)


@pytest.mark.slow
def test_write_exists_list_remove_through_faults(
    s3_bucket: str, fault_proxy: FaultProxy, via_proxy: dict[str, str]
) -> None:
    base = f"s3://{s3_bucket}/out"
    fault_proxy.inject("503", times=None, every=3)
    Store(f"{base}/a.bin", via_proxy, POLICY).write_bytes_atomic(b"a" * 100)
    Store(f"{base}/sub/b.bin", via_proxy, POLICY).write_bytes_atomic(b"b" * 100)
    assert Store(f"{base}/a.bin", via_proxy, POLICY).exists()
    assert Store(base, via_proxy, POLICY).exists()  # a non-empty prefix
    assert Store(base, via_proxy, POLICY).list_files() == ["a.bin", "sub/b.bin"]
    Store(f"{base}/a.bin", via_proxy, POLICY).remove()
    Store(f"{base}/never-was.bin", via_proxy, POLICY).remove()
    assert not Store(f"{base}/a.bin", via_proxy, POLICY).exists()
    assert Store(base, via_proxy, POLICY).list_files() == ["sub/b.bin"]
    assert any(r.fault for r in fault_proxy.requests)


def test_endpoint_from_env_and_explicit_options_win(
    s3_server: str,
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = put(s3_client, s3_bucket, "k", b"env")
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    assert Store(url, {}, POLICY).read_bytes() == b"env"  # botocore reads the variable
    assert fault_proxy.count("GET") == 1
    fault_proxy.clear()
    assert Store(url, {"endpoint_url": s3_server}, POLICY).read_bytes() == b"env"
    assert fault_proxy.requests == []


@pytest.mark.slow
def test_failed_multipart_upload_leaves_nothing_behind(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """A part that keeps failing: no object, no manifest, no incomplete multipart upload."""
    options = {"endpoint_url": fault_proxy.endpoint, "default_block_size": 5 * 2**20}
    local = tmp_path / "shard-00000.tar.zst"
    local.write_bytes(os.urandom(11 * 2**20))  # 3 parts of 5 MiB
    url = f"s3://{s3_bucket}/ds/shard-00000.tar.zst"
    policy = RetryPolicy(max_attempts=2, initial_backoff=0.01, max_backoff=0.01)

    fault_proxy.inject("500", method="PUT", path="partNumber=2", times=None)
    fault_proxy.inject("500", method="DELETE", path="uploadId=", times=1)  # s3fs's own abort fails
    with pytest.raises(StorageError, match="2 attempts"):
        Store(url, options, policy).put_file(str(local))
    assert fault_proxy.count("POST", "uploads") == 2  # one multipart upload per attempt
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert not Store(url, options, policy).exists()

    fault_proxy.clear()  # and once the store recovers, the same call uploads it whole
    Store(url, options, policy).put_file(str(local))
    assert fault_proxy.count("PUT", "partNumber=") == 3
    body = s3_client.get_object(Bucket=s3_bucket, Key="ds/shard-00000.tar.zst")["Body"].read()
    assert hashlib.sha256(body).digest() == hashlib.sha256(local.read_bytes()).digest()


def _read_to(url: str, options: dict[str, str], dst: str) -> None:
    with open(dst, "wb") as f:
        f.write(Store(url, options, POLICY).read_bytes())


def test_read_in_a_forked_worker_process(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    blob: bytes,
    tmp_path: Path,
) -> None:
    """What a DataLoader worker does: plain arguments in, a filesystem of its own."""
    url = put(s3_client, s3_bucket, "ds/shard-00003.tar.zst", blob)
    assert Store(url, via_proxy, POLICY).read_bytes() == blob  # parent's fs exists
    fault_proxy.inject("reset_mid", method="GET", times=1)
    dst = tmp_path / "shard-00003.tar.zst"
    proc = multiprocessing.get_context("fork").Process(
        target=_read_to, args=(url, via_proxy, str(dst))
    )
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert dst.read_bytes() == blob


@pytest.mark.slow
def test_epoch_from_s3_under_intermittent_faults_yields_every_sample_once(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The whole read path: manifest, sidecars and shards from S3 through two DataLoader
    workers, while ~20% of requests fail (5xx, resets, bodies cut short)."""
    local = tmp_path / "ds"
    write_dataset(str(local), [30, 17, 25, 40, 8, 12, 9, 21, 14, 6], compression="zstd")
    for name in sorted(os.listdir(local)):
        s3_client.upload_file(str(local / name), s3_bucket, f"ds/{name}")
    # One GET per shard (each carries its sample index) and one for the manifest: 11 requests
    # before retries, about a fifth of them faulty.
    for seed, fault in enumerate(["503", "500", "reset", "reset_mid", "close_mid"]):
        fault_proxy.inject(fault, times=None, probability=0.05, seed=seed)
    read = sl.ReadOptions(
        storage_options={"endpoint_url": fault_proxy.endpoint},
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
    )
    ds = sl.ShardedDataset(f"s3://{s3_bucket}/ds", batch_size=8, shuffle=True, seed=3, read=read)
    ids = []
    for batch in sl.make_loader(ds, num_workers=2):
        pads = batch["__pad__"].tolist()
        ids += [i for i, pad in zip(batch_ids(batch), pads, strict=True) if not pad]
    assert sorted(ids) == list(range(182))
    assert any(r.fault for r in fault_proxy.requests)


def test_listing_through_the_fast_client_matches_s3fs(s3_bucket: str, s3_client: Any) -> None:
    """Store.list_files on S3 goes through botocore (no s3fs import): the same paths as
    s3fs's ``find`` (a folder marker too), sibling prefixes left out."""
    import s3fs

    for key in ("ds/a.bin", "ds/sub/b.bin", "ds/sub/", "ds2/c.bin", "ds.bin"):
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"x")
    options = {"endpoint_url": s3_client.meta.endpoint_url}
    store = Store(f"s3://{s3_bucket}/ds", options, POLICY)
    fs = s3fs.S3FileSystem(endpoint_url=options["endpoint_url"], skip_instance_cache=True)
    via_s3fs = sorted(p[len(f"{s3_bucket}/ds/") :] for p in fs.find(f"{s3_bucket}/ds"))
    assert store.list_files() == via_s3fs == ["a.bin", "sub/", "sub/b.bin"]
    assert Store(f"s3://{s3_bucket}/nothing-here", options, POLICY).list_files() == []


def test_upload_carries_the_known_sha256(s3_bucket: str, s3_client: Any, tmp_path: Path) -> None:
    """A PUT given the file's sha256 sends it as the object's checksum: S3 stores it (and
    refuses a body that does not match; moto stores without checking)."""
    import base64

    local = tmp_path / "shard-00000.tar.zst"
    local.write_bytes(os.urandom(100_000))
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    options = {"endpoint_url": s3_client.meta.endpoint_url}
    Store(f"s3://{s3_bucket}/ds/shard-00000.tar.zst", options, POLICY).put_file(str(local), digest)
    head = s3_client.head_object(
        Bucket=s3_bucket, Key="ds/shard-00000.tar.zst", ChecksumMode="ENABLED"
    )
    assert base64.b64decode(head["ChecksumSHA256"]).hex() == digest
    Store(f"s3://{s3_bucket}/ds/plain", options, POLICY).put_file(str(local))  # no sha256: CRC32
    head = s3_client.head_object(Bucket=s3_bucket, Key="ds/plain", ChecksumMode="ENABLED")
    assert "ChecksumSHA256" not in head
