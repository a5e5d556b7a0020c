"""Small test utilities: write a dataset with exact shard sizes, collect loader output, retry
fast against local servers."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from synthetic import shard_name, write_manifest, write_shard

from shardloader.manifest import FieldInfo, Manifest
from shardloader.storage.retry import RetryPolicy

# Retries for the servers the tests start on 127.0.0.1: fast but real (backoff in
# milliseconds, 20 s in all), a read timeout well under the fault proxy's 2 s stalls.
FAST_RETRY = RetryPolicy(
    max_attempts=5,
    initial_backoff=0.01,
    max_backoff=0.05,
    max_total_seconds=20.0,
    connect_timeout=1.0,
    read_timeout=0.5,
)


def payload(i: int) -> bytes:
    """Deterministic, sample-specific bytes of varying size."""
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 5)


def write_dataset(
    out: str,
    shard_sizes: Sequence[int],
    fmt: str = "tar",
    compression: str = "none",
    classes: int = 0,
) -> Manifest:
    """Samples ``0..N-1`` keyed ``s/000123`` with fields ``bin`` (payload) and ``cls``."""
    os.makedirs(out, exist_ok=True)
    fields = {"bin": FieldInfo("bytes"), "cls": FieldInfo("int")}
    total = max(sum(shard_sizes), 1)

    def samples(first: int, size: int) -> Iterator[tuple[str, dict[str, bytes], int]]:
        for gid in range(first, first + size):
            label = gid * max(classes, 1) // total if classes else gid % 3
            yield (
                f"s/{gid:06d}",
                {"bin": payload(gid), "cls": str(label).encode()},
                len(payload(gid)),
            )

    shards, first = [], 0
    for n, size in enumerate(shard_sizes):
        name = shard_name(n, fmt, compression)
        shards.append(write_shard(out, name, fmt, compression, fields, samples(first, size)))
        first += size
    return write_manifest(out, Manifest(fmt, compression, fields, shards, length_field="bin"))


def write_datasets(root: str, sizes: Mapping[str, Sequence[int]]) -> dict[str, str]:
    """A :func:`write_dataset` under ``root`` per name (a mixture's sources); {name: folder}."""
    out = {}
    for name, shard_sizes in sizes.items():
        out[name] = os.path.join(root, name)
        write_dataset(out[name], shard_sizes)
    return out


def own_cache_dataset(path: str, **kw: Any) -> Any:
    """``ShardedDataset(path, **kw)`` staging into ``path/_cache`` unless ``read`` is given: a
    module's tests share what they staged, and no other module's do."""
    import shardloader as sl

    kw.setdefault("read", sl.ReadOptions(cache=sl.CacheOptions(dir=os.path.join(path, "_cache"))))
    return sl.ShardedDataset(path, **kw)


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException | None]]:
    """Start ``fn`` in a daemon thread (a test that gives up on it still ends); the list gets
    None, or what ``fn`` raised, once it returns."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def torchrun(
    tmp: str,
    job: str,
    nproc: int,
    *args: str,
    timeout: float = 240,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone`` of ``tests/<job>`` (or a script's path)
    on ``nproc`` local ranks (gloo; one thread each, TMPDIR in ``tmp`` for their sockets; ``env``
    replaces the environment); fails the test with the tail of its stderr unless every rank
    succeeded."""
    env = {**(os.environ if env is None else env), "TMPDIR": tmp, "OMP_NUM_THREADS": "1"}
    job = os.path.join(os.path.dirname(os.path.abspath(__file__)), job)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(nproc), job, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_cli(*args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m shardloader ARGS`` in a subprocess, as a user runs it: its exit code and
    output (undecodable bytes replaced), whatever they are."""
    return subprocess.run(
        [sys.executable, "-m", "shardloader", *map(str, args)],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
    )


def batch_ids(batch: dict) -> list[int]:
    return [int(i) for i in batch["__index__"]]


def workers_left(seconds: float = 2.0) -> list[Any]:
    """This process's child processes still alive after ``seconds`` (DataLoader workers end
    within well under a second once told to)."""
    import multiprocessing

    deadline = time.monotonic() + seconds
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    return multiprocessing.active_children()
