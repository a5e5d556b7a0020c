"""The service's shared-memory files when clients never map them: a server killed with -9
leaves them, the next server removes them but not those of a server still running (NOTE [stale
segments]), and what such clients make the server hold is bounded (NOTE [unattached
reserve])."""

from __future__ import annotations

import http.client
import os
import socket
import time

import helpers
import pytest
from test_service_support import InProcessServer, ServerProcess, parse_metrics, server_env

import shardloader as sl
from shardloader.service.shm import leftover_segments
from shardloader.service.wireframes import read_frame

STREAM = "/v1/batches?epoch=0&rank=0&world_size=1&shm=1"


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    """200 samples of 64 KiB: an epoch (12.8 MB) is far more than the sockets of a client that
    reads nothing hold, so its stream (and its segment) lasts."""
    out = str(tmp_path_factory.mktemp("big"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(helpers, "payload", lambda i: bytes([i % 251]) * (64 << 10))
        helpers.write_dataset(out, [50, 50, 50, 50])
    return out


def unattached(port: int) -> tuple[http.client.HTTPConnection, str | None]:
    """A stream that asks for shared memory and never maps it: (connection, the segment's
    name, or None when the server offered none)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.sock = socket.socket()
    conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 14)
    conn.sock.settimeout(30)
    conn.sock.connect(("127.0.0.1", port))
    conn.request("GET", STREAM)
    resp = conn.getresponse()
    assert resp.status == 200
    frame = read_frame(resp.readinto)
    assert frame is not None
    return conn, frame.header["name"] if frame.kind == "shm" else None


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_killed_servers_files_go_when_the_next_one_starts(samples, shm_dir, tmp_path):
    env = server_env(samples, str(tmp_path / "cache"))
    args = [samples, "--batch-size", "8", "--decode", "raw", "--workers", "0"]
    args += ["--shm-dir", shm_dir]
    killed, alive = (ServerProcess(args, str(tmp_path), env) for _ in range(2))
    conns = []
    try:
        killed.wait_ready()
        alive.wait_ready()
        for _ in range(3):
            conns.append(unattached(killed.port))
        conns.append(unattached(alive.port))
        names = [name for _, name in conns]
        assert None not in names and sorted(names) == leftover_segments(shm_dir)
        killed.kill()
        time.sleep(0.5)
        assert sorted(names) == leftover_segments(shm_dir)  # kill -9: nobody unlinked them
        time.sleep(2.5)  # older than shmfiles.STALE_SECONDS
        nxt = ServerProcess(args, str(tmp_path), env).wait_ready()
        try:
            assert leftover_segments(shm_dir) == [names[3]]  # the live server's stays
            assert "removed 3 shared-memory file(s)" in nxt.log()
        finally:
            nxt.stop()
    finally:
        for conn, _ in conns:
            conn.close()
        killed.stop()
        alive.stop()


def test_the_lock_decides_which_files_are_stale(shm_dir, monkeypatch):
    """The lock decides, not the pid in the name (another pid namespace may hold it)."""
    import shardloader.service.shmfiles as shmfiles
    from shardloader.service.shmfiles import create_server_file, remove_stale

    monkeypatch.setattr(shmfiles, "STALE_SECONDS", 0.0)
    mine, mm = create_server_file(shm_dir, 1 << 16)
    try:
        other = os.path.join(shm_dir, f"shardloader-1-{'ab' * 16}")  # pid 1 lives, no lock
        with open(other, "wb") as f:
            f.write(b"\0" * 8192)
        assert remove_stale(shm_dir) == (1, 8192)
        assert leftover_segments(shm_dir) == [mine.name]
    finally:
        mm.close()
        mine.unlink()
    assert leftover_segments(shm_dir) == []


def _metrics(srv) -> dict[str, float]:
    return parse_metrics(srv.app.state.service.metrics.render())


def _wait_idle(srv) -> dict[str, float]:
    """The metrics once every stream has ended and given its memory back (the producers close
    it as they end, just after the stream leaves the active list), or at a 30 s deadline."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        metrics = _metrics(srv)
        if not metrics["shardloader_streams_active"]:
            if not metrics["shardloader_shm_unattached_bytes"]:
                return metrics
        time.sleep(0.05)
    return _metrics(srv)


@pytest.mark.slow
def test_clients_that_never_map_their_memory_hold_at_most_the_reserve(samples, shm_dir):
    ds = sl.ShardedDataset(
        samples, batch_size=8, shuffle=True, seed=2, decoder=None, collate_fn=sl.RawCollate()
    )
    with InProcessServer(ds, workers=0, shm_dir=shm_dir) as srv:  # one segment's size
        conn, name = unattached(srv.port)
        assert name is not None
        size = os.path.getsize(os.path.join(shm_dir, name))
        assert _metrics(srv)["shardloader_shm_unattached_bytes"] == size
        conn.close()
        assert _wait_idle(srv)["shardloader_shm_unattached_bytes"] == 0
    reserve = 2 * size + size // 2
    with InProcessServer(ds, workers=0, shm_dir=shm_dir, shm_reserve=reserve) as srv:
        conns = [unattached(srv.port) for _ in range(4)]
        try:
            offered = [name for _, name in conns if name is not None]
            assert len(offered) == 2  # the others read over TCP
            assert sorted(offered) == leftover_segments(shm_dir)
            assert _metrics(srv)["shardloader_shm_unattached_bytes"] == 2 * size <= reserve
        finally:
            for conn, _ in conns:
                conn.close()
        assert _wait_idle(srv)["shardloader_shm_unattached_bytes"] == 0
    assert leftover_segments(shm_dir) == []
