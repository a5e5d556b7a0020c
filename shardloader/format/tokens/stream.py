"""Streaming a stored token shard front to back (``verify``, ``read_back``): bounded, checked.

The token region comes first, so it is read (within the limit) and checked against its chunk
table before the records, which then take their tokens from it one by one.  Both regions are
held, as the writer holds them (at most the shard's ``raw_bytes``), and the records are parsed
by the reader's own parser (``layout.parse_record``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError
from shardloader.format.compress import Bounded, check_size, decompressed, decompressing, too_big
from shardloader.format.keys import check_key
from shardloader.format.rows import Sample
from shardloader.format.tokens.layout import HEADER_BYTES, Header, parse_record

__all__ = ["iter_tokens"]

_XXH3 = xxhash.xxh3_64_intdigest


def iter_tokens(
    src: BinaryIO,
    compression: str,
    limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[tuple[Sample, int]]:
    """Every sample of a stored token shard, front to back, each with the XXH3-64 its sidecar
    records: of its record's bytes, then (seeded by that) of its tokens, as the writer and the
    reader compute it.  The token region is checked against its table first.  Bounded by
    ``limit`` and ``max_member``."""
    with decompressing():
        data = Bounded(decompressed(src, compression), limit)
        head = Header(data.read_exact(HEADER_BYTES, "the header"))
        if limit is not None and head.total > limit:
            raise too_big("the header's declared size", limit, "the manifest declares")
        region = data.read_exact(head.token_bytes, "the token region")
        for c in range(-(-head.token_bytes // head.chunk) if head.chunk else 0):
            head.check_chunk(region, c)
        records = data.read_exact(head.record_bytes, "the records")
        after = data.read(1)
    tokens, records_view = memoryview(region), memoryview(records)
    cursor = pos = 0
    for _ in range(head.num_samples):
        key, found, end = parse_record(records, pos, len(records), head.field)
        check_key(key)
        digest = _XXH3(records_view[pos:end])
        fields: dict[str, bytes] = {}
        for name, at, size in found:
            check_size(f"field {name!r} of sample {key!r}", size, max_member)
            if at >= 0:
                fields[name] = records[at : at + size]
                continue
            if cursor + size > head.token_bytes or size % head.itemsize:
                raise ShardError(f"sample {key!r} claims tokens past the token region")
            fields[name] = region[cursor : cursor + size]
            digest = _XXH3(tokens[cursor : cursor + size], seed=digest)
            cursor += size
        pos = end
        yield (key, fields), digest
    if cursor != head.token_bytes or pos != len(records) or after:
        raise ShardError(
            f"the token shard's records do not add up to its header (tokens "
            f"{cursor:,} of {head.token_bytes:,}, or bytes after the last record)"
        )
