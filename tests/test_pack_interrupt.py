"""Killed or interrupted mid-pack (real SIGKILL / SIGINT of a `python -m shardloader` process):
no manifest, no partial shard under a final name, no orphaned workers; --resume finishes.

The pack is held mid-way deterministically: the source is a real S3 server behind the fault
proxy, which never answers the GET of one input, so the shard holding it never finishes while
the shards around it do.  (A local FIFO held it before; pack now refuses inputs that are not
regular files, as reading does.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from corpus import tree
from fault_proxy import FaultProxy

from shardloader.format import get_format
from shardloader.pack import PackOptions, pack
from shardloader.pack.resume import sidecar_meta

psutil = pytest.importorskip("psutil")

N = 12
HELD = 3  # sample k/0003 (shard 1 with --max-samples 2): its GET never gets an answer


def _body(i: int) -> bytes:
    return bytes([i]) * (1000 + 100 * i)


@pytest.fixture
def held(s3_server, s3_client, s3_bucket) -> Iterator[tuple[str, FaultProxy]]:
    """``s3://bucket/src`` holding the corpus, and a proxy in front of the server that stalls
    every GET of the held input (far longer than any test waits)."""
    for i in range(N):
        s3_client.put_object(Bucket=s3_bucket, Key=f"src/k/{i:04d}.bin", Body=_body(i))
    with FaultProxy(s3_server, stall_seconds=300.0, lifetime=300.0) as proxy:
        proxy.inject("stall", method="GET", path=f"/src/k/{HELD:04d}.bin", times=None)
        yield f"s3://{s3_bucket}/src", proxy


def default_sigint() -> None:
    """In the child before it runs pack: SIGINT as Python's default, not the runner's.

    A background job of a non-interactive shell (``bash .ci/run &``) starts with SIGINT
    ignored, children inherit an ignored signal through exec, and Python leaves an ignored
    SIGINT alone: pack would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint}


@contextmanager
def _packing(src: str, out, workers: int, endpoint: str) -> Iterator[subprocess.Popen]:
    """`shardloader pack` in a subprocess, stopped and reaped whatever the test does."""
    cmd = [
        sys.executable,
        "-m",
        "shardloader",
        "pack",
        src,
        str(out),
        "-o",
        f"endpoint_url={endpoint}",
        "--retries",
        "1",
        "--max-samples",
        "2",
        "--workers",
        str(workers),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _wait_for(path, proc, timeout=120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            pytest.fail(f"pack ended early ({proc.returncode}): {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            pytest.fail("pack did not write its first shard in time")
        time.sleep(0.05)


def _check_final_names(out) -> list[str]:
    """Every file under a final shard name is whole; return those names."""
    names = sorted(p for p in os.listdir(out) if p.startswith("shard-") and p.endswith(".tar.zst"))
    for name in names:
        with open(out / name, "rb") as f:
            samples = list(get_format("tar").iter_stored(f, "zstd", name))  # raises if truncated
        assert len(samples) == 2
        index = out / name.replace(".tar.zst", ".idx.arrow")
        if index.exists():
            import hashlib

            meta = sidecar_meta(index.read_bytes(), str(index))
            assert meta["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    return names


def _finish_and_compare(tmp_path, src: str, out, proxy: FaultProxy) -> None:
    proxy.clear()  # the held input answers now
    options = _options(proxy.endpoint)
    resumed = pack(src, str(out), PackOptions(max_samples=2, resume=True, storage_options=options))
    assert resumed.kept_shards >= 1
    pack(src, str(tmp_path / "fresh"), PackOptions(max_samples=2, storage_options=options))
    assert tree(str(out)) == tree(str(tmp_path / "fresh"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_sigkill_leaves_no_manifest_no_partial_shard_and_no_orphans(tmp_path, held):
    (src, proxy), out = held, tmp_path / "out"
    with _packing(src, out, 2, proxy.endpoint) as proc:
        _wait_for(out / "shard-00000.tar.zst", proc)
        time.sleep(0.3)  # let the other worker get going
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "expected worker processes"
        proc.kill()
        proc.wait(30)
    gone, alive = psutil.wait_procs(children, timeout=20)
    assert not alive, f"orphaned processes: {alive}"
    assert not (out / "index.json").exists()
    names = _check_final_names(out)
    assert "shard-00001.tar.zst" not in names  # the held shard never got a final name
    assert any(".tmp-" in p for p in os.listdir(out)) or len(names) == N // 2 - 1
    _finish_and_compare(tmp_path, src, out, proxy)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("workers", [1, 2])
def test_sigint_cleans_up_and_exits_130(tmp_path, held, workers):
    (src, proxy), out = held, tmp_path / "out"
    with _packing(src, out, workers, proxy.endpoint) as proc:
        _wait_for(out / "shard-00000.tar.zst", proc)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("pack did not stop on SIGINT")
    assert proc.returncode == 130, err.decode()
    assert b"re-run with --resume" in err
    assert not (out / "index.json").exists()
    assert not [p for p in os.listdir(out) if ".tmp-" in p]
    assert "shard-00001.tar.zst" not in _check_final_names(out)
    _finish_and_compare(tmp_path, src, out, proxy)


def test_children_get_the_default_sigint_even_when_the_runner_ignores_it():
    """What a background job of a non-interactive shell does to the runner (SIG_IGN)."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        inherited = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
        reset = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, timeout=60, preexec_fn=default_sigint
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert inherited.stdout == b"False\n"  # an ignored SIGINT survives exec: Ctrl-C is lost
    assert reset.stdout == b"True\n", reset.stderr
