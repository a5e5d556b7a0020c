"""``RetryPolicy.max_total_seconds`` is a deadline that covers a body being read: a server that
drips bytes, never idle long enough for the read timeout, is cut off there, over HTTP (a real
server on 127.0.0.1) and S3 (moto behind the fault proxy); a reader that is slow itself is not."""

from __future__ import annotations

import faulthandler
import gc
import http.server
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_proxy import FaultProxy
from helpers import in_thread
from http_server import serving

from shardloader.errors import StorageError
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store

# read_timeout 1 s: a byte every 0.2 s never trips it; the deadline must.
POLICY = RetryPolicy(
    max_attempts=3,
    initial_backoff=0.01,
    max_backoff=0.02,
    max_total_seconds=1.5,
    connect_timeout=2.0,
    read_timeout=1.0,
)
MiB = 1 << 20


def finishes_within(seconds: float, fn: Callable[[], Any]) -> tuple[float, BaseException | None]:
    """Run ``fn`` in a thread; (seconds taken, what it raised); fails if it is still running
    after ``seconds`` (the thread is a daemon: a server stopping ends it)."""
    gc.collect()  # earlier tests' garbage: its finalizers (a dropped DataLoader's) run here
    began = time.monotonic()
    thread, out = in_thread(fn)
    thread.join(seconds)
    if thread.is_alive():  # show where it is stuck (the watchdog's thread among them)
        faulthandler.dump_traceback(all_threads=True)
    assert not thread.is_alive(), f"still reading after {seconds} s (thread stacks on stderr)"
    return time.monotonic() - began, out[0]


class _Drip(http.server.BaseHTTPRequestHandler):
    """A 10,000-byte body (or, at ``/chunked``, an endless chunked one), a byte every 0.2 s."""

    stop: threading.Event
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def do_GET(self) -> None:
        self.send_response(200)
        chunked = self.path == "/chunked"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", "10000")
        self.end_headers()
        try:
            while not self.stop.wait(0.2):
                self.wfile.write(b"1\r\nx\r\n" if chunked else b"x")
                self.wfile.flush()
        except OSError:
            return


@pytest.fixture
def drip() -> Iterator[str]:
    stop = threading.Event()
    with serving(type("H", (_Drip,), {"stop": stop})) as url:
        try:
            yield url
        finally:
            stop.set()  # the handlers stop dripping before the server shuts down


@pytest.mark.slow  # the deadline itself: 1.5 s
@pytest.mark.parametrize("path", ["/shard.tar", "/chunked"])
def test_a_dripping_http_body_fails_at_the_deadline(drip: str, path: str) -> None:
    store = Store(drip + path, {}, POLICY)
    took, err = finishes_within(8.0, lambda: store.read_bytes(limit=1 << 20))
    assert isinstance(err, StorageError), err
    assert "max_total_seconds (1.5 s) ran out" in str(err) and path in str(err)
    assert 1.4 < took < 4.0  # the deadline, not the read timeout nor 10,000 x 0.2 s


@pytest.mark.slow
@pytest.mark.subprocess  # the moto S3 server process
def test_a_dripping_s3_body_fails_at_the_deadline(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy
) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="ds/s.tar", Body=os.urandom(10_000))
    store = Store(f"s3://{s3_bucket}/ds/s.tar", {"endpoint_url": fault_proxy.endpoint}, POLICY)
    fault_proxy.inject("drip", method="GET", times=None)
    took, err = finishes_within(8.0, lambda: store.read_bytes(limit=1 << 20))
    assert isinstance(err, StorageError), err
    assert "max_total_seconds (1.5 s) ran out" in str(err) and "ds/s.tar" in str(err)
    assert 1.4 < took < 4.0
    assert fault_proxy.count("GET") == 1  # cut off once: no new attempt past the deadline


@pytest.mark.slow  # the reader waits out the deadline on purpose
def test_a_slow_reader_does_not_use_up_the_deadline(static_site: tuple[str, Path]) -> None:
    """A part whose buffer is full waits for the reader; that wait is not the server's."""
    base, root = static_site  # no ranges: one GET, one part
    data = os.urandom(48 * MiB)  # 16 MiB fill the part's buffer; the rest waits in the server
    (root / "big.tar").write_bytes(data)
    policy = RetryPolicy(max_attempts=1, max_total_seconds=2.0, read_timeout=10.0)
    got = []
    with Store(f"{base}/big.tar", {}, policy).open_stream(len(data)) as f:
        while chunk := f.read(MiB):
            got.append(chunk)
            if len(got) == 2:
                time.sleep(3.0)  # longer than the deadline, most of the body still to come
    assert b"".join(got) == data
