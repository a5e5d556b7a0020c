"""Streaming a stored token shard front to back (``verify``, ``read_back``): bounded, checked.

The token region comes first, so it is read (within the limit) and checked against its chunk
table before the records, which then take their tokens from it one by one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError
from shardloader.format.base import Sample
from shardloader.format.compress import Bounded, decompressed, decompressing, too_big
from shardloader.format.keys import check_key
from shardloader.format.tokens.layout import HEADER_BYTES, U16, U64, Header

__all__ = ["iter_tokens"]


def iter_tokens(
    src: BinaryIO,
    compression: str,
    limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[tuple[Sample, int]]:
    """Every sample of a stored token shard, front to back, each with the XXH3-64 its sidecar
    records: of its record's bytes, then (seeded by that) of its tokens, as the writer and the
    reader compute it.  The token region is held (it is read first) and checked against its
    table.  Bounded by ``limit`` and ``max_member``."""
    with decompressing():
        data = Bounded(decompressed(src, compression), limit)
        head = Header(data.read_exact(HEADER_BYTES, "the header"))
        if limit is not None and head.total > limit:
            raise too_big("the header's declared size", limit, "the manifest declares")
        region = data.read_exact(head.token_bytes, "the token region")
        for c in range(-(-head.token_bytes // head.chunk) if head.chunk else 0):
            head.check_chunk(region, c)
        cursor, view = 0, memoryview(region)
        for _ in range(head.num_samples):
            record = xxhash.xxh3_64()
            data.on_data = record.update
            sample, used = _next_record(data, head, region, cursor, max_member)
            data.on_data = None
            digest = record.intdigest()
            if used:
                digest = xxhash.xxh3_64_intdigest(view[cursor : cursor + used], seed=digest)
            cursor += used
            yield sample, digest
        if cursor != head.token_bytes or data.pos != head.total or data.read(1):
            raise ShardError(
                f"the token shard's records do not add up to its header (tokens "
                f"{cursor:,} of {head.token_bytes:,}, or bytes after the last record)"
            )


def _next_record(
    data: Bounded, head: Header, region: bytes, cursor: int, max_member: int | None
) -> tuple[Sample, int]:
    """The next record of the stream with its tokens from ``region`` at ``cursor``, and the
    token bytes it took."""
    (key_len,) = U16.unpack(data.read_exact(2, "a record"))
    key = data.read_exact(key_len, "a record").decode("utf-8", "surrogateescape")
    check_key(key)
    fields: dict[str, bytes] = {}
    used = 0
    for _ in range(data.read_exact(1, "a record")[0]):
        name_len = data.read_exact(1, "a record")[0]
        name = data.read_exact(name_len, "a record").decode("utf-8", "replace")
        (size,) = U64.unpack(data.read_exact(8, "a record"))
        if max_member is not None and size > max_member:
            raise ShardError(
                f"field {name!r} of sample {key!r} has {size:,} bytes, more than the "
                f"{max_member:,} allowed for one sample; the shard is corrupt or hostile"
            )
        if name == head.field:
            if cursor + used + size > head.token_bytes or size % head.itemsize:
                raise ShardError(f"sample {key!r} claims tokens past the token region")
            fields[name] = region[cursor + used : cursor + used + size]
            used += size
        else:
            fields[name] = data.read_exact(size, f"field {name!r} of sample {key!r}")
    return (key, fields), used
