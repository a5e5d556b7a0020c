"""The contract every shard format keeps, as plain functions of (format name, compression).

tests/test_format_contract.py runs them over every registered format; tests/test_format_plugin.py
runs them over a format defined outside the package.  Each writes a small shard in ``tmp``.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass

import pytest

from shardloader.errors import ChecksumError, ShardError, UsageError
from shardloader.format import WrittenShard, get_format, open_writer
from shardloader.format.base import Rows, read_rows
from shardloader.format.embedded import carried_index, index_frame
from shardloader.manifest import FieldInfo, Manifest, SampleIndex, ShardInfo
from shardloader.schema import check_sample_index

FIELDS = {"bin": FieldInfo("bytes"), "txt": FieldInfo("text")}


def samples(n: int = 12) -> list[tuple[str, dict[str, bytes]]]:
    """Keys in order; a marked payload (found again in staged files) of varied size, one big
    sample (past the 64 KiB and 1 MiB chunk sizes of the stream readers), and a text field."""
    out = []
    for i in range(n):
        size = 1500 * 1024 if i == 5 else 37 * i + 1
        body = hashlib.sha256(b"%d" % i).digest() * (size // 32 + 1)
        out.append((f"s/{i:04d}", {"bin": b"MARK%04d" % i + body[:size], "txt": b"sample %d" % i}))
    return out


@dataclass
class Written:
    path: str
    stored: bytes
    shard: WrittenShard
    info: ShardInfo
    samples: list[tuple[str, dict[str, bytes]]]


def write(tmp: str, fmt: str, compression: str, n: int = 12) -> Written:
    data = samples(n)
    path = os.path.join(tmp, f"shard-{fmt}-{compression}{get_format(fmt).suffix(compression)}")
    with open(path, "wb") as f:
        writer = open_writer(fmt, f, compression, FIELDS)
        for key, fields in data:
            writer.add(key, fields, length=len(fields["txt"]))
        shard = writer.close()
    with open(path, "rb") as f:
        stored = f.read()
    info = ShardInfo(
        os.path.basename(path),
        shard.num_samples,
        shard.bytes,
        shard.raw_bytes,
        shard.sha256,
        "x.idx.arrow",
        "0" * 64,
    )
    return Written(path, stored, shard, info, data)


def stage(tmp: str, fmt: str, compression: str, w: Written, name: str = "staged") -> str:
    f = get_format(fmt)
    dst = os.path.join(tmp, f"{name}-{fmt}-{compression}.raw")
    with open(w.path, "rb") as src, open(dst, "wb") as out:
        n = f.stage(src, out, compression, f.staged_bound(w.info, len(FIELDS)))
    assert n == os.path.getsize(dst)
    return dst


def read_all(fmt: str, path: str, index: SampleIndex, verify: bool = True) -> list:
    reader = get_format(fmt).reader(path, index, verify)
    try:
        return [reader.read(i) for i in range(len(index))]
    finally:
        reader.close()


# -- the contract ---------------------------------------------------------------------------


def check_round_trip(tmp: str, fmt: str, compression: str) -> None:
    """Write → stage → read by index, and stream the stored shard: the same samples back; the
    stored bytes are what the writer reported; the planner's estimate is the written size."""
    f = get_format(fmt)
    w = write(tmp, fmt, compression)
    assert w.shard.num_samples == len(w.samples)
    assert w.shard.bytes == len(w.stored)
    assert w.shard.sha256 == hashlib.sha256(w.stored).hexdigest()
    planned = f.shard_overhead + sum(
        f.sample_raw_size(k, [(e, len(v)) for e, v in fields.items()]) for k, fields in w.samples
    )
    assert planned == w.shard.raw_bytes  # NOTE [shard boundaries] in pack/plan.py
    staged = stage(tmp, fmt, compression, w)
    assert read_all(fmt, staged, w.shard.index) == w.samples
    reader = f.reader(staged, w.shard.index)
    for i in (7, 0, 11, 5, 5):  # random access, repeated
        assert reader.read(i) == w.samples[i]
    reader.close()
    assert list(f.iter_stored(io.BytesIO(w.stored), compression, w.path)) == w.samples
    if f.reads_in_place(compression):
        assert read_all(fmt, w.path, w.shard.index) == w.samples
    other = os.path.join(tmp, "again")
    os.makedirs(other, exist_ok=True)
    assert write(other, fmt, compression).stored == w.stored  # same samples, same bytes


def check_index_agrees(tmp: str, fmt: str, compression: str) -> None:
    """The sidecar the writer builds passes the manifest checks, survives its Arrow round trip,
    and a manifest entry with the writer's sizes passes the schema."""
    w = write(tmp, fmt, compression)
    index = w.shard.index
    assert list(index.keys) == [k for k, _ in w.samples]
    assert index.lengths is not None and index.lengths.tolist() == [
        len(fields["txt"]) for _, fields in w.samples
    ]
    check_sample_index(index, fmt, w.info)
    back = SampleIndex.from_arrow_bytes(index.to_arrow_bytes())
    assert list(back.keys) == list(index.keys)
    for name in ("offsets", "sizes", "lengths", "checksums"):
        assert getattr(back, name).tolist() == getattr(index, name).tolist(), name
    manifest = Manifest(fmt, compression, FIELDS, [w.info], length_field="txt")
    assert Manifest.from_json(manifest.to_json()).shards == (w.info,)
    assert (
        get_format(fmt).entry_problem(
            w.info.num_samples, w.info.bytes, w.info.raw_bytes, compression
        )
        is None
    )
    too_many = get_format(fmt).entry_problem(
        w.info.raw_bytes + 1, w.info.bytes, w.info.raw_bytes, compression
    )
    assert too_many is not None and too_many[0] == "num_samples"


def check_checksums(tmp: str, fmt: str, compression: str) -> None:
    """Every sample has a checksum; a flipped byte in one sample's payload is a ChecksumError
    naming its key, with ``verify`` on, and goes unnoticed with it off; the others still read."""
    w = write(tmp, fmt, compression)
    index = w.shard.index
    assert index.checksums is not None and len(index.checksums) == len(w.samples)
    staged = stage(tmp, fmt, compression, w)
    with open(staged, "r+b") as f:
        data = f.read()
        at = data.index(b"MARK0003") + 20
        f.seek(at)
        f.write(bytes([data[at] ^ 0xFF]))
    reader = get_format(fmt).reader(staged, index, True)
    with pytest.raises(ChecksumError, match="s/0003"):
        reader.read(3)
    assert reader.read(4) == w.samples[4]
    reader.close()
    unchecked = read_all(fmt, staged, index, verify=False)
    assert unchecked[3] != w.samples[3] and unchecked[4] == w.samples[4]


def check_iter_checked(tmp: str, fmt: str, compression: str) -> None:
    """``iter_checked`` streams what ``iter_stored`` does, each sample with the checksum its
    reader checks (what ``verify`` compares with the sidecar), or None where the format
    checks none (the default)."""
    f = get_format(fmt)
    w = write(tmp, fmt, compression)
    limit = f.staged_bound(w.info, len(FIELDS))
    with open(w.path, "rb") as src:
        got = list(f.iter_checked(src, compression, w.path, w.shard.index, limit))
    assert [s for s, _ in got] == w.samples
    sums = w.shard.index.checksums
    for n, (_, digest) in enumerate(got):
        assert digest is None or (sums is not None and digest == int(sums[n])), (fmt, n)


def _rows_read(reader, parts: list[list[int]]) -> Rows:
    """Several read_rows calls (a batch spread over calls, as over shards) into one Rows."""
    rows = Rows(sum(len(p) for p in parts))
    start = 0
    for part in parts:
        read_rows(reader, part, rows, range(start, start + len(part)))
        start += len(part)
    return rows


def check_read_rows(tmp: str, fmt: str, compression: str) -> None:
    """A batch read (``read_rows``, a format's own or the fallback) gives what ``read`` gives,
    in any order, with repeats, in pieces put back in batch order; a damaged sample is that
    position's error only."""
    f = get_format(fmt)
    w = write(tmp, fmt, compression)
    staged = stage(tmp, fmt, compression, w)
    parts = [[7, 0, 11], [5, 5, 3], [2, 9, 1, 4, 6, 8, 10]]
    order = [i for p in parts for i in p]
    for verify in (True, False):
        reader = f.reader(staged, w.shard.index, verify)
        rows = _rows_read(reader, parts)
        assert not rows.errors
        assert rows.keys == [w.samples[i][0] for i in order]
        for pos, i in enumerate(order):
            got = {n: bytes(c[pos]) for n, c in rows.fields.items() if c[pos] is not None}
            assert got == w.samples[i][1], (fmt, i)
        reader.close()
    with open(staged, "r+b") as out:
        data = out.read()
        at = data.index(b"MARK0003") + 20
        out.seek(at)
        out.write(bytes([data[at] ^ 0xFF]))
    reader = f.reader(staged, w.shard.index, True)
    rows = _rows_read(reader, parts)
    assert sorted(rows.errors) == [order.index(3)]
    assert isinstance(rows.errors[order.index(3)], ChecksumError)
    assert "s/0003" in str(rows.errors[order.index(3)])
    assert all(c[order.index(3)] is None for c in rows.fields.values())
    assert [k for p, k in enumerate(rows.keys) if p != order.index(3)] == [
        w.samples[i][0] for i in order if i != 3
    ]
    reader.close()


def check_bounded(tmp: str, fmt: str, compression: str) -> None:
    """Staging never writes past its limit, streaming never reads past it, and a field larger
    than ``max_member`` stops the stream: each a ShardError."""
    f = get_format(fmt)
    w = write(tmp, fmt, compression)
    limit = w.shard.raw_bytes // 3
    dst = os.path.join(tmp, f"bounded-{fmt}-{compression}.raw")
    with open(w.path, "rb") as src, open(dst, "wb") as out, pytest.raises(ShardError):
        f.stage(src, out, compression, limit)
    assert os.path.getsize(dst) <= limit
    with pytest.raises(ShardError):
        list(f.iter_stored(io.BytesIO(w.stored), compression, w.path, limit))
    with pytest.raises(ShardError):
        list(f.iter_stored(io.BytesIO(w.stored), compression, w.path, None, 4096))


def check_corrupt_input(tmp: str, fmt: str, compression: str) -> None:
    """Truncated or garbage stored shards are ShardErrors, never another exception."""
    f = get_format(fmt)
    w = write(tmp, fmt, compression)
    # Cut inside the samples: a zstd tar shard ends with its sample index in a skippable frame
    # (format/embedded.py), which decoders pass over; a cut there leaves the samples whole.
    carried = carried_index(w.stored)
    data_end = len(w.stored) - (len(index_frame(carried.data)) if carried is not None else 0)
    for bad in (w.stored[: data_end // 2], os.urandom(4096)):
        with pytest.raises(ShardError):
            list(f.iter_stored(io.BytesIO(bad), compression, w.path))
        dst = os.path.join(tmp, f"corrupt-{fmt}-{compression}.raw")
        try:
            with open(dst, "wb") as out:
                f.stage(io.BytesIO(bad), out, compression, w.shard.raw_bytes)
        except ShardError:
            continue
        # staged without complaint (a plain copy): reading it must then fail cleanly
        with pytest.raises(ShardError):
            read_all(fmt, dst, w.shard.index)


def check_refuses_unknown_compression(tmp: str, fmt: str) -> None:
    """A compression the format does not store is a UsageError naming the ones it does."""
    f = get_format(fmt)
    for compression in ("lz4", *(c for c in ("zstd", "gzip", "none") if c not in f.suffixes)):
        with pytest.raises(UsageError, match=repr(compression)):
            open_writer(fmt, io.BytesIO(), compression, FIELDS)
        with pytest.raises(UsageError):
            f.suffix(compression)


CONTRACT = [
    check_round_trip,
    check_index_agrees,
    check_checksums,
    check_iter_checked,
    check_read_rows,
    check_bounded,
    check_corrupt_input,
]
