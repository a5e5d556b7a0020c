"""Decompression bombs and lying counts: memory stays flat, the cache stays clean.

Each test runs the code under test in a child interpreter (tests/memcheck.py) and holds the
growth of its process tree's resident memory under ``MEMORY_BOUND`` (200 MB) while it handles a
bomb of at least 1 GiB, built on the fly (a GiB of zeros streams through zstandard into ~32 KiB).
"""

from __future__ import annotations

import os

import pytest
from hostile import (
    GIB,
    MEMORY_BOUND,
    shard_entry,
    sidecar,
    tar_bytes,
    tar_header,
    write_manifest,
    write_zstd_bomb,
)
from memcheck import run_measured


@pytest.fixture(scope="module")
def bomb_dataset(tmp_path_factory) -> str:
    """A 64 KiB .tar.zst holding one 2 GiB member; its sha256 is right, its raw size a lie."""
    d = str(tmp_path_factory.mktemp("bomb"))
    write_zstd_bomb(os.path.join(d, "shard-00000.tar.zst"), 2 * GIB)
    index = sidecar(["b/0000"], [0], [1024], checksums=[0])
    entry = shard_entry(d, "shard-00000.tar.zst", index, raw_bytes=4096)
    write_manifest(d, "tar", "zstd", [entry])
    return d


def _cache_files(cache: str) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(cache):
        for name in names:
            out[name] = os.path.getsize(os.path.join(dirpath, name))
    return out


@pytest.mark.slow
@pytest.mark.subprocess
def test_reading_a_bomb_stops_at_the_declared_size(bomb_dataset, tmp_path):
    cache = str(tmp_path / "cache")
    out = run_measured(
        f"""
        import shardloader as sl
        options = sl.CacheOptions(dir={cache!r}, max_bytes=64 << 20)
        ds = sl.ShardedDataset({bomb_dataset!r}, read=sl.ReadOptions(cache=options))
        """,
        "next(iter(ds))",
    )
    assert out["growth"] < MEMORY_BOUND, out
    error = out["error"]
    assert error is not None and error["type"] == "ShardError", error
    assert "shard-00000.tar.zst" in error["message"]
    assert "goes past the 4,096 bytes the manifest declares" in error["message"]
    files = _cache_files(cache)  # nothing staged, no temp file left: only the cache's marker
    assert not [n for n in files if n.endswith(".raw") or ".tmp-" in n], files
    assert sum(files.values()) < 4096, files


def test_an_honest_bomb_does_not_fit_the_cache_limit(bomb_dataset, tmp_path):
    """Declared truthfully, the same shard is refused by the cache limit before any staging."""
    import json

    import shardloader as sl

    d = tmp_path / "honest"
    d.mkdir()
    for name in ("shard-00000.tar.zst", "shard-00000.idx.arrow"):
        os.symlink(os.path.join(bomb_dataset, name), d / name)
    with open(os.path.join(bomb_dataset, "index.json")) as f:
        raw = json.load(f)
    raw["shards"][0]["raw_bytes"] = 2 * GIB + 1536
    (d / "index.json").write_text(json.dumps(raw))
    options = sl.CacheOptions(dir=str(tmp_path / "cache"), max_bytes=64 << 20)
    ds = sl.ShardedDataset(str(d), read=sl.ReadOptions(cache=options))
    with pytest.raises(sl.UsageError, match="cache limit"):
        next(iter(ds))
    assert not [n for n in _cache_files(str(tmp_path / "cache")) if n.endswith(".raw")]


@pytest.mark.slow
@pytest.mark.subprocess
def test_verify_refuses_a_bomb_member_from_its_header(bomb_dataset):
    out = run_measured(
        """
        from shardloader.read.verify import verify_dataset
        """,
        f"""
        report = verify_dataset({bomb_dataset!r}, images=False)
        result = [list(b.reasons) for b in report.bad]
        """,
    )
    assert out["error"] is None, out["error"]
    [reasons] = out["result"]
    assert any("declares 2,147,483,648 bytes, more than the 1,024 allowed" in r for r in reasons)
    assert out["growth"] < MEMORY_BOUND, out


@pytest.mark.slow
@pytest.mark.subprocess
def test_index_refuses_a_bomb_member_from_its_header(tmp_path):
    d = str(tmp_path)
    write_zstd_bomb(os.path.join(d, "big.tar.zst"), 2 * GIB)
    out = run_measured(
        "from shardloader.pack.index_existing import index_shards",
        f"index_shards([{d + '/big.tar.zst'!r}], {d!r})",
    )
    error = out["error"]
    assert error is not None and error["type"] == "ShardError", error
    assert "big.tar.zst" in error["message"] and "'b/0000.bin'" in error["message"]
    assert f"more than the {GIB:,} allowed" in error["message"]  # the default member limit
    assert out["growth"] < MEMORY_BOUND, out
    assert not os.path.exists(os.path.join(d, "index.json"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_index_streams_a_big_member_with_flat_memory(tmp_path):
    """Without a member limit a 1 GiB member is indexed, streamed in bounded chunks."""
    d = str(tmp_path)
    write_zstd_bomb(os.path.join(d, "big.tar.zst"), GIB)
    out = run_measured(
        "from shardloader.pack.index_existing import index_shards",
        f"""
        m = index_shards([{d + "/big.tar.zst"!r}], {d!r}, max_member_bytes=0).manifest
        result = [m.shards[0].num_samples, m.shards[0].raw_bytes]
        """,
    )
    assert out["error"] is None, out["error"]
    assert out["result"] == [1, 512 + GIB + 1024]
    assert out["growth"] < MEMORY_BOUND, out


@pytest.mark.slow
@pytest.mark.subprocess
def test_sample_reader_never_copies_past_the_sample_extent(tmp_path):
    """A member header that claims 1 GiB inside a 1 KiB sample: refused, nothing copied."""
    import xxhash

    d = str(tmp_path)
    path = os.path.join(d, "shard-00000.tar")
    first = tar_header("b/0000.bin", GIB) + b"x" * 512  # sample 0: 1 KiB in the sidecar
    with open(path, "wb") as f:
        f.write(first)
        f.write(tar_header("b/0001.bin", GIB))  # sample 1: a real 1 GiB member (sparse zeros)
        f.truncate(len(first) + 512 + GIB + 1024)
    size = os.path.getsize(path)
    index = sidecar(
        ["b/0000", "b/0001"],
        [0, 1024],
        [1024, 512 + GIB],
        checksums=[xxhash.xxh3_64_intdigest(first), 0],
    )
    write_manifest(d, "tar", "none", [shard_entry(d, "shard-00000.tar", index, sha256="0" * 64)])
    out = run_measured(
        f"""
        import shardloader as sl
        ds = sl.ShardedDataset({d!r})
        """,
        "next(iter(ds))",
    )
    error = out["error"]
    assert error is not None and error["type"] == "ShardError", error
    assert "'b/0000.bin'" in error["message"] and "1,024 bytes" in error["message"]
    assert out["growth"] < MEMORY_BOUND, out
    assert size > GIB


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("count", [10**9, 10**12])
def test_lying_sample_count_fails_on_load_before_planning(tmp_path, count):
    d = str(tmp_path)
    with open(os.path.join(d, "shard-00000.tar"), "wb") as f:
        f.write(tar_bytes([("s/0.bin", b"abc")]))
    entry = shard_entry(d, "shard-00000.tar", sidecar(["s/0"], [0], [1024]), num_samples=count)
    write_manifest(d, "tar", "none", [entry])
    out = run_measured(
        "import shardloader as sl",
        f"""
        ds = sl.ShardedDataset({d!r}, batch_size=4)
        result = len(ds)
        """,
    )
    error = out["error"]
    assert error is not None and error["type"] == "ManifestError", error
    assert "shards[0] (shard-00000.tar).num_samples" in error["message"]
    assert f"{count:,} samples cannot fit" in error["message"]
    assert out["growth"] < MEMORY_BOUND, out
