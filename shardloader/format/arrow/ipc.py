"""What an Arrow IPC file's batches will decompress to, read from its metadata alone.

pyarrow allocates each compressed buffer at the uncompressed length the file declares, before
anything could look at it, so a 64 KiB file can ask for gigabytes.  This module reads the
file's footer and each batch's message metadata (FlatBuffers, parsed by hand: a few fields of
a fixed schema) and sums those declared lengths, so callers can refuse a file *before* pyarrow
decompresses it.  Layout: ``format/File.fbs`` and ``format/Message.fbs`` of Apache Arrow.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shardloader.errors import ShardError

__all__ = ["BatchSizes", "declared_sizes"]

_MAGIC = b"ARROW1"
_RECORD_BATCH, _DICTIONARY_BATCH = 3, 2


@dataclass(frozen=True)
class BatchSizes:
    """Declared totals over every record and dictionary batch of a file."""

    compressed: bool  # some batch uses IPC buffer compression
    uncompressed_bytes: int  # what its buffers take once decompressed


class _Bad(Exception):
    pass


class _Flat:
    """Bounds-checked reads of a FlatBuffer inside ``buf[base:end]``."""

    def __init__(self, buf: memoryview, base: int, end: int) -> None:
        self.buf, self.base, self.end = buf, base, end

    def num(self, fmt: str, pos: int) -> int:
        """The number of struct format ``fmt`` at ``pos``, inside the metadata."""
        if not self.base <= pos <= self.end - struct.calcsize(fmt):
            raise _Bad(f"offset {pos} outside the metadata")
        return int(struct.unpack_from(fmt, self.buf, pos)[0])

    def root(self) -> int:
        return self.base + self.num("<I", self.base)

    def field(self, table: int, index: int) -> int | None:
        vtable = table - self.num("<i", table)
        size = self.num("<H", vtable)
        slot = 4 + 2 * index
        if slot + 2 > size:
            return None
        off = self.num("<H", vtable + slot)
        return table + off if off else None

    def ref(self, pos: int) -> int:
        return pos + self.num("<I", pos)

    def vector(self, table: int, index: int) -> tuple[int, int]:
        """(start, length) of a vector field; (0, 0) when absent."""
        pos = self.field(table, index)
        if pos is None:
            return 0, 0
        start = self.ref(pos)
        return start + 4, self.num("<I", start)


def _blocks(flat: _Flat, footer: int, index: int) -> list[tuple[int, int, int]]:
    start, n = flat.vector(footer, index)
    if n > (flat.end - start) // 24:
        raise _Bad("block list longer than the footer")
    # struct Block { offset: long; metaDataLength: int; (pad 4) bodyLength: long } = 24 bytes
    out = []
    for i in range(n):
        at = start + 24 * i
        out.append((flat.num("<q", at), flat.num("<i", at + 8), flat.num("<q", at + 16)))
    return out


def _batch_sizes(buf: memoryview, offset: int, meta_len: int, body_len: int) -> tuple[bool, int]:
    size = len(buf)
    if offset < 0 or meta_len < 8 or body_len < 0 or offset + meta_len + body_len > size:
        raise _Bad(f"batch at byte {offset} lies outside the file")
    prefix = struct.unpack_from("<I", buf, offset)[0]
    base = offset + (8 if prefix == 0xFFFFFFFF else 4)
    flat = _Flat(buf, base, offset + meta_len)
    message = flat.root()
    kind_pos = flat.field(message, 1)
    header_pos = flat.field(message, 2)
    if kind_pos is None or header_pos is None:
        raise _Bad("message without a header")
    kind = flat.num("<B", kind_pos)
    header = flat.ref(header_pos)
    if kind == _DICTIONARY_BATCH:
        data = flat.field(header, 1)
        if data is None:
            raise _Bad("dictionary batch without data")
        header = flat.ref(data)
    elif kind != _RECORD_BATCH:
        raise _Bad(f"message type {kind} where a batch belongs")
    compressed = flat.field(header, 3) is not None
    start, n = flat.vector(header, 2)
    if n > (flat.end - start) // 16:
        raise _Bad("buffer list longer than the metadata")
    body = offset + meta_len
    total = 0
    for i in range(n):
        b_off, b_len = flat.num("<q", start + 16 * i), flat.num("<q", start + 16 * i + 8)
        if b_off < 0 or b_len < 0 or b_off + b_len > body_len:
            raise _Bad("buffer outside its batch body")
        if not compressed or b_len == 0:
            total += b_len
            continue
        if b_len < 8:
            raise _Bad("compressed buffer shorter than its length prefix")
        declared = struct.unpack_from("<q", buf, body + b_off)[0]
        total += b_len - 8 if declared == -1 else declared
        if declared < -1:
            raise _Bad("negative buffer length")
    return compressed, total


def declared_sizes(data: memoryview | bytes) -> BatchSizes:
    """Sum what every batch of an Arrow IPC file declares; ShardError if it is malformed."""
    buf = memoryview(data).cast("B")
    size = len(buf)
    try:
        if size < 18 or bytes(buf[:6]) != _MAGIC or bytes(buf[size - 6 :]) != _MAGIC:
            raise _Bad("no Arrow file magic")
        footer_len = struct.unpack_from("<i", buf, size - 10)[0]
        base = size - 10 - footer_len
        if footer_len <= 0 or base < 8:
            raise _Bad("bad footer length")
        flat = _Flat(buf, base, size - 10)
        footer = flat.root()
        compressed, total = False, 0
        for index in (2, 3):  # dictionaries, recordBatches
            for offset, meta_len, body_len in _blocks(flat, footer, index):
                c, t = _batch_sizes(buf, offset, meta_len, body_len)
                compressed, total = compressed or c, total + t
    except (_Bad, struct.error) as err:
        raise ShardError(f"not a readable Arrow IPC shard ({err})") from err
    return BatchSizes(compressed, total)
