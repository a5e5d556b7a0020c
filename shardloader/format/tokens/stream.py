"""Streaming a stored token shard front to back (``verify``, ``read_back``): bounded, checked.

The token region comes first, so it is read (within the limit) and checked against its chunk
table before the records, which then take their tokens from it one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError, ShardloaderError
from shardloader.format.base import Sample
from shardloader.format.compress import (
    CHUNK,
    DECOMPRESS_ERRORS,
    cannot_decompress,
    decompressed,
    too_big,
)
from shardloader.format.keys import unsafe_key_reason
from shardloader.format.tokens.layout import HEADER_BYTES, U16, U64, Header
from shardloader.schema import unsafe_key_error

__all__ = ["iter_checked_tokens", "iter_tokens"]


class _Input:
    """Exact reads from a (decompressed) stream, never more than ``limit`` bytes in all."""

    def __init__(self, stream: BinaryIO, where: str, limit: int | None) -> None:
        self._stream, self._where, self._limit = stream, where, limit
        self._buf = b""
        self._pos = 0
        self.count = 0
        self.hash: xxhash.xxh3_64 | None = None  # when set, every byte read goes into it

    def read(self, n: int, what: str) -> bytes:
        if self._limit is not None and self.count + n > self._limit:
            raise too_big(self._where, what, self._limit, "the manifest declares (raw_bytes)")
        parts = [self._buf[self._pos : self._pos + n]]
        got = len(parts[0])
        self._pos += got
        while got < n:
            chunk = self._stream.read(max(CHUNK, n - got))
            if not chunk:
                raise ShardError(f"{self._where}: truncated token shard (in {what})")
            take = chunk[: n - got]
            parts.append(take)
            got += len(take)
            self._buf, self._pos = chunk, len(take)
        self.count += n
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        if self.hash is not None:
            self.hash.update(out)
        return out

    def at_end(self) -> bool:
        return self._pos >= len(self._buf) and not self._stream.read(1)


def iter_tokens(
    src: BinaryIO,
    compression: str,
    where: str,
    limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[Sample]:
    """Every sample of a stored token shard, front to back; the token region is held (it is
    read first) and checked against its table.  Bounded by ``limit`` and ``max_member``."""
    for sample, _ in iter_checked_tokens(src, compression, where, limit, max_member):
        yield sample


def iter_checked_tokens(
    src: BinaryIO,
    compression: str,
    where: str,
    limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[tuple[Sample, int]]:
    """:func:`iter_tokens`, each sample with the XXH3-64 its sidecar records: of its record's
    bytes, then (seeded by that) of its tokens, as the writer and the reader compute it."""
    try:
        data = _Input(decompressed(src, compression), where, limit)
        head = Header(data.read(HEADER_BYTES, "the header"), where)
        if limit is not None and head.total > limit:
            raise too_big(where, "the header's declared size", limit, "the manifest declares")
        region = data.read(head.token_bytes, "the token region")
        for c in range(-(-head.token_bytes // head.chunk) if head.chunk else 0):
            head.check_chunk(region, c, where)
        cursor, view = 0, memoryview(region)
        for _ in range(head.num_samples):
            data.hash = xxhash.xxh3_64()
            sample, used = _nextparse_record(data, head, region, cursor, where, max_member)
            digest = data.hash.intdigest()
            data.hash = None
            if used:
                digest = xxhash.xxh3_64_intdigest(view[cursor : cursor + used], seed=digest)
            cursor += used
            yield sample, digest
        if cursor != head.token_bytes or data.count != head.total or not data.at_end():
            raise ShardError(
                f"{where}: the token shard's records do not add up to its header (tokens "
                f"{cursor:,} of {head.token_bytes:,}, or bytes after the last record)"
            )
    except DECOMPRESS_ERRORS as err:
        if isinstance(err, ShardloaderError):  # the source's StorageError keeps its class
            raise
        raise cannot_decompress(where, err) from err


def _nextparse_record(
    data: _Input, head: Header, region: bytes, cursor: int, where: str, max_member: int | None
) -> tuple[Sample, int]:
    """The next record of the stream with its tokens from ``region`` at ``cursor``, and the
    token bytes it took."""
    (key_len,) = U16.unpack(data.read(2, "a record"))
    key = data.read(key_len, "a record").decode("utf-8", "surrogateescape")
    problem = unsafe_key_reason(key)
    if problem is not None:
        raise unsafe_key_error(where, key, problem)
    fields: dict[str, bytes] = {}
    used = 0
    for _ in range(data.read(1, "a record")[0]):
        name = data.read(data.read(1, "a record")[0], "a record").decode("utf-8", "replace")
        (size,) = U64.unpack(data.read(8, "a record"))
        if max_member is not None and size > max_member:
            raise ShardError(
                f"{where}: field {name!r} of sample {key!r} has {size:,} bytes, more than the "
                f"{max_member:,} allowed for one sample; the shard is corrupt or hostile"
            )
        if name == head.field:
            if cursor + used + size > head.token_bytes or size % head.itemsize:
                raise ShardError(f"{where}: sample {key!r} claims tokens past the token region")
            fields[name] = region[cursor + used : cursor + used + size]
            used += size
        else:
            fields[name] = data.read(size, f"field {name!r} of sample {key!r}")
    return (key, fields), used
