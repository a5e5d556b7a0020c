"""Stored Arrow shards front to back: their rows streamed (``verify``), or staged uncompressed.

Why a module of its own: both read untrusted compressed files and are bounded before pyarrow
decompresses anything (NOTE [bounded formats] in format/base.py), which random access to a
staged copy (``format/arrow/reader.py``) never does.  It also holds what writer and reader share
about the file: the key column's name, and opening an IPC file as a ShardError when it is not one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

import pyarrow as pa

from shardloader.errors import ShardError
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.format.base import Sample
from shardloader.format.compress import check_size, too_big
from shardloader.format.keys import check_key

__all__ = ["KEY_COLUMN", "arrow_errors", "checked_batch", "iter_arrow", "open_ipc", "stage_arrow"]

KEY_COLUMN = "__key__"
_ALLOWED = "the manifest allows for this shard"


def open_ipc(src: BinaryIO | pa.NativeFile) -> pa.ipc.RecordBatchFileReader:
    """The IPC file in ``src``, with a key column; one pyarrow cannot open is a ShardError."""
    try:
        reader = pa.ipc.open_file(src)
        names = reader.schema.names  # not UTF-8 in a damaged file: a UnicodeDecodeError
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        raise ShardError(f"not a readable Arrow IPC shard ({err})") from err
    if KEY_COLUMN not in names:
        raise ShardError(f"the Arrow file has no {KEY_COLUMN!r} column")
    return reader


@contextmanager
def arrow_errors() -> Iterator[None]:
    """pyarrow's errors inside as a ShardError (a corrupt record batch); shardloader's own pass."""
    try:
        yield
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"corrupt Arrow record batch ({err})") from err


def checked_batch(reader: pa.ipc.RecordBatchFileReader, b: int) -> pa.RecordBatch:
    """Batch ``b`` of ``reader``, fully validated before anything reads it.

    pyarrow trusts an IPC file's offsets and lengths: reading a value through corrupt ones
    crashes the process (a segfault, or an abort on a huge allocation) instead of raising, and a
    string that is not UTF-8 raises a bare UnicodeDecodeError.  ``validate(full=True)`` checks
    every offset, length and string once per batch, in C++, so a damaged or hostile shard whose
    checksum was rewritten is a ShardError like any other."""
    batch = reader.get_batch(b)
    try:
        batch.validate(full=True)
    except pa.ArrowInvalid as err:
        raise ShardError(f"corrupt Arrow record batch {b} ({err})") from err
    return batch


def _open_bounded(src: BinaryIO, limit: int | None) -> pa.ipc.RecordBatchFileReader:
    """The stored IPC file in ``src``, refused first when its batches would decompress past
    ``limit``, before pyarrow does."""
    data = src.read()
    declared = declared_sizes(data).uncompressed_bytes
    if limit is not None and declared > limit:
        raise too_big(f"its batches' declared {declared:,} bytes", limit, _ALLOWED)
    return open_ipc(pa.BufferReader(data))


def iter_arrow(
    src: BinaryIO, limit: int | None = None, max_member: int | None = None
) -> Iterator[Sample]:
    """Stream the rows of a stored Arrow shard; ``limit`` bounds what its batches decompress to,
    ``max_member`` the bytes of any one field."""
    reader = _open_bounded(src, limit)
    with arrow_errors():
        for b in range(reader.num_record_batches):
            for row in checked_batch(reader, b).to_pylist():
                key = row.pop(KEY_COLUMN)
                fields = {name: value for name, value in row.items() if value is not None}
                check_key(key)
                for name, value in fields.items():
                    check_size(f"field {name!r} of sample {key!r}", len(value), max_member)
                yield key, fields


def stage_arrow(src: BinaryIO, dst: BinaryIO, limit: int | None = None) -> int:
    """Rewrite a (compressed) IPC shard uncompressed so it memory-maps with zero copies.

    The batches' declared sizes are checked against ``limit`` first, and the output after each
    batch, so neither memory nor the cache takes more than ``limit`` bytes.
    """
    reader = _open_bounded(src, limit)
    sink = pa.PythonFile(dst, mode="w")
    before = dst.tell()
    with arrow_errors(), pa.ipc.new_file(sink, reader.schema) as writer:
        for b in range(reader.num_record_batches):
            writer.write_batch(checked_batch(reader, b))
            if limit is not None and dst.tell() - before > limit:
                raise too_big("the staged shard", limit, _ALLOWED)
    return dst.tell() - before
