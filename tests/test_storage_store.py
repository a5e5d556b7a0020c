"""The Store handle: URL + options + retry policy, picklable, and per-protocol defaults (a
protocol without any gets the generic error classification and says so once)."""

from __future__ import annotations

import dataclasses
import logging
import pickle
from typing import Any

import fsspec
import pytest
from fault_proxy import FaultProxy
from fsspec.implementations.memory import MemoryFileSystem
from helpers import write_dataset

import shardloader as sl
from shardloader.errors import ManifestError, StorageError, UsageError
from shardloader.read.verify import verify_dataset
from shardloader.storage import ProtocolDefaults, Store, protocols, register_protocol
from shardloader.storage.retry import RetryPolicy

FAST = RetryPolicy(
    max_attempts=4,
    initial_backoff=0.001,
    max_backoff=0.01,
    max_total_seconds=10.0,
    connect_timeout=1.0,
    read_timeout=1.0,
)


def test_a_store_is_small_frozen_and_pickles_without_its_filesystem():
    store = Store(
        "s3://bucket/ds", {"endpoint_url": "http://127.0.0.1:9", "secret": "hunter2"}, FAST
    )
    fs, path = store.filesystem()  # made in this process, never held by the store
    assert path == "bucket/ds" and getattr(fs, "retries", 1) == 1  # s3fs's own loop is off
    data = pickle.dumps(store)
    assert len(data) < 1024 and b"S3FileSystem" not in data
    assert pickle.loads(data) == store
    assert "hunter2" not in repr(store) and "secret" in repr(store)
    shard = store.join("shard-00000.tar")
    assert (shard.url, shard.options, shard.retry) == (
        "s3://bucket/ds/shard-00000.tar",
        store.options,
        FAST,
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        store.url = "elsewhere"  # type: ignore[misc]
    read = sl.ReadOptions(storage_options={"anon": True}, retry=FAST)
    assert read.store("s3://b/x") == Store("s3://b/x", {"anon": True}, FAST)


def test_local_store_round_trip(tmp_path):
    store = Store(str(tmp_path / "out"))
    store.join("a/b.bin").write_bytes_atomic(b"hello")
    assert store.list_files() == ["a/b.bin"]
    assert store.join("a/b.bin").read_bytes() == b"hello"
    assert store.join("a/b.bin").read_bytes(limit=5) == b"hello"
    store.join("a/b.bin").remove()
    assert not store.join("a/b.bin").exists()


def test_read_manifest_takes_a_store_or_a_url_with_options(tmp_path):
    write_dataset(str(tmp_path), [3])
    by_store, base = sl.read_manifest(Store(str(tmp_path), {}, FAST))
    by_url, _ = sl.read_manifest(str(tmp_path), {}, policy=FAST)
    assert by_store == by_url and base == str(tmp_path)
    with pytest.raises(UsageError, match="carries its options"):
        sl.read_manifest(Store(str(tmp_path)), {"anon": True})


# -- a protocol shardloader has no defaults for ---------------------------------------------------


class ServiceBusy(Exception):
    """What a made-up backend raises when overloaded: nothing generic code could recognise."""


class FlakyFileSystem(MemoryFileSystem):
    """fsspec's in-memory store under another protocol, failing the first reads as told."""

    protocol = "sltestflaky"
    store: dict[str, Any] = {}  # its own objects, apart from memory://
    pseudo_dirs = [""]
    failures: list[BaseException] = []
    calls = 0

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        prefix = f"{cls.protocol}://"
        return super()._strip_protocol(path[len(prefix) :] if path.startswith(prefix) else path)

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        FlakyFileSystem.calls += 1
        if FlakyFileSystem.failures:
            raise FlakyFileSystem.failures.pop(0)
        return super().cat_file(path, start, end, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation(FlakyFileSystem.protocol, FlakyFileSystem, clobber=True)
    monkeypatch.setattr(protocols, "_PROTOCOLS", dict(protocols._PROTOCOLS))
    monkeypatch.setattr(protocols, "_WARNED", set())
    FlakyFileSystem.calls = 0
    FlakyFileSystem.failures = []
    fsspec.filesystem(FlakyFileSystem.protocol).pipe_file("/bucket/x.bin", b"payload")
    return Store(f"{FlakyFileSystem.protocol}://bucket/x.bin", retry=FAST)


def test_unknown_protocol_gets_the_generic_classification_and_says_so_once(flaky, caplog):
    caplog.set_level(logging.WARNING, logger="shardloader.storage.protocols")
    FlakyFileSystem.failures = [ConnectionResetError(104, "reset"), TimeoutError()]
    assert flaky.read_bytes() == b"payload"  # generic transient errors: retried
    assert FlakyFileSystem.calls == 3
    FlakyFileSystem.failures = [ServiceBusy("try later")]
    with pytest.raises(ServiceBusy):  # unknown to generic rules: not retried, passed through
        flaky.read_bytes()
    warnings = [r for r in caplog.records if "has no shardloader defaults" in r.getMessage()]
    assert len(warnings) == 1 and "'sltestflaky'" in warnings[0].getMessage()


def test_a_registered_protocol_classifies_its_own_errors(flaky, caplog):
    caplog.set_level(logging.WARNING, logger="shardloader.storage.protocols")
    register_protocol(
        ProtocolDefaults(
            (FlakyFileSystem.protocol,),
            decide=lambda e: "throttled" if isinstance(e, ServiceBusy) else None,
            error_modules=(__name__.split(".")[0],),
        )
    )
    FlakyFileSystem.failures = [ServiceBusy("try later"), ServiceBusy("try later")]
    assert flaky.read_bytes() == b"payload"
    assert FlakyFileSystem.calls == 3
    FlakyFileSystem.failures = [ServiceBusy("still busy")] * 5
    with pytest.raises(StorageError, match="gave up after 4 attempts.*ServiceBusy"):
        flaky.read_bytes()
    assert not [r for r in caplog.records if "no shardloader defaults" in r.getMessage()]
    with pytest.raises(UsageError, match="has defaults already"):
        register_protocol(ProtocolDefaults((FlakyFileSystem.protocol,)))


# -- verify takes the same retry policy as reads ---------------------------------------------------


def test_verify_uses_the_retry_policy_it_is_given(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path
) -> None:
    local = tmp_path / "ds"
    write_dataset(str(local), [5, 4], compression="zstd")
    for path in sorted(local.iterdir()):
        s3_client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    url, so = f"s3://{s3_bucket}/ds", {"endpoint_url": fault_proxy.endpoint}
    fault_proxy.inject("503", method="GET", times=1)
    with pytest.raises(ManifestError, match="gave up after 1 attempt"):
        verify_dataset(url, so, images=False, retry=dataclasses.replace(FAST, max_attempts=1))
    fault_proxy.inject("503", method="GET", times=3)
    report = verify_dataset(url, so, images=False, retry=FAST)
    assert report.ok and report.samples == 9
    assert sum(r.fault is not None for r in fault_proxy.requests) == 4
