"""A shard format defined outside shardloader: written to a temp module, registered, then packed
with ``pack`` and read back through ``ShardedDataset`` and a DataLoader with worker processes,
without any change to shardloader itself.  It also keeps the contract every format keeps."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
from corpus import key_groups
from format_contract import CONTRACT

import shardloader as sl
from shardloader.errors import UsageError
from shardloader.format import get_format, known_formats, register_format, unregister_format
from shardloader.pack import PackOptions, pack
from shardloader.read.verify import verify_dataset

# A record per sample: u32 record size, u16 key size, key, u16 field count, then per field
# u16 name size, name, u32 data size, data.  The shard is the records back to back, compressed
# as a whole; offsets in the sidecar are byte positions in the uncompressed stream.
TOY = """
import mmap
import struct

import numpy as np
import xxhash

from shardloader.errors import ChecksumError, ShardError, located
from shardloader.format import Format, WrittenShard, register_format
from shardloader.format.compress import DECOMPRESS_ERRORS, CompressedSink, decompressed
from shardloader.manifest import SampleIndex


def encode(key, fields):
    k = key.encode()
    parts = [struct.pack("<H", len(k)), k, struct.pack("<H", len(fields))]
    for name in sorted(fields):
        n = name.encode()
        parts += [struct.pack("<H", len(n)), n, struct.pack("<I", len(fields[name])),
                  fields[name]]
    body = b"".join(parts)
    return struct.pack("<I", 4 + len(body)) + body


def decode(record):
    try:
        (klen,) = struct.unpack_from("<H", record, 4)
        key = bytes(record[6 : 6 + klen]).decode()
        pos = 6 + klen
        (count,) = struct.unpack_from("<H", record, pos)
        pos += 2
        fields = {}
        for _ in range(count):
            (nlen,) = struct.unpack_from("<H", record, pos)
            name = bytes(record[pos + 2 : pos + 2 + nlen]).decode()
            (size,) = struct.unpack_from("<I", record, pos + 2 + nlen)
            start = pos + 6 + nlen
            if start + size > len(record):
                raise ValueError("field runs past its record")
            fields[name] = bytes(record[start : start + size])
            pos = start + size
    except (struct.error, ValueError, UnicodeDecodeError) as err:
        raise ShardError(f"corrupt toy record ({err})") from err
    if pos != len(record):
        raise ShardError(f"corrupt toy record (trailing bytes)")
    return key, fields


class Writer:
    def __init__(self, fileobj, compression):
        self.sink = CompressedSink(fileobj, compression)
        self.raw = 0
        self.keys, self.offsets, self.sizes, self.lengths, self.sums = [], [], [], [], []

    def add(self, key, fields, length=None):
        record = encode(key, fields)
        self.sink.write(record)
        self.keys.append(key)
        self.offsets.append(self.raw)
        self.sizes.append(len(record))
        self.lengths.append(-1 if length is None else length)
        self.sums.append(xxhash.xxh3_64_intdigest(record))
        self.raw += len(record)

    def close(self):
        self.sink.close()
        lengths = self.lengths if self.lengths and min(self.lengths) >= 0 else None
        index = SampleIndex(self.keys, np.asarray(self.offsets, np.int64),
                            np.asarray(self.sizes, np.int64),
                            None if lengths is None else np.asarray(lengths, np.int64),
                            np.asarray(self.sums, np.uint64))
        stored = self.sink.stored
        return WrittenShard(len(self.keys), stored.count, self.raw, stored.sha.hexdigest(), index)


class Reader:  # its errors need not name the shard: the caller does
    def __init__(self, path, index, verify):
        self.f = open(path, "rb")
        self.map = mmap.mmap(self.f.fileno(), 0, access=mmap.ACCESS_READ)
        self.index, self.verify = index, verify

    def read(self, i):
        idx = self.index
        start, size, key = int(idx.offsets[i]), int(idx.sizes[i]), idx.keys[i]
        if start + size > len(self.map):
            raise ShardError(f"truncated shard: sample {key!r} is cut short")
        record = self.map[start : start + size]
        if self.verify and idx.checksums is not None:
            if xxhash.xxh3_64_intdigest(record) != int(idx.checksums[i]):
                raise ChecksumError(f"sample {key!r} fails its checksum")
        got, fields = decode(record)
        if got != key:
            raise ShardError(f"record {i} is {got!r}, the sidecar says {key!r}")
        return got, fields

    def close(self):
        self.map.close()
        self.f.close()


class ToyFormat(Format):
    name = "toy"
    suffixes = {"zstd": ".toy.zst", "none": ".toy"}
    min_sample_bytes = 10  # size, key size, a one-byte key, field count
    stored_is_raw = True

    def writer(self, fileobj, compression, fields):
        return Writer(fileobj, compression)

    def sample_raw_size(self, key, sizes):
        return 8 + len(key.encode()) + sum(6 + len(n.encode()) + s for n, s in sizes)

    def reader(self, local_path, index, verify=True):
        return Reader(local_path, index, verify)

    def iter_stored(self, src, compression, where, limit=None, max_member=None):
        stream, pos = decompressed(src, compression), 0
        try:
            while head := stream.read(4):
                if len(head) < 4:
                    raise ShardError(f"{where}: truncated shard (record size)")
                (size,) = struct.unpack("<I", head)
                if size < self.min_sample_bytes:
                    raise ShardError(f"{where}: corrupt toy record size {size}")
                if limit is not None and pos + size > limit:
                    raise ShardError(f"{where}: a record goes past the {limit:,} bytes declared")
                if max_member is not None and size > max_member + 4096:
                    raise ShardError(f"{where}: a {size:,}-byte record is over the limit")
                body = stream.read(size - 4)
                if len(body) < size - 4:
                    raise ShardError(f"{where}: truncated shard (record body)")
                pos += size
                with located(where):
                    key, fields = decode(head + body)
                biggest = max(map(len, fields.values()), default=0)
                if max_member is not None and biggest > max_member:
                    raise ShardError(f"{where}: a field of {key!r} is over the limit")
                yield key, fields
        except DECOMPRESS_ERRORS as err:
            if isinstance(err, ShardError):
                raise
            raise ShardError(f"{where}: cannot decompress shard ({err})") from err


FORMAT = register_format(ToyFormat())
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy format's module, imported from a temp folder (so it registers), then forgotten."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "toy_shard_format.py").write_text(textwrap.dedent(TOY))
    monkeypatch.syspath_prepend(str(folder))
    assert "toy" not in known_formats()
    module = importlib.import_module("toy_shard_format")
    yield module
    unregister_format("toy")
    sys.modules.pop("toy_shard_format")


@pytest.mark.parametrize(("compression", "workers"), [("zstd", 2), ("none", 1)])
def test_a_third_party_format_packs_and_reads_through_the_dataset(
    tmp_path, toy, compression, workers
):
    """Pack workers are fresh processes (forkserver): they import the format's module."""
    files = key_groups(str(tmp_path / "src"), n=10)
    out = str(tmp_path / "out")
    report = pack(
        str(tmp_path / "src"),
        out,
        PackOptions(format="toy", compression=compression, max_samples=3, workers=workers),
    )
    assert report.manifest.format == "toy" and report.shards == 4
    assert all(s.path.endswith(toy.FORMAT.suffix(compression)) for s in report.manifest.shards)
    assert verify_dataset(out, images=False).ok
    ds = sl.ShardedDataset(
        out,
        decoder=None,
        shuffle=True,
        seed=3,
        read=sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "c"))),
    )
    got = {}
    for sample in sl.make_loader(ds, num_workers=2):
        for ext, data in sample.items():
            if not ext.startswith("__") and data is not None:  # None: a field this sample lacks
                got[f"{sample['__key__']}.{ext}"] = data
    # key groups fill `image` from the photos' extension, as class folders do
    want = {name.replace(".jpg", ".image"): data for name, data in files.items()}
    assert got == want  # every member of every sample, once, byte for byte


def test_a_format_written_to_the_old_contract_is_refused_by_name(toy):
    """reader() took a ``where`` before the caller named the shard: such a format is refused
    when it registers, with the remedy, not when its first shard is read."""

    class OldToy(type(toy.FORMAT)):  # type: ignore[misc]
        name = "oldtoy"

        def reader(self, local_path, index, where, verify=True):
            return toy.Reader(local_path, index, verify)

    with pytest.raises(UsageError, match="'oldtoy': reader.* no longer take `where`"):
        register_format(OldToy())
    assert "oldtoy" not in known_formats()


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
def test_the_third_party_format_keeps_the_contract(tmp_path, toy, check):
    for compression in get_format("toy").compressions:
        check(str(tmp_path), "toy", compression)
