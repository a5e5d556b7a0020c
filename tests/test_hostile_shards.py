"""Damaged tar, token, Arrow and Parquet shards end in a clear error naming the shard, never a
crash, a traceback or a silent pass (the promise: "Bad input gets a clear error and loses nothing").

A hostile or buggy producer can write a damaged shard *and* its matching sha256 into
index.json; then only the shard's own structure and per-sample checksums stand between the
damage and the user.  The fuzz (tools/fuzz_shards.py, fixed seeds) runs ``verify``, ``inspect``
and a full read of each damaged copy in a child process, so a crash fails this test instead of
ending pytest.
"""

from __future__ import annotations

import io
import json
import os
import random

import fuzz_shards
import pytest
import zstandard

import shardloader as sl
from shardloader.errors import ShardError
from shardloader.format.compress import decompressed, decompressing
from shardloader.format.embedded import MAGIC, Carried, carried_index, index_frame
from shardloader.format.registry import get_format
from shardloader.read.verify import verify_dataset

RUNS = 20  # cases per format and compression


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("fuzz"))


@pytest.mark.parametrize("fmt", ["tar", "tokens"])
def test_damaged_shards_fail_naming_the_shard_or_read_the_same(work: str, fmt: str) -> None:
    combos = [(fmt, comp) for comp in ("none", "zstd", "gzip")]
    outcomes = list(fuzz_shards.fuzz(work, RUNS, 12, combos, fix_share=0.8, sidecars=0.0))
    bad = [(os.path.basename(case), done, wrong) for case, done, wrong, _ in outcomes if wrong]
    assert not bad, "\n".join(map(str, bad))
    assert len(outcomes) == 3 * RUNS
    caught = sum(result["verify"][0] == "error" for *_, result in outcomes)
    assert caught > RUNS  # the damage mostly tells: the fuzz is not a no-op


def _no_bad(outcomes: list[tuple[str, dict, list[str], dict]]) -> None:
    bad = [(os.path.basename(case), done, wrong) for case, done, wrong, _ in outcomes if wrong]
    assert not bad, "\n".join(map(str, bad))


def test_arrow_shards_damaged_where_pyarrow_trusts_them_fail_naming_the_shard(work: str) -> None:
    # offsets, message metadata and footer, with the checksum rewritten: pyarrow reads values
    # through them unchecked (a segfault or an abort, before each batch was validated)
    combos = [("arrow", "none")]
    _no_bad(list(fuzz_shards.fuzz(work, RUNS, 5, combos, 1.0, sidecars=0.0, hows=["inner"])))
    combos = [("arrow", "zstd")]
    _no_bad(list(fuzz_shards.fuzz(work, RUNS, 6, combos, fix_share=0.8, sidecars=0.0)))


def test_damaged_sidecars_fail_naming_the_shard(work: str) -> None:
    # the sidecar alone, its index_sha256 rewritten: its Arrow table is read before any sample
    combos = [("tar", "none"), ("arrow", "none"), ("tokens", "none")]
    hows = ["bytes", "bytes", "cut", "insert"]
    outcomes = list(fuzz_shards.fuzz(work, RUNS, 7, combos, 1.0, 1.0, hows, shard=False))
    _no_bad(outcomes)
    assert sum(result["verify"][0] == "error" for *_, result in outcomes) > RUNS


def _cut_zstd_tar(tmp_path, at) -> tuple[str, str]:
    """A packed zstd tar dataset whose first shard is cut at ``at(shard bytes)``, with the
    manifest's sha256 and sizes made to match (a producer that wrote them after the damage)."""
    src = fuzz_shards.make_source(str(tmp_path / "src"), n=20)
    out = str(tmp_path / "out")
    fuzz_shards.pack_template(src, out, "tar", "zstd")
    with open(os.path.join(out, "index.json")) as f:
        manifest = json.load(f)
    entry = manifest["shards"][0]
    path = os.path.join(out, entry["path"])
    with open(path, "rb") as f:
        data = f.read()
    data = data[: at(data)]
    with open(path, "wb") as f:
        f.write(data)
    entry["bytes"] = len(data)
    entry["sha256"] = fuzz_shards.hashlib.sha256(data).hexdigest()
    manifest["bytes"] = sum(s["bytes"] for s in manifest["shards"])
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(manifest, f)
    return out, path


def _index_frame_start(data: bytes) -> int:
    return data.rindex(MAGIC.to_bytes(4, "little"))  # the skippable frame the index rides in


@pytest.mark.parametrize(
    "at",
    [
        lambda d: len(d) - 3,
        lambda d: _index_frame_start(d) - 2,
        lambda d: _index_frame_start(d) + 5,
    ],
    ids=["in-the-index-frame", "in-the-tar-frame", "in-the-frame-header"],
)
def test_a_zstd_tar_cut_mid_stream_fails_where_it_is_read(tmp_path, at) -> None:
    out, path = _cut_zstd_tar(tmp_path, at)
    with open(path, "rb") as f, pytest.raises(ShardError, match="truncated shard"):
        for _ in get_format("tar").iter_stored(f, "zstd", "the shard"):
            pass
    report = verify_dataset(out)
    assert [p.path for p in report.bad] == [os.path.basename(path)]
    assert "truncated" in "; ".join(report.bad[0].reasons)
    opts = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    with pytest.raises(ShardError, match=os.path.basename(path)):
        list(sl.ShardedDataset(out, decoder=None, read=opts))


def test_a_zstd_stream_is_whole_only_at_a_frame_end() -> None:
    data = random.Random(1).randbytes(1000) + b"a" * 300_000
    frames = [zstandard.ZstdCompressor(level=3, write_checksum=c).compress(data) for c in (0, 1)]
    stream = frames[0] + frames[1] + b"\x50\x2a\x4d\x18" + (5).to_bytes(4, "little") + b"hello"
    ends = {len(frames[0]), len(frames[0]) + len(frames[1]), len(stream)}
    for cut in sorted(ends | set(random.Random(2).sample(range(len(stream)), 60))):
        reader = decompressed(io.BytesIO(stream[:cut]), "zstd")
        if cut in ends:
            while reader.read(1 << 16):
                pass
            continue
        with pytest.raises(ShardError), decompressing():  # zstd's own error or the cut's
            while reader.read(1 << 16):
                pass


def test_damaged_parquet_files_fail_naming_the_file(work: str) -> None:
    # Parquet files adopted by `index`: footer (Thrift metadata), page headers and pages
    # damaged with the checksum and sizes rewritten; a column name that is not UTF-8 in the
    # footer (seed 6) and a text cell that is not (a plain page) were tracebacks before
    combos = [("parquet", "none")]
    outcomes = list(fuzz_shards.fuzz(work, 30, 6, combos, 1.0, sidecars=0.0, hows=["inner"]))
    outcomes += fuzz_shards.fuzz(work, RUNS, 8, combos, fix_share=0.8, sidecars=0.25)
    _no_bad(outcomes)
    assert sum(result["verify"][0] == "error" for *_, result in outcomes) > RUNS


def test_damaged_hugging_face_parquet_files_fail_naming_the_file_or_read_the_same(
    work: str,
) -> None:
    # files written by `datasets` (Image structs, ClassLabel, Sequence, string), their
    # `huggingface` features JSON damaged where pyarrow reads it (seed 1: a ClassLabel's names
    # became `1`, a TypeError traceback in verify and read before), then any damage
    combos = [("hf-parquet", "none")]
    outcomes = list(fuzz_shards.fuzz(work, 100, 1, combos, 1.0, sidecars=0.0, hows=["meta"]))
    assert sum(result["read"][0] == "ok" for *_, result in outcomes) > 50  # rows intact: read
    outcomes += fuzz_shards.fuzz(work, RUNS, 9, combos, fix_share=0.8, sidecars=0.25)
    _no_bad(outcomes)
    assert sum(result["verify"][0] == "error" for *_, result in outcomes) > RUNS


@pytest.mark.parametrize(
    "metadata",
    [
        b'{"info": {"features": {"label": {"_type": "Class',
        b'{"info": ["features"]}',
        b'{"info": {"features": {"label": {"names": 1, "_type": "ClassLabel"}}}}',
    ],
    ids=["not-json", "not-a-mapping", "names-not-a-list"],
)
def test_index_refuses_damaged_hugging_face_metadata_naming_the_file(tmp_path, metadata) -> None:
    # the features give the classes and codecs: index names the file, never drops them unsaid
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardloader.errors import InputError
    from shardloader.pack.index_existing import index_shards

    table = pa.table({"label": [0, 1]}).replace_schema_metadata({"huggingface": metadata})
    pq.write_table(table, tmp_path / "t.parquet")
    with pytest.raises(InputError, match=r"t\.parquet: its 'huggingface' schema metadata"):
        index_shards([str(tmp_path / "t.parquet")], str(tmp_path))


def test_a_parquet_text_cell_that_is_not_utf8_fails_naming_the_file(tmp_path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardloader.pack.index_existing import index_shards

    path = tmp_path / "t.parquet"
    plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}
    pq.write_table(pa.table({"text": ["caption one", "caption two"]}), path, **plain)
    index_shards([str(path)], str(tmp_path))
    # one byte of a cell's text, its row checksum left as indexed: what checks the cell fails
    data = path.read_bytes().replace(b"caption two", b"caption tw\xff")
    path.write_bytes(data)
    manifest = json.loads((tmp_path / "index.json").read_text())
    manifest["shards"][0]["sha256"] = fuzz_shards.hashlib.sha256(data).hexdigest()
    (tmp_path / "index.json").write_text(json.dumps(manifest))
    report = verify_dataset(str(tmp_path))
    assert [p.path for p in report.bad] == ["t.parquet"]
    assert "cannot be read" in "; ".join(report.bad[0].reasons)
    opts = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    with pytest.raises(ShardError, match=r"t\.parquet.*row group 0 cannot be read"):
        list(sl.ShardedDataset(str(tmp_path), decoder=None, read=opts))


def test_a_damaged_embedded_index_is_passed_over_for_the_sidecar(work: str) -> None:
    # a zstd tar's embedded sample index (its frame's magic, lengths or Arrow bytes) damaged,
    # the shard's checksum rewritten: a remote read (memory://), which takes the index from
    # the shard, reads what verify and a local read do (it failed on the index before, or on
    # a sample's checksum the damage changed, where verify passed)
    combos = [("tar", "zstd")]
    outcomes = list(fuzz_shards.fuzz(work, 2 * RUNS, 3, combos, 1.0, sidecars=0.0, hows=["frame"]))
    _no_bad(outcomes)
    assert sum(result["remote"][0] == "ok" for *_, result in outcomes) > RUNS // 2


def test_an_embedded_index_is_taken_only_whole() -> None:
    frame = index_frame(b"index bytes")
    assert carried_index(b"zstd data" + frame) == Carried(b"index bytes", whole=True)
    for at in range(8, len(frame) - 8):  # any byte of the index or its digest
        damaged = bytearray(frame)
        damaged[at] ^= 1
        found = carried_index(b"zstd data" + bytes(damaged))
        assert found is not None and not found.whole  # readers pass it over (keep_embedded)
    # a frame written before the digest (SLI1) is still read
    legacy = b"index bytes" + (11).to_bytes(4, "little") + b"SLI1"
    legacy = MAGIC.to_bytes(4, "little") + len(legacy).to_bytes(4, "little") + legacy
    assert carried_index(b"zstd data" + legacy) == Carried(b"index bytes", whole=True)
