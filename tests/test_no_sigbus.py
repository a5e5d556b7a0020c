"""No SIGBUS: a shard file truncated while a DataLoader worker has it mapped.

For each format (tar, Arrow, tokens) the file a worker reads through a memory map is truncated
between two batches, as ``cp`` or ``rsync --inplace`` over it would.  The truncation happens
while the worker waits in a transform (:class:`Gate`), so no read of the map is in flight: the
test checks what the next read does, and a truncation in the middle of one read (a window of
microseconds that the size check before each read cannot close) cannot make it flaky:

- an uncompressed local shard read in place: the training process gets a ShardError naming
  the shard ("changed while reading"), and can go on;
- a shard's staged copy in the node cache: the copy is staged again from the source and the
  epoch completes, every sample exactly once.

Before, touching the mapping past the new end of the file killed the worker with SIGBUS (torch
reports "killed by signal: Bus error"), or with ``num_workers=0`` the training process itself.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from corpus import WORDS, packed_docs
from helpers import write_dataset

import shardloader as sl
from shardloader.manifest import Manifest
from shardloader.storage.cachedir import cache_name

FORMATS = ("tar", "arrow", "tokens")
SAMPLES = 120  # in one shard: a worker cannot have read it all when the first batch arrives


def make(root: Path, fmt: str, compression: str) -> str:
    """One shard of ``SAMPLES`` samples; the dataset's folder."""
    if fmt != "tokens":
        out = str(root / f"{fmt}-{compression}")
        write_dataset(out, [SAMPLES], fmt=fmt, compression=compression)
        return out
    rng = np.random.default_rng(3)
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 40)) for _ in range(SAMPLES)]
    return packed_docs(
        str(root / f"tok-{compression}"), texts, format="tokens", compression=compression
    )


class Gate:
    """A transform that, at the worker's third sample (the first of its second batch), says
    so in ``ready`` and waits for ``go``: the batch's samples are read by then and the next
    batch's are not, so whatever happens to the shard meanwhile meets the next read."""

    def __init__(self, folder: Path) -> None:
        self.ready, self.go, self.calls = folder / "ready", folder / "go", 0

    def __call__(self, sample: Any) -> Any:
        self.calls += 1
        if self.calls == 3:
            self.ready.touch()
            deadline = time.monotonic() + 60
            while not self.go.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        return sample


def truncate_when_ready(gate: Gate, path: str) -> threading.Thread:
    """Truncate ``path`` once the gated worker waits, then let it go (in a thread: the loop
    itself waits for the worker's batch)."""

    def run() -> None:
        deadline = time.monotonic() + 60
        while not gate.ready.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        truncate(path)
        gate.go.touch()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def read(path: str, cache: Path, gate: Gate | None = None) -> Any:
    options = sl.ReadOptions(cache=sl.CacheOptions(dir=str(cache)), readahead=0)
    return sl.ShardedDataset(path, batch_size=2, read=options, transform=gate)


def truncate(path: str) -> None:
    with open(path, "r+b") as f:  # in place, like `cp` over it: same inode, fewer bytes
        f.truncate(os.path.getsize(path) // 4)


def staged_copy(cache: Path, shard: str) -> str:
    name = cache_name(shard)
    found = [os.path.join(d, name) for d, _, files in os.walk(cache) if name in files]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_shard_truncated_in_place_under_a_worker_is_a_shard_error(tmp_path: Path, fmt: str):
    path = make(tmp_path, fmt, "none")
    gate = Gate(tmp_path)
    ds = read(path, tmp_path / "cache", gate)
    shard = Manifest.from_json(Path(path, "index.json").read_bytes()).shards[0].path
    loader = sl.make_loader(ds, num_workers=1)
    thread = truncate_when_ready(gate, os.path.join(path, shard))
    with pytest.raises(sl.ShardError) as info:
        for _ in loader:
            pass
    thread.join()
    assert "changed while reading" in str(info.value) and shard in str(info.value)
    info.value.__traceback__ = None  # let the worker go now (tests/test_s3_end_to_end.py)
    del info, loader


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_staged_copy_truncated_under_a_worker_is_staged_again(tmp_path: Path, fmt: str):
    path = make(tmp_path, fmt, "zstd")
    cache = tmp_path / "cache"
    gate = Gate(tmp_path)
    ds = read(path, cache, gate)
    shard = Manifest.from_json(Path(path, "index.json").read_bytes()).shards[0].path
    ids: list[int] = []
    loader = sl.make_loader(ds, num_workers=1)
    thread: threading.Thread | None = None
    for batch in loader:
        ids += [int(i) for i in batch["__index__"]]
        if thread is None:  # staged by now: the first batch came from it
            thread = truncate_when_ready(gate, staged_copy(cache, shard))
    assert thread is not None
    thread.join()
    del loader
    assert sorted(ids) == list(range(SAMPLES))  # every sample once, none lost to the damage
    assert os.path.getsize(staged_copy(cache, shard)) > 0


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_token_rows_from_a_truncated_token_shard(tmp_path: Path, compression: str):
    """TokenBlocks reads token rows straight out of the map: the same check, the same outcome.

    In the loop's own process (no transform to gate a worker with): the truncation between two
    batches then never meets a read in flight, and the worker path is the tests above."""
    path = make(tmp_path, "tokens", compression)
    cache = tmp_path / "cache"
    options = sl.ReadOptions(cache=sl.CacheOptions(dir=str(cache)), readahead=0)
    ds = sl.ShardedDataset(path, planner=sl.TokenBlocks(8, 1, pad_id=0), read=options)
    shard = Manifest.from_json(Path(path, "index.json").read_bytes()).shards[0].path
    target = os.path.join(path, shard) if compression == "none" else None
    rows, loader = 0, sl.make_loader(ds, num_workers=0)
    if compression == "none":
        with pytest.raises(sl.ShardError, match="changed while reading") as info:
            for n, _ in enumerate(loader):
                if n == 0:
                    truncate(str(target))
        info.value.__traceback__ = None
        del info, loader
        return
    for n, batch in enumerate(loader):
        rows += len(batch["input_ids"])
        if n == 0:
            truncate(staged_copy(cache, shard))
    del loader
    assert rows == len(ds)
