"""What the node cache holds can go wrong after it was staged: a damaged staged copy is staged
again from the source (once), and if the source is damaged too the error says so, naming the
cache file; two shard paths never share a cache file; a full cache disk is one line naming the
cache folder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pytest
from helpers import batch_ids, payload, write_dataset

import shardloader as sl
from shardloader.manifest import SampleIndex
from shardloader.storage.cache import CacheOptions, ShardCache


def _dataset(out: Path | str, root: Path, **kw: object) -> sl.ShardedDataset:
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(root)), readahead=0)
    return sl.ShardedDataset(str(out), batch_size=3, read=read, **kw)  # type: ignore[arg-type]


def _epoch(ds: sl.ShardedDataset, num_workers: int = 0) -> dict[int, bytes]:
    """Sample id -> its bytes, over one epoch."""
    out = {}
    for batch in sl.make_loader(ds, num_workers=num_workers):
        for i, data in zip(batch_ids(batch), batch["bin"], strict=True):
            out[i] = bytes(data)
    return out


def _expected(n: int) -> dict[int, bytes]:
    return {i: payload(i) for i in range(n)}


def _staged(root: Path, ds: sl.ShardedDataset, shard: int) -> Path:
    cache = ShardCache(CacheOptions(dir=str(root)), ds.manifest.fingerprint)
    return Path(cache.path_for(ds.manifest.shards[shard].path))


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[512 + 5] ^= 0x10  # inside the first sample's data
    elif how == "truncate":
        del data[len(data) // 2 :]
    else:
        data = bytearray()
    path.write_bytes(bytes(data))


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, Path]:
    out, root = tmp_path / "ds", tmp_path / "cache"
    write_dataset(str(out), [6, 6], compression="zstd")  # zstd: always staged
    return out, root


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_staged_copy_is_staged_again(packed: tuple[Path, Path], how: str) -> None:
    out, root = packed
    ds = _dataset(out, root)
    assert _epoch(ds) == _expected(12)
    copy = _staged(root, ds, 1)
    good = copy.read_bytes()
    _damage(copy, how)
    assert _epoch(_dataset(out, root)) == _expected(12)  # read as if nothing happened
    assert copy.read_bytes() == good  # and the copy is whole again


def test_workers_that_find_one_damaged_copy_stage_it_again_once(
    packed: tuple[Path, Path],
) -> None:
    out, root = packed
    ds = _dataset(out, root)
    assert _epoch(ds) == _expected(12)
    copies = [_staged(root, ds, s) for s in (0, 1)]
    goods = [c.read_bytes() for c in copies]
    for c in copies:
        _damage(c, "flip")
    assert _epoch(_dataset(out, root), 2) == _expected(12)
    assert [c.read_bytes() for c in copies] == goods


def _wrong_sidecar_checksum(out: Path, shard: int) -> None:
    """Damage the source consistently: sample 0's checksum in the sidecar is wrong, and the
    manifest's digest of the sidecar follows (the shard's SHA-256 still matches)."""
    raw = json.loads((out / "index.json").read_text())
    entry = raw["shards"][shard]
    index = SampleIndex.from_arrow_bytes((out / entry["index_path"]).read_bytes())
    assert index.checksums is not None
    sums = index.checksums.copy()
    sums[0] ^= 1
    data = SampleIndex(index.keys, index.offsets, index.sizes, index.lengths, sums)
    blob = data.to_arrow_bytes()
    (out / entry["index_path"]).write_bytes(blob)
    entry["index_sha256"] = hashlib.sha256(blob).hexdigest()
    (out / "index.json").write_text(json.dumps(raw))
    pa.default_memory_pool().release_unused()


def test_a_source_damaged_too_is_named_with_its_cache_file(packed: tuple[Path, Path]) -> None:
    out, root = packed
    _wrong_sidecar_checksum(out, 1)
    ds = _dataset(out, root)
    with pytest.raises(sl.ChecksumError) as err:
        _epoch(ds)
    text = str(err.value)
    assert str(_staged(root, ds, 1)) in text and "staged again from the source" in text
    assert "`shardloader cache clear`" in text and "damaged too" in text


def test_a_damaged_copy_whose_source_changed_names_both(packed: tuple[Path, Path]) -> None:
    out, root = packed
    ds = _dataset(out, root)
    assert _epoch(ds) == _expected(12)
    copy = _staged(root, ds, 0)
    _damage(copy, "flip")
    shard = out / ds.manifest.shards[0].path
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0xFF  # the stored shard no longer hashes to the manifest's SHA-256
    shard.write_bytes(bytes(data))
    with pytest.raises(sl.ChecksumError) as err:
        _epoch(_dataset(out, root))
    text = str(err.value)
    assert "stored bytes hash to" in text and str(copy) in text, text
    assert "`shardloader cache clear`" in text


# -- names -----------------------------------------------------------------------------------------


def test_shard_paths_that_used_to_share_a_cache_file_do_not(tmp_path: Path) -> None:
    out, root = tmp_path / "ds", tmp_path / "cache"
    write_dataset(str(out), [5, 7], compression="zstd")
    raw = json.loads((out / "index.json").read_text())
    (out / "a").mkdir()
    for entry, name in zip(raw["shards"], ["a/b.tar.zst", "a__b.tar.zst"], strict=True):
        os.rename(out / entry["path"], out / name)
        entry["path"] = name
    (out / "index.json").write_text(json.dumps(raw))
    ds = _dataset(out, root)
    assert _epoch(ds) == _expected(12)
    names = {_staged(root, ds, s).name for s in (0, 1)}
    assert len(names) == 2 and all(n.endswith(".raw") for n in names)


def test_cache_names_are_one_to_one_and_short() -> None:
    from shardloader.storage.cachedir import cache_name

    paths = ["a/b", "a__b", "a%2Fb", "a%252Fb", "a b", "ä/b", "=x", "x" * 300, "x" * 301]
    names = [cache_name(p) for p in paths]
    assert len(set(names)) == len(names)
    assert all(len(n) <= 210 and "/" not in n for n in names)


# -- a full disk -------------------------------------------------------------------------------

_FULL_DISK = """
import json, sys
import shardloader as sl
read = sl.ReadOptions(cache=sl.CacheOptions(dir=sys.argv[2], max_bytes=1 << 40), readahead=0)
ds = sl.ShardedDataset(sys.argv[1], batch_size=4, read=read)
try:
    list(sl.make_loader(ds, num_workers=0))
    print(json.dumps(None))
except Exception as err:
    print(json.dumps({"type": type(err).__name__, "message": str(err)}))
"""


@pytest.mark.slow
@pytest.mark.subprocess  # a tmpfs of 1 MiB, mounted in a user namespace of its own
def test_a_full_cache_disk_is_one_line_naming_the_cache_folder(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    out, mnt = tmp_path / "ds", tmp_path / "mnt"
    mnt.mkdir()
    write_dataset(str(out), [400, 400], compression="zstd")  # ~80 KiB stored, 2 x 1.5 MiB raw
    root = mnt / "cache"
    script = textwrap.dedent(_FULL_DISK)
    shell = (
        f"mount -t tmpfs -o size=1m tmpfs {mnt} && "
        f"exec {sys.executable} -c {_quote(script)} {out} {root}"
    )
    r = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    if r.returncode != 0 and "mount" in r.stderr and not r.stdout:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[-200:]}")
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got is not None and got["type"] == "StorageError", (got, r.stderr[-2000:])
    message = got["message"]
    assert "\n" not in message
    assert f"shard cache at {root}" in message and "ran out of disk space" in message, message
    assert str(out) not in message  # the cache folder is the problem, not the source shard


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_a_damaged_cached_sidecar_of_a_remote_dataset_is_fetched_again(
    static_site: tuple[str, Path], tmp_path: Path
) -> None:
    base, www = static_site
    write_dataset(str(www / "ds"), [6], compression="gzip")  # gzip: no index inside the shard
    root = tmp_path / "cache"
    ds = _dataset(f"{base}/ds", root)
    assert _epoch(ds) == _expected(6)
    cache = ShardCache(CacheOptions(dir=str(root)), ds.manifest.fingerprint)
    copy = Path(cache.path_for(ds.manifest.shards[0].index_path))
    good = copy.read_bytes()
    copy.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    assert _epoch(_dataset(f"{base}/ds", root)) == _expected(6)
    assert copy.read_bytes() == good
