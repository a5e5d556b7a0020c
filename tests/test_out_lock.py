"""One writer at a time on OUT (NOTE [the OUT lock] in shardloader/pack/lock.py).

Two real ``pack`` processes on one OUT: the one that starts second exits 2 naming the holder
(host, pid, start time), the old dataset stays readable and whole meanwhile, and the holder's
result verifies.  The holder is held mid-pack deterministically: its source is on the real S3
server behind the fault proxy, which stalls the GET of one input until the test lets it go.
The lock object on ``s3://`` is checked against the real moto server: a conditional PUT,
renewal, takeover after the lease expires (or at once when its process is gone), and a run
whose lease was taken over writing no manifest.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy

from shardloader.errors import OutputLockedError
from shardloader.manifest import MANIFEST_NAME
from shardloader.pack import PackOptions, pack
from shardloader.pack.index_existing import index_shards
from shardloader.pack.lock import LOCK_NAME, out_lock
from shardloader.pack.merge import merge
from shardloader.read.verify import verify_dataset
from shardloader.storage.store import Store

N = 12
HELD = 3  # input k/0003: its GET stalls until the test releases it


def _body(i: int) -> bytes:
    return bytes([i]) * (1000 + 100 * i)


def _local_source(root: Path, n: int = 6, salt: int = 7) -> Path:
    (root / "k").mkdir(parents=True)
    for i in range(n):
        (root / "k" / f"{i:04d}.bin").write_bytes(bytes([(i + salt) % 256]) * (500 + i))
    return root


def _shardloader(*args: object) -> list[str]:
    return [sys.executable, "-m", "shardloader", *map(str, args)]


# -- in one process: the lock as the library sees it -------------------------------------------


def test_local_lock_refuses_pack_index_and_merge_and_leaves_nothing(tmp_path):
    src = _local_source(tmp_path / "src")
    out = tmp_path / "out"
    pack(str(src), str(out), PackOptions(max_samples=2))
    before = sorted(os.listdir(out))
    with out_lock(Store(str(out)), "pack") as lock:
        assert json.loads((out / LOCK_NAME).read_bytes())["run_id"] == lock.run_id
        for attempt in (
            lambda: pack(str(src), str(out), PackOptions(max_samples=2, overwrite=True)),
            lambda: pack(str(src), str(out), PackOptions(max_samples=2, resume=True)),
            lambda: index_shards([str(out / "shard-00000.tar.zst")], str(out), overwrite=True),
            lambda: merge([str(out)], str(out), overwrite=True),
        ):
            with pytest.raises(OutputLockedError) as err:
                attempt()
            msg = str(err.value)
            assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg, msg
            assert "started 20" in msg and "`pack`" in msg, msg
    assert sorted(os.listdir(out)) == before  # no lock file left, the dataset untouched
    assert verify_dataset(str(out)).ok
    report = pack(str(src), str(out), PackOptions(max_samples=2, overwrite=True))
    assert report.samples == 6


def test_a_killed_holder_leaves_no_stale_local_lock(tmp_path):
    """flock: the kernel drops the lock of a process killed with SIGKILL."""
    out = tmp_path / "out"
    code = (
        "import os, signal, sys\n"
        "from shardloader.pack.lock import out_lock\n"
        "from shardloader.storage.store import Store\n"
        "with out_lock(Store(sys.argv[1]), 'pack'):\n"
        "    print('held', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, timeout=60)
    assert r.returncode == -9 and r.stdout == b"held\n", r.stderr
    assert (out / LOCK_NAME).exists()  # left behind by the dead holder, but not locked
    with out_lock(Store(str(out)), "pack"):
        pass
    assert not (out / LOCK_NAME).exists()


# -- two real pack processes -------------------------------------------------------------------


@pytest.fixture
def held(s3_server, s3_client, s3_bucket) -> Iterator[tuple[str, FaultProxy]]:
    """``s3://bucket/src``, read through a proxy that stalls the first GET of one input."""
    for i in range(N):
        s3_client.put_object(Bucket=s3_bucket, Key=f"src/k/{i:04d}.bin", Body=_body(i))
    with FaultProxy(s3_server, stall_seconds=300.0, lifetime=300.0) as proxy:
        proxy.inject("stall", method="GET", path=f"/src/k/{HELD:04d}.bin", times=1)
        yield f"s3://{s3_bucket}/src", proxy


def _release(proxy: FaultProxy) -> None:
    """End the stalled GET now (the client sees its connection close and asks again)."""
    with proxy._lock:
        conns = list(proxy._conns)
    for c in conns:
        try:
            c.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _wait_held(proxy: FaultProxy, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not any(r.fault == "stall" for r in list(proxy.requests)):
        if proc.poll() is not None:
            pytest.fail(f"pack ended early ({proc.returncode}): {proc.stderr.read().decode()}")
        if time.monotonic() > deadline:
            pytest.fail("pack never asked for the held input")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize(
    "case",
    ["new OUT: pack", "old dataset: pack --overwrite", "old dataset: pack --resume", "index"],
)
def test_second_run_on_one_out_exits_2_naming_the_first(tmp_path, held, case):
    (src, proxy), out = held, tmp_path / "out"
    other = _local_source(tmp_path / "other")
    old = None
    if case != "new OUT: pack":  # a finished dataset of another source in OUT
        pack(str(other), str(out), PackOptions(max_samples=2))
        old = (out / MANIFEST_NAME).read_bytes()
    first = _shardloader(
        "pack", src, out, "-o", f"endpoint_url={proxy.endpoint}", "--max-samples", "2"
    )
    first += ["--workers", "1", "--retries", "6", *(["--overwrite"] if old else [])]
    second = {
        "new OUT: pack": _shardloader("pack", other, out, "--max-samples", "2"),
        "old dataset: pack --overwrite": _shardloader("pack", other, out, "--overwrite"),
        "old dataset: pack --resume": _shardloader(
            "pack", other, out, "--max-samples", "2", "--resume"
        ),
        "index": _shardloader("index", out / "shard-00000.tar.zst", out, "--overwrite"),
    }[case]
    proc = subprocess.Popen(first, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_held(proxy, proc)  # the first run holds the lock and is mid-pack
        r = subprocess.run(second, capture_output=True, timeout=120)
        err = r.stderr.decode()
        assert r.returncode == 2, err
        assert f"pid {proc.pid}" in err and socket.gethostname() in err, err
        assert "started 20" in err and "locked by `pack`" in err, err
        assert "Traceback" not in err
        if old is not None:  # the old dataset is whole and readable while the first runs
            assert (out / MANIFEST_NAME).read_bytes() == old
            assert verify_dataset(str(out)).ok
        _release(proxy)
        _, ferr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, ferr.decode()
    report = verify_dataset(str(out))
    assert report.ok and report.samples == N
    assert not (out / LOCK_NAME).exists()


# -- the lock object on s3:// ------------------------------------------------------------------


def _s3(s3_server: str, bucket: str) -> Store:
    return Store(f"s3://{bucket}/ds", {"endpoint_url": s3_server})


def _lock_body(s3_client, bucket: str) -> dict:
    return json.loads(s3_client.get_object(Bucket=bucket, Key=f"ds/{LOCK_NAME}")["Body"].read())


def _foreign(s3_client, bucket: str, **fields) -> None:
    body = {
        "command": "pack",
        "host": "other-host",
        "pid": 4242,
        "started": time.time() - 100,
        "run_id": "f" * 32,
        "expires": time.time() + 600,
        **fields,
    }
    s3_client.put_object(Bucket=bucket, Key=f"ds/{LOCK_NAME}", Body=json.dumps(body).encode())


@pytest.mark.subprocess  # the moto S3 server process
def test_s3_lock_is_a_conditional_put_that_a_second_run_cannot_take(
    s3_server, s3_client, s3_bucket, tmp_path
):
    store = _s3(s3_server, s3_bucket)
    with out_lock(store, "pack") as lock:
        body = _lock_body(s3_client, s3_bucket)
        assert body["run_id"] == lock.run_id and body["pid"] == os.getpid()
        assert body["expires"] > time.time()
        with pytest.raises(OutputLockedError, match=f"pid {os.getpid()}"):
            with out_lock(store, "merge"):
                pass
        r = subprocess.run(
            _shardloader(
                "pack",
                _local_source(tmp_path / "src"),
                store.url,
                "-o",
                f"endpoint_url={s3_server}",
            ),
            capture_output=True,
            timeout=120,
        )
        assert r.returncode == 2 and f"pid {os.getpid()}" in r.stderr.decode(), r.stderr
    listed = s3_client.list_objects_v2(Bucket=s3_bucket, Prefix="ds/").get("Contents", [])
    assert listed == []  # released: the lock object is gone, and nothing else was written


@pytest.mark.subprocess
def test_s3_lock_of_a_live_holder_is_refused_until_its_lease_expires(
    s3_server, s3_client, s3_bucket
):
    store = _s3(s3_server, s3_bucket)
    _foreign(s3_client, s3_bucket)
    with pytest.raises(OutputLockedError, match="host other-host, pid 4242.*lease expires in"):
        with out_lock(store, "pack"):
            pass
    _foreign(s3_client, s3_bucket, expires=time.time() - 1)  # a crashed run's lease ran out
    with out_lock(store, "pack") as lock:
        assert _lock_body(s3_client, s3_bucket)["run_id"] == lock.run_id
        lock.check()


@pytest.mark.subprocess
def test_s3_lock_of_a_dead_process_on_this_host_is_taken_over_at_once(
    s3_server, s3_client, s3_bucket
):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _foreign(s3_client, s3_bucket, host=socket.gethostname(), pid=dead.pid)
    with out_lock(_s3(s3_server, s3_bucket), "pack") as lock:
        assert _lock_body(s3_client, s3_bucket)["run_id"] == lock.run_id


@pytest.mark.subprocess
def test_s3_lease_is_renewed_and_a_run_that_lost_it_stops(s3_server, s3_client, s3_bucket):
    store = _s3(s3_server, s3_bucket)
    with out_lock(store, "pack", lease=0.9) as lock:
        first = _lock_body(s3_client, s3_bucket)["expires"]
        deadline = time.monotonic() + 30
        while _lock_body(s3_client, s3_bucket)["expires"] == first:
            assert time.monotonic() < deadline, "the lease was never renewed"
            time.sleep(0.05)
        _foreign(s3_client, s3_bucket)  # another run took it over (say, after a long stall)
        while lock._lost is None:
            assert time.monotonic() < deadline, "the lost lock went unnoticed"
            time.sleep(0.05)
        with pytest.raises(OutputLockedError, match="lost its lock.*other-host"):
            lock.check()
    assert _lock_body(s3_client, s3_bucket)["host"] == "other-host"  # not removed: not ours


def test_pack_to_s3_takes_its_lock_without_s3fs(s3_server, s3_bucket, tmp_path):
    """A run writing a fresh ``s3://`` OUT (lock, listing, uploads, manifest) goes through
    botocore alone: a fresh process never imports s3fs or aiobotocore (about 0.7 CPU seconds
    of a pack), and its dataset verifies."""
    src = tmp_path / "src"
    for i in range(N):
        (src / "k").mkdir(parents=True, exist_ok=True)
        (src / "k" / f"{i:04d}.bin").write_bytes(_body(i))
    out = f"s3://{s3_bucket}/ds"
    code = (
        "import sys\n"
        "from shardloader.pack import PackOptions, pack\n"
        f"pack({str(src)!r}, {out!r}, PackOptions(workers=2, storage_options="
        f"{{'endpoint_url': {s3_server!r}}}))\n"
        "print(sorted(m for m in ('s3fs', 'aiobotocore') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert verify_dataset(out, storage_options={"endpoint_url": s3_server}).ok
