"""NOTE [connection rules] (shardloader/service/connections.py) against real sockets: half-sent
requests, dripped bytes, idle keep-alive connections, clients that stop reading, and a server
whose file descriptors half-open connections would exhaust."""

from __future__ import annotations

import http.client
import json
import resource
import socket
import time

import pytest
from test_service_support import (
    InProcessServer,
    ServerProcess,
    big_factory,
    dataset_env,
    digest,
    get,
    local_batches,
    parse_metrics,
    small_factory,
)

HEAD = b"GET /v1/info HTTP/1.1\r\nHost: t\r\n"  # no blank line: the head never ends
STREAM = b"GET /v1/batches?epoch=0&rank=0&world_size=1 HTTP/1.1\r\nHost: t\r\n\r\n"
TOKEN = "a-token-that-is-long-enough-123"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with dataset_env(tmp_path_factory, "none") as env:
        yield env


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``)."""
    t0 = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def closed(server: InProcessServer) -> dict[str, float]:
    metrics = parse_metrics(get(f"{server.url}/metrics")[1].decode())
    prefix = "shardloader_connections_closed_total"
    return {k[len(prefix) :]: v for k, v in metrics.items() if k.startswith(prefix)}


@pytest.mark.slow
def test_a_request_head_must_arrive_within_the_header_timeout(env):
    with InProcessServer(small_factory(), workers=0, header_timeout=0.5) as server:
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(HEAD)
        drip = socket.create_connection(("127.0.0.1", server.port))
        t0 = time.monotonic()
        try:  # a byte every 0.1 s: the deadline counts from the start, not the last byte
            for byte in HEAD:
                drip.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        dripped = time.monotonic() - t0
        assert closed_within(drip, 5) is not None and dripped < 2.5
        assert closed_within(half, 5) is not None
        half.close()
        drip.close()
        assert closed(server) == {'{reason="header_timeout"}': 2}
        assert get(f"{server.url}/health")[0] == 200  # a whole request is served at once


def test_a_keep_alive_connection_must_send_its_next_request_within_the_idle_timeout(env):
    """One byte of a second request: uvicorn's keep-alive timer stops at any byte."""
    with InProcessServer(small_factory(), workers=0, idle_timeout=0.5) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            s.sendall(b"G")
            took = closed_within(s, 5)
        assert took is not None and took < 2
        assert closed(server) == {'{reason="idle_timeout"}': 1}


def test_a_request_without_the_token_gets_its_connection_closed(env):
    with InProcessServer(small_factory(), workers=0, token=TOKEN) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /v1/info HTTP/1.1\r\nHost: t\r\n\r\n")
            reply = s.recv(4096)
            assert reply.startswith(b"HTTP/1.1 401") and b"connection: close" in reply
            assert closed_within(s, 5) is not None


def _stall(port: int) -> socket.socket:
    """A stream whose client reads its first bytes and then nothing (small buffers)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)
    s.connect(("127.0.0.1", port))
    s.sendall(STREAM)
    assert s.recv(64).startswith(b"HTTP/1.1 200")
    return s


@pytest.mark.slow
def test_clients_that_stop_reading_free_their_slots(env):
    """Two streams of 1 MiB batches whose clients stop reading hold both --max-clients slots
    only until the write timeout; then a third client is served."""
    with InProcessServer(big_factory(), workers=0, max_clients=2, write_timeout=1.0) as server:
        stalled = [_stall(server.port), _stall(server.port)]
        try:
            status, body, _ = get(f"{server.url}/v1/batches?epoch=0&rank=0&world_size=1")
            assert status == 503 and b"max-clients" in body
            deadline = time.monotonic() + 20
            while closed(server).get('{reason="write_timeout"}', 0) < 2:
                assert time.monotonic() < deadline, f"slots still held: {closed(server)}"
                time.sleep(0.2)
            while parse_metrics(get(f"{server.url}/metrics")[1].decode())[
                "shardloader_streams_active"
            ]:
                assert time.monotonic() < deadline, "the stalled streams did not end"
                time.sleep(0.1)
            for s in stalled:  # the server aborted them: the client sees the end
                assert closed_within(s, 5) is not None
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(
                    b"GET /v1/batches?epoch=0&rank=0&world_size=1 HTTP/1.1\r\nHost: t\r\n\r\n"
                )
                assert s.recv(64).startswith(b"HTTP/1.1 200")
        finally:
            for s in stalled:
                s.close()


@pytest.mark.slow
@pytest.mark.subprocess
def test_half_open_connections_cannot_exhaust_the_servers_file_descriptors(env, tmp_path):
    """A server limited to 256 file descriptors, 400 connections that each send half a
    request head (more than it can hold): /v1/info still answers at once, long before any
    header timeout frees them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 600:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    server = ServerProcess(
        [
            "test_service_support:small_factory",
            "--workers",
            "0",
            "--token-file",
            str(_token_file(tmp_path)),
        ],
        str(tmp_path),
        env,
        max_files=256,
    ).wait_ready()
    held: list[socket.socket] = []
    try:
        for _ in range(400):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(HEAD)
            held.append(s)
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
        try:
            conn.request("GET", "/v1/info", headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            status, body = resp.status, resp.read()
        finally:
            conn.close()
        took = time.monotonic() - t0
        assert status == 200 and json.loads(body)["steps"] > 0
        assert took < 5
        metrics = server.metrics(TOKEN)
        assert metrics['shardloader_connections_closed_total{reason="evicted"}'] >= 400 - 64
    finally:
        for s in held:
            s.close()
        server.stop()


def _token_file(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


@pytest.mark.slow
def test_a_loop_that_pauses_past_the_write_timeout_resumes_where_it_was(env):
    """The server aborts the paused client's stream; the client reconnects at the first step
    it lacks, and the epoch is still every batch once, in order."""
    from shardloader.service import RemoteLoader

    reference = [digest(b) for b in local_batches(big_factory, 0, 1, 1)]
    with InProcessServer(big_factory(), workers=0, write_timeout=0.5) as server:
        loader = RemoteLoader(server.url, prefetch=1)
        loader.set_epoch(1)
        got = []
        for step, batch in enumerate(loader):
            got.append(digest(batch))
            if step == 3:
                time.sleep(3)  # a checkpoint: the client reads nothing meanwhile
        assert got == reference
        assert loader.reconnects >= 1
        assert closed(server).get('{reason="write_timeout"}', 0) >= 1
