"""A pinned pipeline, and server failures as faults, with real ``serve`` processes: a replica
with other ``--transform`` options is refused naming both pipelines; SIGTERM to a server's
process group and SIGKILL of one stream worker fail over (or reconnect) with every batch once;
503 Retry-After spends no attempt."""

from __future__ import annotations

import http.server
import os
import signal
import threading
import time

import psutil
import pytest
from corpus import class_folders
from http_server import serving
from test_service_support import (
    big_factory,
    dataset_env,
    digest,
    finish_client,
    local_batches,
    server_env,
    small_factory,
    start_client,
    start_servers,
)

from shardloader.errors import ResumeError, StorageError
from shardloader.pack import PackOptions, pack
from shardloader.service import RemoteLoader
from shardloader.service.fingerprint import describe, differences, fingerprint
from shardloader.storage.retry import RetryPolicy

BIG = ["test_service_support:big_factory", "--workers", "1", "--max-inflight", "2"]
SMALL = ["test_service_support:small_factory", "--workers", "1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with dataset_env(tmp_path_factory, "none") as env:
        yield env


@pytest.fixture(scope="module")
def reference(env):
    return [digest(b) for b in local_batches(big_factory, 0, 1, 1)]


def _follow(proc, steps: int) -> None:
    """Wait until the client process has printed ``steps`` steps."""
    for _ in range(steps):
        assert proc.stdout is not None and proc.stdout.readline().startswith("step")


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_replica_with_other_transform_options_is_refused_naming_both(tmp_path):
    """`serve DATA --transform train --image-size 32` and the same at 48 px plan the same
    steps; a client pinned to the first must not continue on the second."""
    class_folders(str(tmp_path / "raw"))
    data = str(tmp_path / "packed")
    pack(str(tmp_path / "raw"), data, PackOptions())
    env = server_env(data, str(tmp_path / "cache"))
    common = [data, "--batch-size", "4", "--shuffle", "--seed", "3", "--transform", "train"]
    a, b = start_servers(
        [[*common, "--image-size", "32"], [*common, "--image-size", "48"]], str(tmp_path), env
    )
    try:
        loader = RemoteLoader([a.url, b.url], prefetch=1)
        assert len(loader) == 3  # pins what a, the first URL, serves
        a.kill()
        with pytest.raises(ResumeError) as caught:
            list(loader)  # before: 3 batches of 48 px after 32 px ones, silently
        message = str(caught.value)
        other = RemoteLoader(b.url)
        assert len(other) == 3
        assert None not in (loader.pipeline, other.pipeline)
        assert loader.pipeline != other.pipeline
        assert f"{loader.pipeline!r}" in message and f"{other.pipeline!r}" in message
        assert "options.image_size is 32 here, 48 there" in message
        assert "transform" in message and "size is 32 here, 48 there" in message
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigterm_to_a_servers_process_group_fails_over_with_every_batch_once(
    env, reference, tmp_path
):
    """systemd stops a service with SIGTERM to its whole group: the stream's workers die with
    the server.  The pass goes on at the replica, none missing, none repeated."""
    a, b = start_servers([BIG, BIG], str(tmp_path), env, new_group=True)
    try:
        out = str(tmp_path / "client.json")
        proc = start_client([a.url, b.url, "--epoch", "1", "--sleep", "0.02", "--out", out], env)
        _follow(proc, 5)
        a.stop_group()  # 45 steps of ~1 MiB to go: far more than buffers hold
        got = finish_client(proc, out)
        assert got["digests"] == reference  # every batch once, in order, byte for byte
        assert got["reconnects"] >= 1
        assert a.proc.returncode is not None  # a is gone: b served the rest
        assert b.metrics()["shardloader_batches_served_total"] > 0
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_stream_worker_killed_mid_pass_is_a_fault_not_the_end(env, reference, tmp_path):
    """SIGKILL of the stream's one DataLoader worker (as the OOM killer does): the server
    says the failure is its own, and the client asks it again where it left off."""
    (server,) = start_servers([BIG], str(tmp_path), env)
    try:
        before = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
        out = str(tmp_path / "client.json")
        proc = start_client([server.url, "--epoch", "1", "--sleep", "0.02", "--out", out], env)
        _follow(proc, 5)
        workers = [
            p
            for p in psutil.Process(server.proc.pid).children(recursive=True)
            if p.pid not in before
        ]
        assert len(workers) == 1, workers  # --workers 1: the stream's one worker
        os.kill(workers[0].pid, signal.SIGKILL)
        got = finish_client(proc, out)
        assert got["digests"] == reference
        assert got["reconnects"] >= 1
        assert server.proc.poll() is None  # the server itself lives on
        assert server.metrics()["shardloader_pipeline_errors_total"] >= 1
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.subprocess
def test_clients_turned_away_with_retry_after_wait_and_all_finish(env, tmp_path):
    """A server at --max-clients 1 and three clients whose policy allows 2 attempts: each
    503 Retry-After is a wait, not an attempt, so every client reads its whole pass."""
    (server,) = start_servers([[*SMALL, "--max-clients", "1"]], str(tmp_path), env)
    want = [digest(b) for b in local_batches(small_factory, 0, 1, 0)]
    results: dict[int, object] = {}

    def train(n: int) -> None:
        try:
            loader = RemoteLoader(
                server.url, prefetch=1, retry=RetryPolicy(max_attempts=2, max_total_seconds=90)
            )
            got = []
            for batch in loader:
                got.append(digest(batch))
                time.sleep(0.05)  # ~1.3 s a pass: the others are turned away meanwhile
            results[n] = got
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            results[n] = err

    try:
        threads = [threading.Thread(target=train, args=(n,), daemon=True) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {n: want for n in range(3)}
        assert server.metrics()['shardloader_requests_rejected_total{status="503"}'] >= 2
    finally:
        server.stop()


class _Busy(http.server.BaseHTTPRequestHandler):
    """A server that is always full: 503 with Retry-After: 1, as serve at --max-clients."""

    seen = 0

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        type(self).seen += 1
        body = b'{"error": "this server already runs 1 streams (--max-clients)", "status": 503}'
        self.send_response(503)
        self.send_header("Retry-After", "1")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_retry_after_spends_no_attempt_and_the_time_budget_ends_the_wait():
    """One attempt allowed, 2.5 s of budget: the busy answers are waited out, not counted,
    until the seconds are spent; then one StorageError names the server."""
    with serving(_Busy) as url:
        loader = RemoteLoader(url, retry=RetryPolicy(max_attempts=1, max_total_seconds=2.5))
        with pytest.raises(StorageError, match="max-clients") as caught:
            len(loader)
        assert _Busy.seen >= 2  # before: given up at the first 503, in 0.0 s
        assert url in str(caught.value)


class _Crop:
    """A transform as users write them: options, a helper function, a lock (no state to
    compare: named by type), and an address in its repr."""

    def __init__(self, size: int) -> None:
        self.size, self.pick = size, os.path.basename
        self.lock = threading.Lock()


def test_a_pipelines_description_holds_what_it_declares_and_no_address():
    a, b = describe([_Crop(32), {"mode": "RGB"}]), describe([_Crop(48), {"mode": "RGB"}])
    assert "0x" not in repr(a)  # repr(_Crop(32)) has one; the description never
    assert fingerprint({"t": a}) == fingerprint({"t": describe([_Crop(32), {"mode": "RGB"}])})
    assert fingerprint({"t": a}) != fingerprint({"t": b})
    assert differences(a, b, "transform") == ["transform[0].size is 32 here, 48 there"]
