"""What the node cache holds is counted rarely: never to read shards staged already, once for
many shards staged in a row (NOTE [room note] in storage/cache.py), and the one limit
still holds.  Counting means listing and stat-ing every file under the root, which for a root
of many small shards took longer than a warm first batch."""

from __future__ import annotations

import os
import time

from helpers import batch_ids, write_dataset

import shardloader as sl
from shardloader.storage import cache as sc
from shardloader.storage import cachedir


def _dataset(path, root, shards=(8,) * 12, max_bytes=None) -> sl.ShardedDataset:
    if not os.path.exists(os.path.join(path, "index.json")):
        write_dataset(str(path), list(shards), compression="zstd")  # zstd: always staged
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(root), max_bytes=max_bytes), readahead=0)
    return sl.ShardedDataset(str(path), batch_size=4, shuffle=True, read=read)


def _counting_listings(monkeypatch) -> list[str]:
    """Every listing of a dataset folder of the cache, wherever it is made from."""
    calls: list[str] = []
    real = cachedir.staged_entries

    def listing(folder):
        calls.append(folder)
        return real(folder)

    monkeypatch.setattr(cachedir, "staged_entries", listing)  # usage() and clear()
    monkeypatch.setattr(sc, "staged_entries", listing)  # eviction
    return calls


def _epoch(ds) -> list[int]:
    return sorted(i for b in sl.make_loader(ds, num_workers=0) for i in batch_ids(b))


def test_a_warm_pass_lists_nothing_under_the_root(monkeypatch, tmp_path):
    root = tmp_path / "root"
    _dataset(tmp_path / "other", root, shards=(4,) * 5)  # the root holds another dataset too
    assert _epoch(_dataset(tmp_path / "other", root)) == list(range(20))
    assert _epoch(_dataset(tmp_path / "ds", root)) == list(range(96))  # stages every shard
    monkeypatch.setattr(cachedir, "DEFAULT_MAX_BYTES", 1 << 62)  # not the free-space shortcut
    calls = _counting_listings(monkeypatch)
    assert _epoch(_dataset(tmp_path / "ds", root)) == list(range(96))
    assert calls == []


def test_staging_many_shards_counts_the_root_once_not_per_shard(monkeypatch, tmp_path):
    root = tmp_path / "root"
    ds = _dataset(tmp_path / "ds", root, max_bytes=1 << 30)
    calls = _counting_listings(monkeypatch)
    assert _epoch(ds) == list(range(96))
    staged = [f for f in os.listdir(root / ds.manifest.fingerprint) if f.endswith(".raw")]
    assert len(staged) >= 12  # every shard (and sample indexes) went through a reservation
    assert 1 <= len(calls) <= 2  # the first reservation counted; a recount only if it aged


def test_the_limit_holds_when_the_note_says_there_is_room(tmp_path):
    """A note that says the root is nearly empty while it is full is believed only until it
    ages; a note that is too high makes the next stager count and evict as before."""
    root = str(tmp_path / "root")
    cache = sc.ShardCache(sc.CacheOptions(dir=root, max_bytes=3000), "fp")
    for name in ("a", "b", "c"):
        _stage(cache, name, 1000)
    sc.note_room(root, 10**9, time.time())  # far too high: counted again, a evicted
    _stage(cache, "d", 1000)
    names = sorted(f for f in os.listdir(os.path.join(root, "fp")) if f.endswith(".raw"))
    assert len(names) == 3 and "d.raw" in names
    assert sc.noted_room(root)[0] == 3000  # the count, plus d's reservation


def test_a_note_is_read_only_while_fresh(tmp_path):
    root = str(tmp_path)
    assert sc.noted_room(root) is None
    counted = time.time()
    sc.note_room(root, 1234, counted)
    assert sc.noted_room(root) == (1234, counted)
    cache = sc.ShardCache(sc.CacheOptions(dir=root, max_bytes=3000), "fp")
    _stage(cache, "e", 100)  # fits the note: a reservation keeps the time of the last count
    assert sc.noted_room(root) == (1334, counted)
    sc.note_room(root, 2000, time.time() - sc.RECOUNT_SECONDS - 1)
    assert sc.noted_room(root) is None  # old: the next stager counts
    with open(os.path.join(root, cachedir.ROOM_NOTE), "wb") as f:
        f.write(b"garbage")
    assert sc.noted_room(root) is None


def test_the_default_limit_counts_the_root_only_on_a_small_disk(monkeypatch, tmp_path):
    calls = _counting_listings(monkeypatch)
    root = str(tmp_path / "root")
    os.makedirs(os.path.join(root, "fp"))
    open(os.path.join(root, "fp", cachedir.MARKER), "w").close()
    monkeypatch.setattr(cachedir, "DEFAULT_MAX_BYTES", 1 << 20)  # a disk of over 2 MiB free
    assert cachedir.cache_limit(root)[0] == 1 << 20
    assert calls == []
    monkeypatch.setattr(cachedir, "DEFAULT_MAX_BYTES", 1 << 62)  # as if the disk were small
    limit, source = cachedir.cache_limit(root)
    assert len(calls) == 1 and source.startswith("default: half of the")


def _stage(cache: sc.ShardCache, name: str, size: int) -> None:
    import hashlib
    import io

    data = name.encode() * size
    cache.get(
        name,
        len(data),
        hashlib.sha256(data).hexdigest(),
        name,
        lambda: io.BytesIO(data),
        lambda src, dst: dst.write(src.read()),
    )
    used = time.time() - 1000 + ord(name)  # a is the least recently used
    os.utime(cache.path_for(name), (used, used))
