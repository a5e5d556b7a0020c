"""POSIX (pax) tar shards, webdataset-compatible: one sample = consecutive members sharing a key.

Writer: members sorted by extension, mtime 0, uid/gid 0, no user names, mode 0644, so the same
samples give the same bytes; the tar is compressed as a whole (format/compress.py), and a zstd
shard then carries its sample index in a skippable frame (format/embedded.py).  The writer
records each sample's offset and size in the *uncompressed* tar, so a staged copy can be read
by seeking.  Reading streams goes through format/tarstream.py; shardloader ``index`` adopts
existing tar shards through format/tarindex.py.
"""

from __future__ import annotations

import io
import mmap
import os
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import xxhash

from shardloader.errors import ChecksumError, ShardError
from shardloader.format.base import Format, Sample, ScannedShard, WrittenShard
from shardloader.format.compress import CompressedSink, stage_stream
from shardloader.format.embedded import index_frame
from shardloader.format.registry import register_format
from shardloader.format.tarindex import scan_tar
from shardloader.format.tarstream import BLOCK, iter_members, iter_samples, iter_tar, split_key
from shardloader.manifest import SampleIndex

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo, ShardInfo

__all__ = ["BLOCK", "FORMAT", "TarFormat", "TarShardReader", "TarShardWriter", "split_key"]

END = 2 * BLOCK  # the end-of-archive marker the writer adds


def _member_header(name: str, size: int) -> bytes:
    if size < _USTAR_MAX_SIZE and len(name) <= 100 and name.isascii():
        return _ustar_header(name, size)
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


# Fast path for the common member (ASCII name <= 100 chars, size < 8 GiB): the same bytes
# tarfile's PAX_FORMAT writes then (a plain ustar block), built from a template instead of
# TarInfo.tobuf, which costs ~20x more and dominated packing small records.
_USTAR_MAX_SIZE = 8**11


def _template() -> tuple[bytearray, int]:
    info = tarfile.TarInfo("")
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    block = bytearray(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict"))
    block[124:136] = b"\0" * 12  # size: filled per member
    block[148:156] = b" " * 8  # checksum: computed per member, over spaces
    return block, sum(block)


_USTAR, _USTAR_SUM = _template()
_USTAR_ARRAY = np.frombuffer(bytes(_USTAR), np.uint8)


def _ustar_header(name: str, size: int) -> bytes:
    block = _USTAR.copy()
    raw = name.encode("ascii")
    block[0 : len(raw)] = raw
    field = b"%011o\0" % size
    block[124:136] = field
    chksum = _USTAR_SUM + sum(raw) + sum(field)
    block[148:155] = b"%06o\0" % chksum
    return bytes(block)


def header_size(name: str, size: int) -> int:
    """Bytes of the header(s) :func:`_member_header` writes for a member, computed exactly
    (the planner asks for every member; building the header costs more)."""
    if size < _USTAR_MAX_SIZE and len(name) <= 100 and name.isascii():
        return BLOCK  # fits a plain ustar header: no pax record
    return len(_member_header(name, size))


class TarShardWriter:
    """Writes samples as tar members through zstd/gzip/no compression."""

    def __init__(self, fileobj: BinaryIO, compression: str) -> None:
        self._sink = CompressedSink(fileobj, compression)
        self._compression = compression
        self._raw = 0
        self._keys: list[str] = []
        self._offsets: list[int] = []
        self._sizes: list[int] = []
        self._lengths: list[int] = []
        self._sums: list[int] = []

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        start = self._raw
        parts: list[bytes] = []
        for ext in sorted(fields):
            data = fields[ext]
            parts.append(_member_header(f"{key}.{ext}", len(data)))
            parts.append(data)
            pad = -len(data) % BLOCK
            if pad:
                parts.append(b"\0" * pad)
        blob = b"".join(parts)
        self._sink.write(blob)
        self._raw += len(blob)
        self._keys.append(key)
        self._offsets.append(start)
        self._sizes.append(len(blob))
        self._lengths.append(-1 if length is None else length)
        self._sums.append(xxhash.xxh3_64_intdigest(blob))

    def add_records(
        self,
        keys: Sequence[str],
        ext: str,
        values: Sequence[bytes],
        lengths: Sequence[int] | None = None,
    ) -> None:
        """Many one-field samples at once (runs of lines): the bytes :meth:`add` writes for
        each, with the plain ustar headers built by numpy rather than one by one."""
        n = len(keys)
        names = [f"{k}.{ext}" for k in keys]
        sizes = np.fromiter(map(len, values), np.int64, n)
        width = len(names[0]) if n else 0
        joined = "".join(names)
        if not n or len(joined) != width * n or width > 100 or not joined.isascii():
            # names of several lengths, long or not ASCII (or sizes past 8 GiB): one by one
            for i in range(n):
                self.add(keys[i], {ext: values[i]}, None if lengths is None else lengths[i])
            return
        if int(sizes.max()) >= _USTAR_MAX_SIZE:
            for i in range(n):
                self.add(keys[i], {ext: values[i]}, None if lengths is None else lengths[i])
            return
        records = BLOCK + sizes + (-sizes % BLOCK)
        starts = np.zeros(n, np.int64)
        np.cumsum(records[:-1], out=starts[1:])
        heads = np.empty((n, BLOCK), np.uint8)
        heads[:] = _USTAR_ARRAY
        name_bytes = np.frombuffer(joined.encode("ascii"), np.uint8).reshape(n, width)
        heads[:, :width] = name_bytes
        total = np.full(n, _USTAR_SUM, np.int64) + name_bytes.sum(axis=1, dtype=np.int64)
        for j in range(11):  # size: "%011o\0"
            digit = 48 + ((sizes >> (3 * (10 - j))) & 7)
            heads[:, 124 + j] = digit
            total += digit
        heads[:, 135] = 0
        for j in range(6):  # checksum: "%06o\0", then the template's space
            heads[:, 148 + j] = 48 + ((total >> (3 * (5 - j))) & 7)
        heads[:, 154] = 0
        out = bytearray(int(records.sum()))
        blocks = np.frombuffer(out, np.uint8).reshape(-1, BLOCK)
        blocks[starts // BLOCK] = heads
        del blocks  # a bytearray with an exported view cannot be written as a whole
        for start, size, value in zip(starts.tolist(), sizes.tolist(), values, strict=True):
            out[start + BLOCK : start + BLOCK + size] = value
        view = memoryview(out)
        sums = [
            xxhash.xxh3_64_intdigest(view[a : a + r])
            for a, r in zip(starts.tolist(), records.tolist(), strict=True)
        ]
        view.release()
        self._sink.write(out)
        self._keys.extend(keys)
        self._offsets.extend((starts + self._raw).tolist())
        self._sizes.extend(records.tolist())
        self._lengths.extend(
            [-1] * n if lengths is None else [-1 if x is None else x for x in lengths]
        )
        self._sums.extend(sums)
        self._raw += len(out)

    def close(self) -> WrittenShard:
        self._sink.write(b"\0" * END)
        self._raw += END
        self._sink.close()
        has_lengths = bool(self._lengths) and min(self._lengths) >= 0
        index = SampleIndex(
            keys=self._keys,
            offsets=np.asarray(self._offsets, np.int64),
            sizes=np.asarray(self._sizes, np.int64),
            lengths=np.asarray(self._lengths, np.int64) if has_lengths else None,
            checksums=np.asarray(self._sums, np.uint64),
        )
        if self._compression == "zstd":  # the index rides along: one GET fetches both
            self._sink.stored.write(index_frame(index.to_arrow_bytes()))
        return WrittenShard(
            num_samples=len(self._keys),
            bytes=self._sink.stored.count,
            raw_bytes=self._raw,
            sha256=self._sink.stored.sha.hexdigest(),
            index=index,
        )


def _fields_in(buf: mmap.mmap | bytes, start: int, end: int, key: str) -> dict[str, bytes] | None:
    """Fast path for one sample of plain ustar members named ``key.ext``, read in place.

    Header checksums are not recomputed here: staged shards were verified whole against the
    manifest's SHA-256, and any header that does not look like ours (pax/GNU records, another
    key, a non-octal size) returns None, so the caller falls back to the general parser, which
    also produces the precise error.
    """
    fields: dict[str, bytes] = {}
    prefix = (key + ".").encode("utf-8", "surrogateescape")
    plen = len(prefix)
    pos = start
    while pos < end:
        if buf[pos + 156 : pos + 157] not in (b"0", b"\0") or buf[pos : pos + plen] != prefix:
            return None
        name_end = buf.find(b"\0", pos, pos + 100)
        ext = buf[pos + plen : name_end if name_end >= 0 else pos + 100]
        try:
            size = int(buf[pos + 124 : pos + 135], 8)
        except ValueError:
            return None
        if not ext or b"/" in ext:
            return None
        data_start = pos + BLOCK
        if data_start + size > end:  # never copy past the sample's extent in the sidecar
            return None
        name = ext.decode("utf-8", "surrogateescape")
        if name in fields:
            return None
        fields[name] = buf[data_start : data_start + size]
        pos = data_start + size + (-size % BLOCK)
    return fields if pos == end else None


class TarShardReader:
    """Random access to samples of an uncompressed local tar via its sample index.

    The file is memory-mapped: a sample costs slices of the page cache, no seek/read calls.
    With ``verify`` and a sidecar that has per-sample checksums, each sample's byte range is
    hashed (XXH3-64, about 0.02 us per KiB) and compared before it is parsed.
    """

    def __init__(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> None:
        self._f = open(local_path, "rb")  # noqa: SIM115 - closed in close()
        size = os.fstat(self._f.fileno()).st_size
        self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._view = memoryview(self._map)
        self._size = size
        self._offsets = index.offsets.tolist()
        self._sizes = index.sizes.tolist()
        self._sums = index.checksums.tolist() if verify and index.checksums is not None else None
        self._keys = index.keys
        self._where = where

    def read(self, i: int) -> Sample:
        offset, size = self._offsets[i], self._sizes[i]
        key = self._keys[i]
        if offset + size > self._size:
            raise ShardError(f"{self._where}: truncated shard: sample {key!r} is cut short")
        if self._sums is not None:
            got = xxhash.xxh3_64_intdigest(self._view[offset : offset + size])
            if got != self._sums[i]:
                raise ChecksumError(
                    f"{self._where}: sample {key!r} (bytes {offset}..{offset + size}) has "
                    f"checksum {got:016x}, its sidecar says {self._sums[i]:016x}: the shard is "
                    "damaged; "
                    "`shardloader verify` checks the whole dataset (ReadOptions(verify_samples="
                    "False) skips this per-sample check)"
                )
        fields = _fields_in(self._map, offset, offset + size, key)
        if fields is not None:
            return key, fields
        blob = self._map[offset : offset + size]
        members = iter_members(
            io.BytesIO(blob),
            self._where,
            False,
            limit=size,
            reason="the sample index declares for this sample",
        )
        samples = list(iter_samples(members, self._where))
        if len(samples) != 1 or samples[0][0] != key:
            raise ShardError(
                f"{self._where}: sample index says {key!r} at byte {offset}, found "
                f"{[k for k, _ in samples]}; the shard and its .idx.arrow sidecar do not match"
            )
        return samples[0]

    def close(self) -> None:
        self._view.release()
        if isinstance(self._map, mmap.mmap):
            self._map.close()
        self._f.close()


class TarFormat(Format):
    """Tar shards: byte offsets into the uncompressed tar, 512-byte blocks."""

    name = "tar"
    suffixes = {"zstd": ".tar.zst", "gzip": ".tar.gz", "none": ".tar"}
    index_suffixes = {".tgz": "gzip", ".tar.zstd": "zstd"}
    min_sample_bytes = BLOCK  # at least one member header
    end_bytes = BLOCK  # at least one zero block (GNU tar and we write two)
    shard_overhead = END
    stored_is_raw = True
    indexable = True

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> TarShardWriter:
        return TarShardWriter(fileobj, compression)

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        plain = key.isascii()
        room = 99 - len(key)  # ``key.ext`` fits a plain ustar name (100 bytes)
        total = 0
        for ext, size in sizes:
            if plain and size < _USTAR_MAX_SIZE and len(ext) <= room and ext.isascii():
                head = BLOCK  # the common member: no pax record (the planner's hot path)
            else:
                head = header_size(f"{key}.{ext}", size)
            total += head + size + (-size % BLOCK)
        return total

    def record_raw_sizes(self, keys: Sequence[str], ext: str, sizes: np.ndarray) -> np.ndarray:
        """Vectorised when every ``key.ext`` fits a plain ustar header (the usual case)."""
        longest = max(map(len, keys), default=0)
        plain = (
            longest + 1 + len(ext) <= 100
            and ext.isascii()
            and "".join(keys).isascii()
            and (not len(sizes) or int(sizes.max()) < _USTAR_MAX_SIZE)
        )
        if not plain:
            return super().record_raw_sizes(keys, ext, sizes)
        sizes = sizes.astype(np.int64)
        return BLOCK + sizes + (-sizes % BLOCK)

    def reader(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> TarShardReader:
        return TarShardReader(local_path, index, where, verify)

    def stage(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
    ) -> int:
        return stage_stream(src, dst, compression, where, limit)

    def iter_stored(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[Sample]:
        return iter_tar(src, compression, where, limit, max_member)

    def scan(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        max_member: int | None,
        length_fields: Sequence[str] = (),
    ) -> ScannedShard:
        return scan_tar(src, compression, where, max_member, length_fields)

    def index_problem(self, index: SampleIndex, info: ShardInfo) -> str | None:
        """Inside the tar less its end block, and on 512-byte blocks."""
        if not len(index):
            return None
        offsets, sizes = index.offsets, index.sizes
        ends = offsets + sizes
        bad = (
            (ends > info.raw_bytes - BLOCK)
            | (sizes < BLOCK)
            | (offsets % BLOCK != 0)
            | (sizes % BLOCK != 0)
        )
        if not bad.any():
            return None
        i = int(bad.argmax())
        return (
            f"the sample index puts sample {index.keys[i]!r} at bytes {int(offsets[i])}.."
            f"{int(ends[i])}, outside the {info.raw_bytes:,}-byte tar or off its 512-byte "
            "blocks; the sidecar does not match the shard"
        )


FORMAT = register_format(TarFormat())
