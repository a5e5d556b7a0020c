"""POSIX (pax) tar shards, webdataset-compatible: one sample = consecutive members sharing a key.

Writer: members sorted by extension, mtime 0, uid/gid 0, no user names, mode 0644, so the same
samples give the same bytes.  The writer records each sample's offset and size in the
*uncompressed* tar, so a staged copy can be read by seeking.  Reader: a small header parser that
understands ustar, pax ``x``/``g`` records and GNU long names: enough for our shards and for
shards written by webdataset or GNU tar.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import mmap
import os
import tarfile
from collections.abc import Iterator, Mapping
from typing import BinaryIO

import numpy as np
import xxhash
import zstandard

from shardloader.errors import ChecksumError, ShardError
from shardloader.format import Sample, WrittenShard
from shardloader.keys import unsafe_key_reason
from shardloader.manifest import SampleIndex
from shardloader.schema import unsafe_key_error

BLOCK = 512
_ZSTD_LEVEL = 3
_GZIP_LEVEL = 6


def split_key(name: str) -> tuple[str, str] | None:
    """webdataset's rule: the key is the path up to the first dot of the basename."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot <= slash + 1:
        return None
    return name[:dot], name[dot + 1 :]


class _HashingCounter:
    """File wrapper that hashes and counts the stored bytes on their way to disk."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._f = fileobj
        self.sha = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.sha.update(data)
        self.count += len(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()


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


def _ustar_header(name: str, size: int) -> bytes:
    block = _USTAR.copy()
    raw = name.encode("ascii")
    block[0 : len(raw)] = raw
    field = b"%011o\0" % size
    block[124:136] = field
    chksum = _USTAR_SUM + sum(raw) + sum(field)
    block[148:155] = b"%06o\0" % chksum
    return bytes(block)


class TarShardWriter:
    """Writes samples as tar members through zstd/gzip/no compression."""

    def __init__(self, fileobj: BinaryIO, compression: str) -> None:
        self._out = _HashingCounter(fileobj)
        self._compressor: object | None
        if compression == "zstd":
            cctx = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
            self._compressor = cctx.stream_writer(self._out, closefd=False)  # type: ignore[arg-type]
        elif compression == "gzip":
            self._compressor = gzip.GzipFile(
                filename="",
                mode="wb",
                fileobj=self._out,
                mtime=0,
                compresslevel=_GZIP_LEVEL,  # type: ignore[arg-type]
            )
        elif compression == "none":
            self._compressor = None
        else:
            raise ShardError(f"unknown tar compression {compression!r}")
        self._sink = self._compressor if self._compressor is not None else self._out
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
        self._sink.write(blob)  # type: ignore[attr-defined]
        self._raw += len(blob)
        self._keys.append(key)
        self._offsets.append(start)
        self._sizes.append(len(blob))
        self._lengths.append(-1 if length is None else length)
        self._sums.append(xxhash.xxh3_64_intdigest(blob))

    def close(self) -> WrittenShard:
        end = b"\0" * (2 * BLOCK)
        self._sink.write(end)  # type: ignore[attr-defined]
        self._raw += len(end)
        if self._compressor is not None:
            self._compressor.close()  # type: ignore[attr-defined]
        self._out.flush()
        has_lengths = bool(self._lengths) and min(self._lengths) >= 0
        index = SampleIndex(
            keys=self._keys,
            offsets=np.asarray(self._offsets, np.int64),
            sizes=np.asarray(self._sizes, np.int64),
            lengths=np.asarray(self._lengths, np.int64) if has_lengths else None,
            checksums=np.asarray(self._sums, np.uint64),
        )
        return WrittenShard(
            num_samples=len(self._keys),
            bytes=self._out.count,
            raw_bytes=self._raw,
            sha256=self._out.sha.hexdigest(),
            index=index,
        )


def _decompressed(src: BinaryIO, compression: str) -> BinaryIO:
    if compression == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(src, read_across_frames=True)  # type: ignore[return-value]
    if compression == "gzip":
        return gzip.GzipFile(fileobj=src, mode="rb")  # type: ignore[return-value]
    return src


_CHUNK = 1 << 20
_MAX_META = 1 << 20  # pax / GNU long-name records: names and a few numbers, never this big


def too_big(where: str, what: str, limit: int, reason: str) -> ShardError:
    return ShardError(
        f"{where}: {what} goes past the {limit:,} bytes {reason}; the shard is corrupt or "
        "hostile (a decompression bomb?): re-pack it or restore it from a copy"
    )


class TarStream:
    """A (decompressed) tar stream read front to back, never past ``limit`` bytes.

    ``limit`` is what the manifest declares (``raw_bytes``); the walker checks each member's
    declared size against it *before* decompressing the member, so a bomb costs nothing.
    ``on_data`` sees every byte read (checksums), ``pos`` counts them.
    """

    def __init__(self, f: BinaryIO, where: str, limit: int | None = None,
                 reason: str = "the manifest declares (raw_bytes)") -> None:
        self._f = f
        self.where = where
        self.limit = limit
        self.reason = reason
        self.pos = 0

    def on_data(self, data: bytes) -> None:
        """Hook for subclasses that checksum the stream."""

    def read(self, n: int) -> bytes:
        data = self._f.read(n)
        self.pos += len(data)
        self.on_data(data)
        return data

    def reserve(self, n: int, what: str) -> None:
        """Raise before reading ``n`` more bytes that would pass the limit."""
        if self.limit is not None and self.pos + n > self.limit:
            raise too_big(self.where, what, self.limit, self.reason)

    def read_exact(self, n: int, what: str) -> bytes:
        self.reserve(n, what)
        chunks = []
        remaining = n
        while remaining:
            chunk = self.read(remaining)
            if not chunk:
                raise ShardError(
                    f"{self.where}: truncated shard: {what} ends {remaining} bytes early"
                )
            chunks.append(chunk)
            remaining -= len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def skip(self, n: int, what: str) -> None:
        """Read and drop ``n`` bytes in bounded chunks (memory stays flat)."""
        self.reserve(n, what)
        while n:
            chunk = self.read(min(n, _CHUNK))
            if not chunk:
                raise ShardError(f"{self.where}: truncated shard: {what} ends {n} bytes early")
            n -= len(chunk)


def _pax_records(data: bytes, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    try:
        while pos < len(data):
            space = data.index(b" ", pos)
            length = int(data[pos:space])
            if length <= space - pos:
                raise ValueError(f"record length {length}")
            record = data[space + 1 : pos + length - 1]
            k, _, v = record.partition(b"=")
            out[k.decode("utf-8")] = v.decode("utf-8", "surrogateescape")
            pos += length
    except (ValueError, UnicodeDecodeError) as err:
        raise ShardError(f"{where}: corrupt pax header ({err})") from err
    return out


_ZERO_BLOCK = b"\0" * BLOCK
_PAX_TYPES = (b"x", b"g")


def _octal(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # GNU base-256 for big sizes
        return int.from_bytes(field[1:], "big")
    digits = field.split(b"\0", 1)[0].strip()
    return int(digits, 8) if digits else 0


def _parse_header(header: bytes, where: str) -> tuple[str, int, bytes]:
    """(name, size, typeflag) of one 512-byte header, checksum verified.

    Hand-rolled because ``tarfile.TarInfo.frombuf`` costs more than reading the sample.
    """
    try:
        stored = _octal(header[148:156])
        size = _octal(header[124:136])
    except ValueError as err:
        raise ShardError(f"{where}: corrupt tar header (bad number field)") from err
    if stored != sum(header) - sum(header[148:156]) + 256:
        raise ShardError(f"{where}: corrupt tar header (checksum mismatch)")
    name = header[:100].split(b"\0", 1)[0]
    if header[257:262] == b"ustar":
        prefix = header[345:500].split(b"\0", 1)[0]
        if prefix:
            name = prefix + b"/" + name
    return name.decode("utf-8", "surrogateescape"), size, header[156:157]


def walk_members(
    stream: TarStream, require_end: bool = True, max_member: int | None = None
) -> Iterator[tuple[str, int]]:
    """Yield (name, size) of each regular file, with ``stream`` at the start of its data.

    The consumer may read up to ``size`` bytes from ``stream``; the rest and the padding are
    skipped in bounded chunks when it asks for the next member, so no member is ever held
    whole unless the consumer reads it.  Raise ShardError on any malformation, on a member
    larger than ``max_member`` and on anything past the stream's limit.  A whole shard ends with
    a zero block; a single sample's bytes (``require_end=False``) don't.
    """
    where = stream.where
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = stream.read(BLOCK)
        if header == _ZERO_BLOCK:
            return
        if not header:
            if require_end:
                raise ShardError(f"{where}: truncated shard: no end-of-archive marker")
            return
        if len(header) != BLOCK:
            raise ShardError(f"{where}: truncated shard: partial tar header")
        name, size, kind = _parse_header(header, where)
        if "size" in pax:
            try:
                size = int(pax["size"])
            except ValueError as err:
                raise ShardError(f"{where}: corrupt pax size {pax['size']!r}") from err
        if size < 0:
            raise ShardError(f"{where}: corrupt tar header (negative size)")
        padded = size + (-size % BLOCK)
        if kind in _PAX_TYPES or kind == b"L":
            if size > _MAX_META:
                raise ShardError(f"{where}: a {size:,}-byte tar metadata record; corrupt shard")
            data = stream.read_exact(size, f"metadata of member {name!r}")
            stream.skip(padded - size, f"padding of member {name!r}")
            if kind == b"x":
                pax = _pax_records(data, where)
            elif kind == b"L":  # GNU long name
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = pax.get("path") or long_name or name
        pax, long_name = {}, None
        if kind not in (b"0", b"\0"):  # links, devices, fifos, folders: never sample data
            stream.skip(padded, f"member {name!r}")
            continue
        if max_member is not None and size > max_member:
            raise ShardError(
                f"{where}: member {name!r} declares {size:,} bytes, more than the {max_member:,} "
                "allowed for one sample; the shard is corrupt or hostile (a decompression bomb?)"
            )
        stream.reserve(padded, f"member {name!r}")
        start = stream.pos
        yield name, size
        consumed = stream.pos - start
        stream.skip(padded - consumed, f"member {name!r}")


def _iter_members(
    f: BinaryIO, where: str, require_end: bool = True, limit: int | None = None,
    max_member: int | None = None, reason: str = "the manifest declares (raw_bytes)",
) -> Iterator[tuple[str, bytes]]:
    """Yield (name, data) of regular files; each member is read whole (bounded by the caller)."""
    stream = TarStream(f, where, limit, reason)
    for name, size in walk_members(stream, require_end, max_member):
        yield name, stream.read_exact(size, f"member {name!r}")


def _iter_samples(members: Iterator[tuple[str, bytes]], where: str) -> Iterator[Sample]:
    key: str | None = None
    fields: dict[str, bytes] = {}
    for name, data in members:
        parts = split_key(name)
        if parts is None:
            continue  # no extension: not a sample member (webdataset skips these too)
        k, ext = parts
        if k != key:
            if key is not None:
                yield key, fields
            problem = unsafe_key_reason(k)
            if problem is not None:
                raise unsafe_key_error(where, k, problem)
            key, fields = k, {}
        if ext in fields:
            raise ShardError(f"{where}: sample {k!r} has two members with extension {ext!r}")
        fields[ext] = data
    if key is not None:
        yield key, fields


def iter_tar(
    src: BinaryIO, compression: str, where: str, limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[Sample]:
    """Stream the samples of a stored tar shard (compressed or not).

    ``limit`` bounds the uncompressed bytes read (the manifest's ``raw_bytes``), ``max_member``
    the bytes of any one member; both are checked from the headers, before decompressing.
    """
    stream = _decompressed(src, compression)
    try:
        yield from _iter_samples(_iter_members(stream, where, True, limit, max_member), where)
    except (zstandard.ZstdError, OSError, EOFError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: cannot decompress shard ({err})") from err


def stage_tar(
    src: BinaryIO, dst: BinaryIO, compression: str, where: str, limit: int | None = None
) -> int:
    """Decompress a stored tar shard into ``dst``; return the uncompressed byte count.

    Stops with ShardError as soon as the output would pass ``limit`` (the manifest's
    ``raw_bytes``): a decompression bomb writes at most ``limit`` bytes, never fills the disk.
    """
    stream = _decompressed(src, compression)
    total = 0
    try:
        while True:
            chunk = stream.read(_CHUNK)
            if not chunk:
                return total
            if limit is not None and total + len(chunk) > limit:
                raise too_big(where, "the decompressed shard", limit,
                              "the manifest declares (raw_bytes)")
            dst.write(chunk)
            total += len(chunk)
    except (zstandard.ZstdError, OSError, EOFError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: cannot decompress shard ({err})") from err


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
        members = _iter_members(io.BytesIO(blob), self._where, False, limit=size,
                                reason="the sample index declares for this sample")
        samples = list(_iter_samples(members, self._where))
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
