"""ShardLoader workers whose training process was SIGKILLed exit on their own, as a plain torch
DataLoader's do (NOTE [orphaned workers] in shardloader/deliver/workers.py): real
DataLoader workers in a real process, killed mid-epoch while the batches they hold fill the
result pipe."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import helpers
import pytest

import shardloader as sl

psutil = pytest.importorskip("psutil")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)

TRAIN = textwrap.dedent(
    """
    import sys, time
    import shardloader as sl

    ds = sl.ShardedDataset(sys.argv[1], batch_size=8, shuffle=True, seed=1,
                           read=sl.ReadOptions(cache=sl.CacheOptions(dir=sys.argv[2])))
    loader = sl.make_loader(ds, num_workers=2)
    for step, batch in enumerate(loader):
        if step == 2:  # mid-epoch: the workers hold batches of raw bytes for the pipe
            print(*[w.pid for w in loader._iterator._workers], flush=True)
            time.sleep(600)
    """
)


STREAM_REQUEST = b"GET /v1/batches?epoch=0&rank=0&world_size=1 HTTP/1.1\r\nHost: t\r\n\r\n"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """200 samples of 96 KiB: a batch (768 KiB of bytes) is far more than a pipe holds."""
    d = str(tmp_path_factory.mktemp("orphans"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(helpers, "payload", lambda i: bytes([i % 251]) * (96 << 10))
        helpers.write_dataset(d, [50, 50, 50, 50])
    return d


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_workers_exit_soon_after_the_training_process_is_killed(data, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAIN, data, str(tmp_path / "cache")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    workers: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"the training process ended early:\n{proc.stderr.read()[-3000:]}"  # type: ignore[union-attr]
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2 and _alive(workers) == workers
        time.sleep(1.0)  # the workers fill the pipe with the batches they prepared ahead
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        killed = time.monotonic()
        while _alive(workers) and time.monotonic() - killed < 10:
            time.sleep(0.1)
        left = _alive(workers)
        assert not left, f"workers {left} still alive 10 s after their parent was killed"
    finally:
        for pid in _alive(workers):  # first: they hold the pipes' write ends too
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes the pipes


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_killed_servers_stream_workers_exit_soon(data, tmp_path):
    """``shardloader serve`` killed with -9 while a stream's workers hold raw batches."""
    import socket

    from test_service_support import ServerProcess, server_env

    env = server_env(data, str(tmp_path / "cache"))
    args = [data, "--batch-size", "8", "--decode", "raw", "--workers", "2"]
    server = ServerProcess(args, str(tmp_path), env).wait_ready()
    workers: list[int] = []
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as client:
            client.sendall(STREAM_REQUEST)
            assert client.recv(1 << 16).startswith(b"HTTP/1.1 200")  # then it reads no more
            deadline = time.monotonic() + 60
            while len(workers) < 2 and time.monotonic() < deadline:
                workers = [c.pid for c in psutil.Process(server.proc.pid).children()]
                time.sleep(0.1)
            assert len(workers) == 2, "the stream's DataLoader workers did not start"
            time.sleep(1.0)
            server.kill()
            killed = time.monotonic()
            while _alive(workers) and time.monotonic() - killed < 10:
                time.sleep(0.1)
            left = _alive(workers)
            assert not left, f"stream workers {left} still alive 10 s after the server was killed"
    finally:
        server.stop()
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)


def _fail_at_the_second_batch(batch):
    if os.environ.get("BREAK_COLLATE") and batch["__index__"].min() >= 8:
        raise ValueError("a broken collate")
    return batch


@pytest.mark.slow
def test_a_pass_that_fails_in_a_worker_ends_its_workers_at_once(data, monkeypatch):
    """The error's traceback keeps torch's iterator; the workers must not wait for the
    garbage collector (which took 5 s a worker: NOTE [workers of a failed pass]), and the
    next pass starts new ones and reads the whole epoch."""
    ds = sl.ShardedDataset(data, batch_size=8)
    loader = sl.make_loader(ds, num_workers=2, collate_fn=_fail_at_the_second_batch)
    monkeypatch.setenv("BREAK_COLLATE", "1")
    gc.disable()
    try:
        with pytest.raises(ValueError, match="a broken collate"):
            for _ in loader:
                pass
        assert not helpers.workers_left()
    finally:
        gc.enable()
    monkeypatch.delenv("BREAK_COLLATE")
    ids = sorted(i for batch in loader for i in batch["__index__"].tolist())
    assert ids == list(range(200))
