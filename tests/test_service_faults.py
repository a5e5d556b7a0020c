"""Faults with real server processes: kill -9 mid-epoch, dropped connections, slow clients,
too many clients, a pipeline that fails.  Every epoch must still arrive exactly once."""

from __future__ import annotations

import http.client
import threading
import time

import psutil
import pytest
from test_service_support import (
    DropProxy,
    InProcessServer,
    big_factory,
    dataset_env,
    digest,
    failing_factory,
    finish_client,
    get,
    local_batches,
    parse_metrics,
    start_client,
    start_servers,
)

from shardloader.errors import DecodeError
from shardloader.service import RemoteLoader
from shardloader.service.frames import read_frame
from shardloader.storage.retry import RetryPolicy

BIG = ["test_service_support:big_factory", "--workers", "1", "--max-inflight", "2"]
FRAME = 4 * 256 * 1024  # bytes of the big tensor in one big_factory batch


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with dataset_env(tmp_path_factory, "none", SERVICE_TEST_FAIL_AT="150") as env:
        yield env


@pytest.fixture(scope="module")
def servers(env, tmp_path_factory):
    """Replicas a (killed by the first test) and b (2 streams at most)."""
    started = start_servers(
        [BIG, [*BIG, "--max-clients", "2"]], str(tmp_path_factory.mktemp("servers")), env
    )
    yield dict(zip("ab", started, strict=True))
    for s in started:
        s.stop()


@pytest.fixture(scope="module")
def reference(env):
    return {
        epoch: [digest(b) for b in local_batches(big_factory, 0, 1, epoch)] for epoch in (1, 2, 3)
    }


@pytest.mark.slow
@pytest.mark.subprocess
def test_kill_9_mid_epoch_fails_over_to_the_replica(servers, env, reference, tmp_path):
    a, b = servers["a"], servers["b"]
    served_before = b.metrics()["shardloader_batches_served_total"]
    out = str(tmp_path / "client.json")
    proc = start_client([a.url, b.url, "--epoch", "1", "--sleep", "0.02", "--out", out], env)
    for _ in range(5):
        assert proc.stdout is not None and proc.stdout.readline().startswith("step")
    a.kill()  # 45 steps of ~1 MiB to go: far more than buffers hold
    got = finish_client(proc, out)
    assert a.proc.returncode == -9
    assert got["digests"] == reference[1]  # every batch once, in order, byte for byte
    assert got["reconnects"] >= 1
    assert b.metrics()["shardloader_batches_served_total"] - served_before >= 30


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("cut", [10, int(2.5 * FRAME)])
def test_dropped_connections_resume_at_the_first_missing_step(servers, reference, cut):
    """Resets inside the HTTP headers (10 B) and mid-frame (2.5 frames in), 3 times each."""
    proxy = DropProxy(servers["b"].port, cut=cut, drops=3)
    try:
        loader = RemoteLoader(
            proxy.url,
            prefetch=1,
            retry=RetryPolicy(max_attempts=5, initial_backoff=0.05, read_timeout=20),
        )
        loader.set_epoch(2)
        assert [digest(b) for b in loader] == reference[2]
        assert proxy.dropped == 3
        assert loader.reconnects == 3
    finally:
        proxy.close()


def _open_stream(port: int, epoch: int = 0) -> tuple[http.client.HTTPConnection, object]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", f"/v1/batches?epoch={epoch}&rank=0&world_size=1")
    resp = conn.getresponse()
    return conn, resp


def _stream_lines(text: str, name: str) -> list[float]:
    return [
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")
    ]


def _wait_idle(server) -> None:
    deadline = time.monotonic() + 30
    while server.metrics()["shardloader_streams_active"] and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.subprocess
def test_slow_client_does_not_grow_server_memory(servers):
    c = servers["b"]
    _wait_idle(c)
    proc = psutil.Process(c.proc.pid)
    conn, resp = _open_stream(c.port)
    try:
        assert resp.status == 200
        assert read_frame(resp.readinto).kind == "batch"
        time.sleep(0.5)
        rss = [proc.memory_info().rss]
        for _ in range(6):  # the client reads nothing for 3 s; 49 MiB of batches are due
            time.sleep(0.5)
            rss.append(proc.memory_info().rss)
        text = get(f"{c.url}/metrics")[1].decode()
        lag = _stream_lines(text, "shardloader_client_lag_batches")
        blocked = _stream_lines(text, "shardloader_client_blocked_seconds_total")
        sent = _stream_lines(text, "shardloader_client_batches_total")
        assert lag and 1 <= max(lag) <= 2  # --max-inflight 2
        assert max(blocked) > 1.5  # the producer waited for the client instead of buffering
        assert max(sent) < 45  # what socket buffers took, not the whole epoch
        assert max(rss) - min(rss) < 24 << 20, f"server RSS grew: {rss}"
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.subprocess
def test_too_many_clients_get_503_and_the_client_retries(servers, reference):
    c = servers["b"]
    _wait_idle(c)
    held = [_open_stream(c.port) for _ in range(2)]
    assert all(r.status == 200 for _, r in held)
    before = c.metrics().get('shardloader_requests_rejected_total{status="503"}', 0)
    status, body, headers = get(f"{c.url}/v1/batches?epoch=0&rank=0&world_size=1")
    assert status == 503 and headers["retry-after"] == "1" and b"max-clients" in body

    result: dict[str, list[str]] = {}

    def train() -> None:
        loader = RemoteLoader(c.url, prefetch=1)
        loader.set_epoch(3)
        result["digests"] = [digest(b) for b in loader]

    t = threading.Thread(target=train, daemon=True)
    t.start()
    time.sleep(2.0)
    for conn, _ in held:
        conn.close()
    t.join(120)
    assert result["digests"] == reference[3]
    after = c.metrics()['shardloader_requests_rejected_total{status="503"}']
    assert after - before >= 2  # the loader was turned away at least once, and came back


def test_pipeline_error_reaches_the_client_as_the_same_error(env, monkeypatch):
    """Deterministic data errors are not retried: the loop gets the local loader's error type."""
    monkeypatch.setenv("SERVICE_TEST_FAIL_AT", "150")
    with pytest.raises(DecodeError, match="injected failure"):
        local_batches(failing_factory, 0, 1, 0)
    with InProcessServer(failing_factory(), workers=1) as server:
        loader = RemoteLoader(server.url)
        seen = []
        pattern = r"(?s)failed at step \d+ of epoch 0.*injected failure"
        with pytest.raises(DecodeError, match=pattern):
            for batch in loader:
                seen.append(batch)
        assert 0 < len(seen) < 25 and loader.reconnects == 0
        assert get(f"{server.url}/health")[0] == 200
        metrics = parse_metrics(get(f"{server.url}/metrics")[1].decode())
        assert metrics["shardloader_pipeline_errors_total"] == 1
