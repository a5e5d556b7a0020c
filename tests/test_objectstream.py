"""One pass over an object while it arrives (storage/objectstream.py), through the fast clients:
S3 (moto behind the fault proxy) in concurrent byte ranges, and a plain HTTP server that knows
nothing of ranges."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from helpers import FAST_RETRY
from http_server import QuietFiles, serving, static_files

from shardloader.errors import ChecksumError, StorageError
from shardloader.storage.store import Store

pytestmark = pytest.mark.subprocess  # the moto S3 server process

POLICY = FAST_RETRY
# For tests that count requests without injecting faults: a loaded machine can keep moto and
# the proxy (which buffers each response whole) silent past POLICY's 0.5 s read timeout, and
# the retry that follows is one more GET than the test expects.  Nothing here stalls on
# purpose, so a patient read timeout takes load out of the count and nothing else.
PATIENT = dataclasses.replace(POLICY, read_timeout=30.0)
MiB = 1 << 20


def read_all(f: Any, n: int = 100_000) -> bytes:
    parts = []
    while chunk := f.read(n):
        parts.append(chunk)
    return b"".join(parts)


@pytest.fixture
def big(s3_bucket: str, s3_client: Any) -> tuple[str, bytes]:
    data = os.urandom(3 * MiB + 12_345)  # four ranges of 1 MiB, the last one short
    s3_client.put_object(Bucket=s3_bucket, Key="ds/big.tar.zst", Body=data)
    return f"s3://{s3_bucket}/ds/big.tar.zst", data


@pytest.mark.parametrize("fault", ["503", "reset", "reset_mid", "close_mid", "stall_mid"])
def test_ranges_arrive_in_order_exactly_once_through_faults(
    fault: str, big: tuple[str, bytes], fault_proxy: FaultProxy
) -> None:
    url, data = big
    store = Store(url, {"endpoint_url": fault_proxy.endpoint}, POLICY)
    fault_proxy.inject(fault, method="GET", every=2, times=2)  # hits two of the parts
    with store.open_stream(len(data), part_size=MiB, parts_in_flight=2) as f:
        assert read_all(f) == data
    gets = fault_proxy.count("GET")
    assert gets == 4 + 2  # one GET per range, and one more for each fault
    assert sum(r.fault is not None for r in fault_proxy.requests) == 2


def test_one_get_up_to_part_size_and_no_head(
    big: tuple[str, bytes], fault_proxy: FaultProxy
) -> None:
    url, data = big
    store = Store(url, {"endpoint_url": fault_proxy.endpoint}, PATIENT)
    with store.open_stream(len(data)) as f:  # default part size: 64 MiB
        assert hashlib.sha256(read_all(f)).digest() == hashlib.sha256(data).digest()
    assert store.read_bytes() == data
    assert [r.method for r in fault_proxy.requests] == ["GET", "GET"]


def test_an_object_of_another_size_is_refused_before_its_body(
    big: tuple[str, bytes], fault_proxy: FaultProxy
) -> None:
    url, data = big
    store = Store(url, {"endpoint_url": fault_proxy.endpoint}, PATIENT)
    for size in (len(data) - 1, len(data) + 1):
        with store.open_stream(size, part_size=MiB) as f, pytest.raises(ChecksumError) as info:
            f.read(10)
        assert f"{len(data):,} bytes" in str(info.value) and url in str(info.value)
    with pytest.raises(ChecksumError, match="larger than"):
        store.read_bytes(limit=len(data) - 1)
    assert fault_proxy.count("GET") == 3  # refused once each: not retried


def test_a_stream_closed_early_stops_its_fetches(
    big: tuple[str, bytes], fault_proxy: FaultProxy
) -> None:
    url, data = big
    store = Store(url, {"endpoint_url": fault_proxy.endpoint}, PATIENT)
    with store.open_stream(len(data), part_size=MiB, parts_in_flight=1) as f:
        assert f.read(1000) == data[:1000]
    with pytest.raises(ValueError, match="closed"):
        f.read(1)
    assert fault_proxy.count("GET") <= 2  # the part being read, perhaps the next: no more


def test_options_only_s3fs_knows_fall_back_to_s3fs(
    big: tuple[str, bytes], fault_proxy: FaultProxy
) -> None:
    url, data = big
    store = Store(url, {"endpoint_url": fault_proxy.endpoint, "version_aware": False}, POLICY)
    assert store.client() is None
    with store.open_stream(len(data)) as f:
        assert read_all(f) == data
    assert Store(url, {"endpoint_url": fault_proxy.endpoint}, POLICY).client() is not None


# -- a plain HTTP server: no ranges, bodies cut short on request ----------------------------------


class _Plain(QuietFiles):
    """Static files without Range support (like ``python -m http.server``); ``/cut/...`` sends
    half of the body on its first GET, then closes the connection."""

    counts: dict[str, int]
    lock: threading.Lock

    def do_GET(self) -> None:
        with self.lock:
            self.counts[self.path] = self.counts.get(self.path, 0) + 1
            n = self.counts[self.path]
        if self.path.startswith("/cut/") and n == 1:
            path = self.translate_path(self.path.replace("/cut/", "/", 1))
            with open(path, "rb") as f:
                body = f.read()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
            return
        self.path = self.path.replace("/cut/", "/", 1)
        super().do_GET()


@pytest.fixture
def plain_http(tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, int]]]:
    root = tmp_path / "www"
    root.mkdir()
    counts: dict[str, int] = {}
    handler = type("Handler", (_Plain,), {"counts": counts, "lock": threading.Lock()})
    with serving(static_files(root, handler)) as url:
        yield url, root, counts


def test_http_server_without_ranges_sends_the_object_in_one_response(
    plain_http: tuple[str, Path, dict[str, int]],
) -> None:
    base, root, counts = plain_http
    data = os.urandom(3 * MiB + 7)
    (root / "s.tar.zst").write_bytes(data)
    store = Store(f"{base}/s.tar.zst", {}, POLICY)
    assert store.client() is not None  # plain GETs: the fast client
    with store.open_stream(len(data), part_size=MiB) as f:
        assert read_all(f) == data
    assert counts == {"/s.tar.zst": 1}  # asked for a range, got the whole object: no more GETs


def test_http_body_cut_short_resumes_without_ranges(
    plain_http: tuple[str, Path, dict[str, int]],
) -> None:
    base, root, counts = plain_http
    data = os.urandom(2 * MiB + 3)
    (root / "s.tar.zst").write_bytes(data)
    store = Store(f"{base}/cut/s.tar.zst", {}, POLICY)
    with store.open_stream(len(data)) as f:
        assert read_all(f, 65_536) == data  # the second GET skips what was delivered
    assert counts == {"/cut/s.tar.zst": 2}


def test_http_persistent_error_is_one_storage_error(
    plain_http: tuple[str, Path, dict[str, int]],
) -> None:
    base, _, counts = plain_http
    with pytest.raises(StorageError, match="does not exist") as info:
        Store(f"{base}/missing.tar.zst", {}, POLICY).read_bytes()
    assert isinstance(info.value, FileNotFoundError)
    assert counts == {"/missing.tar.zst": 1}  # a 404 is not retried
