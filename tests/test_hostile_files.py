"""A dataset's files are untrusted too: a FIFO (tar extracts them), a device or a huge file where
``index.json``, a shard or a sidecar should be is refused at once, never waited on or read
without end; sizes no shard can have are a named ManifestError before anything is allocated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers import in_thread, write_dataset

import shardloader as sl
from shardloader.errors import ManifestError, ShardloaderError
from shardloader.manifest import Manifest, read_manifest
from shardloader.read.shardset import ShardSet
from shardloader.read.verify import verify_dataset
from shardloader.storage.streams import BoundedReader


def refused_without_hanging(fn: Callable[[], Any], fifos: list[Path]) -> BaseException:
    """What ``fn`` raises; fails if it blocks on one of ``fifos`` (which are then opened for
    writing, to let it go, so the test ends either way)."""
    thread, out = in_thread(fn)
    thread.join(10)
    hung = thread.is_alive()
    if hung:
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        thread.join(10)
    assert not hung, "blocked on a FIFO"
    assert out and out[0] is not None, "read a FIFO as if it were data"
    return out[0]


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Manifest]:
    out = tmp_path / "ds"
    return out, write_dataset(str(out), [5, 5], compression="zstd")  # zstd: staged


def _as_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _dataset(out: Path) -> sl.ShardedDataset:
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(out) + "-cache"), readahead=0)
    return sl.ShardedDataset(str(out), decoder=None, read=read)


def test_a_fifo_as_index_json_is_refused(packed: tuple[Path, Manifest]) -> None:
    out, _ = packed
    fifo = _as_fifo(out / "index.json")
    err = refused_without_hanging(lambda: read_manifest(str(out)), [fifo])
    assert isinstance(err, ManifestError)
    assert "index.json" in str(err) and "FIFO" in str(err) and "not a regular file" in str(err)


@pytest.mark.parametrize("which", ["path", "index_path"])
def test_a_fifo_as_shard_or_sidecar_is_refused_by_read_and_verify(
    packed: tuple[Path, Manifest], which: str
) -> None:
    out, manifest = packed
    name = getattr(manifest.shards[1], which)
    fifo = _as_fifo(out / name)
    err = refused_without_hanging(lambda: list(_dataset(out)), [fifo])
    assert isinstance(err, ShardloaderError) and name in str(err) and "FIFO" in str(err), err
    report: list[Any] = []
    err = refused_without_hanging(lambda: report.append(verify_dataset(str(out))) or 1 / 0, [fifo])
    assert isinstance(err, ZeroDivisionError)  # verify returned: its report says why
    (problem,) = report[0].bad
    assert problem.path == manifest.shards[1].path
    assert any("FIFO" in r and name in r for r in problem.reasons), problem.reasons


def test_an_uncompressed_shard_that_is_a_device_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    manifest = write_dataset(str(out), [4], compression="none")  # read in place
    (out / manifest.shards[0].path).unlink()
    os.symlink("/dev/zero", out / manifest.shards[0].path)
    with pytest.raises(ShardloaderError, match="character device, not a regular file"):
        list(_dataset(out))


_READ_MANIFEST = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # main read these to MemoryError
from shardloader.errors import ManifestError
from shardloader.manifest import read_manifest
try:
    read_manifest(sys.argv[1])
except ManifestError as err:
    print(err)
"""


@pytest.mark.subprocess  # an address-space limit: a reader without a bound dies, not the tests
def test_an_endless_or_huge_index_json_is_refused_at_once(tmp_path: Path) -> None:
    zero, huge = tmp_path / "zero", tmp_path / "huge"
    zero.mkdir()
    huge.mkdir()
    os.symlink("/dev/zero", zero / "index.json")
    with open(huge / "index.json", "wb") as f:
        f.truncate(64 << 30)  # sparse: 64 GiB of nothing
    for folder, says in ((zero, "character device"), (huge, "larger than 256 MiB")):
        r = subprocess.run(
            [sys.executable, "-c", _READ_MANIFEST, str(folder)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and says in r.stdout, r.stdout + r.stderr[-2000:]


# -- sizes no shard can have -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("bytes", 10**15), ("raw_bytes", 10**15), ("num_samples", 2**33)],
)
def test_sizes_no_shard_can_have_are_a_manifest_error(
    packed: tuple[Path, Manifest], key: str, value: int
) -> None:
    out, _ = packed
    raw = json.loads((out / "index.json").read_text())
    shard = raw["shards"][0]
    shard["bytes"] = shard["raw_bytes"] = 10**13  # room for the count below
    shard[key] = value
    for k in ("bytes", "raw_bytes", "num_samples"):
        raw[k] = sum(s[k] for s in raw["shards"])
    (out / "index.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError) as err:
        read_manifest(str(out))
    text = str(err.value)
    assert f"shards[0] (shard-00000.tar.zst).{key}" in text, text
    assert f"{value:,}" in text and "more than any shard can hold" in text


def test_a_bounded_read_of_a_small_file_under_a_huge_bound_reads_the_file(
    tmp_path: Path,
) -> None:
    (tmp_path / "f").write_bytes(b"x" * 1000)
    with BoundedReader(open(tmp_path / "f", "rb"), 10**15, "f") as f:  # noqa: SIM115
        assert f.read() == b"x" * 1000
    with pytest.raises(sl.ChecksumError, match="larger than the 999 bytes"):
        BoundedReader(open(tmp_path / "f", "rb"), 999, "f")  # noqa: SIM115


def test_a_sidecar_bound_of_a_terabyte_reads_only_the_sidecar(tmp_path: Path) -> None:
    """A claim within the caps: reading its sidecar costs the sidecar, not the claim."""
    out = tmp_path / "ds"
    write_dataset(str(out), [3], compression="zstd")
    raw = json.loads((out / "index.json").read_text())
    raw["shards"][0]["raw_bytes"] = raw["raw_bytes"] = 1 << 40  # sidecar bound: 1 TiB
    raw["shards"][0]["bytes"] = raw["bytes"] = 1 << 40
    (out / "index.json").write_text(json.dumps(raw))
    manifest, base = read_manifest(str(out))
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(out) + "-cache"), readahead=0)
    assert len(ShardSet(manifest, base, read, "test").indexes.of(0)) == 3  # no 1 TiB allocation
