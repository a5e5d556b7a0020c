"""Writing tar shards: member headers, and the writer that indexes each sample as it goes.

Why a module of its own: the writer and its ustar header helpers are what pack workers run,
and nothing here is needed to read a shard (``format/tar/reader.py``).  Members are sorted by
extension, mtime 0, uid/gid 0, no user names, mode 0644, so the same samples give the same
bytes; the tar is compressed as a whole (format/compress.py), and a zstd shard then carries its
sample index in a skippable frame (format/embedded.py).  The writer records each sample's offset
and size in the *uncompressed* tar, so a staged copy can be read by seeking.
"""

from __future__ import annotations

import tarfile
from collections.abc import Mapping
from typing import BinaryIO

import xxhash

from shardloader.format.base import WrittenShard
from shardloader.format.compress import CompressedSink
from shardloader.format.embedded import index_frame
from shardloader.format.recorder import IndexRecorder
from shardloader.format.tar.layout import EMPTY
from shardloader.format.tar.stream import BLOCK

__all__ = ["END", "USTAR_MAX_SIZE", "TarShardWriter", "header_size"]

END = 2 * BLOCK  # the end-of-archive marker the writer adds


def _member_header(name: str, size: int) -> bytes:
    if size < USTAR_MAX_SIZE and len(name) <= 100 and name.isascii():
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
USTAR_MAX_SIZE = 8**11


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


def header_size(name: str, size: int) -> int:
    """Bytes of the header(s) :func:`_member_header` writes for a member, computed exactly
    (the planner asks for every member that needs more than a plain ustar header)."""
    return len(_member_header(name, size))


_JOIN_BELOW = 1 << 20  # bytes of a sample joined before writing (see TarShardWriter.add)


class TarShardWriter:
    """Writes samples as tar members through zstd/gzip/no compression."""

    def __init__(self, fileobj: BinaryIO, compression: str) -> None:
        self._sink = CompressedSink(fileobj, compression)
        self._compression = compression
        self._raw = 0
        self._index = IndexRecorder()

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        """One sample; one with no fields (a row of nulls) is an empty ``<key>.__empty__``
        member, so the sample exists in the tar (``EMPTY`` in format/tar/layout.py)."""
        start = self._raw
        parts: list[bytes] = []
        if not fields:
            fields = {EMPTY: b""}
        for ext in sorted(fields):
            data = fields[ext]
            parts.append(_member_header(f"{key}.{ext}", len(data)))
            parts.append(data)
            pad = -len(data) % BLOCK
            if pad:
                parts.append(b"\0" * pad)
        size = sum(map(len, parts))
        if size < _JOIN_BELOW:  # one write and one hash: cheaper for the many small samples
            blob = b"".join(parts)
            self._sink.write(blob)
            digest = xxhash.xxh3_64_intdigest(blob)
        else:  # a large sample is written and hashed piece by piece: never a second copy
            h = xxhash.xxh3_64()
            for part in parts:
                self._sink.write(part)
                h.update(part)
            digest = h.intdigest()
        self._index.add(key, start, size, length, digest)
        self._raw += size

    def close(self) -> WrittenShard:
        self._sink.write(b"\0" * END)
        self._raw += END
        self._sink.close()
        index = self._index.index()
        if self._compression == "zstd":  # the index rides along: one GET fetches both
            # zstd buffers, as the sidecar's: raw, the copy was ~8-16 % of a text shard
            self._sink.stored.write(index_frame(index.to_arrow_bytes("zstd")))
        return self._index.written(self._sink.stored, self._raw, index)
