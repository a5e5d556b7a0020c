"""Stored Arrow shards front to back: their rows streamed (``verify``), or staged uncompressed.

Why a module of its own: both read untrusted compressed files and are bounded before pyarrow
decompresses anything (NOTE [bounded formats] in format/base.py), which random access to a
staged copy (``format/arrow/reader.py``) never does.  It also holds what writer and reader share
about the file: the key column's name, and opening an IPC file as a ShardError when it is not one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import BinaryIO

import pyarrow as pa

from shardloader.errors import ShardError
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.format.base import Sample
from shardloader.format.compress import too_big
from shardloader.format.keys import unsafe_key_reason
from shardloader.schema import unsafe_key_error

__all__ = ["KEY_COLUMN", "iter_arrow", "open_ipc", "stage_arrow"]

KEY_COLUMN = "__key__"


def open_ipc(src: BinaryIO | pa.NativeFile, where: str) -> pa.ipc.RecordBatchFileReader:
    """The IPC file in ``src``; one pyarrow cannot open is a ShardError naming ``where``."""
    try:
        return pa.ipc.open_file(src)
    except (pa.ArrowInvalid, OSError) as err:
        raise ShardError(f"{where}: not a readable Arrow IPC shard ({err})") from err


def _rows(batch: pa.RecordBatch) -> Iterator[Sample]:
    names = [n for n in batch.schema.names if n != KEY_COLUMN]
    keys = batch.column(KEY_COLUMN).to_pylist()
    cols = [batch.column(n) for n in names]
    for r, key in enumerate(keys):
        fields = {}
        for name, col in zip(names, cols, strict=False):
            value = col[r].as_py()
            if value is not None:
                fields[name] = value
        yield key, fields


def _check_declared(data: bytes | memoryview, where: str, limit: int | None) -> None:
    """Refuse a file whose batches would decompress past ``limit``, before pyarrow does."""
    sizes = declared_sizes(data, where)
    if limit is not None and sizes.uncompressed_bytes > limit:
        raise too_big(
            where,
            f"its batches' declared {sizes.uncompressed_bytes:,} bytes",
            limit,
            "the manifest allows for this shard",
        )


def iter_arrow(
    src: BinaryIO, where: str, limit: int | None = None, max_member: int | None = None
) -> Iterator[Sample]:
    """Stream the rows of a stored Arrow shard; ``limit`` bounds what its batches decompress to,
    ``max_member`` the bytes of any one field."""
    data = src.read()
    _check_declared(data, where, limit)
    reader = open_ipc(pa.BufferReader(data), where)
    try:
        for b in range(reader.num_record_batches):
            for key, fields in _rows(reader.get_batch(b)):
                problem = unsafe_key_reason(key)
                if problem is not None:
                    raise unsafe_key_error(where, key, problem)
                if max_member is not None:
                    _check_member(key, fields, max_member, where)
                yield key, fields
    except (pa.ArrowInvalid, OSError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: corrupt Arrow record batch ({err})") from err


def _check_member(key: str, fields: Mapping[str, bytes], max_member: int, where: str) -> None:
    for name, value in fields.items():
        if len(value) > max_member:
            raise ShardError(
                f"{where}: field {name!r} of sample {key!r} has {len(value):,} bytes, more than "
                f"the {max_member:,} allowed for one sample; the shard is corrupt or hostile"
            )


def stage_arrow(src: BinaryIO, dst: BinaryIO, where: str, limit: int | None = None) -> int:
    """Rewrite a (compressed) IPC shard uncompressed so it memory-maps with zero copies.

    The batches' declared sizes are checked against ``limit`` first, and the output after each
    batch, so neither memory nor the cache takes more than ``limit`` bytes.
    """
    data = src.read()
    _check_declared(data, where, limit)
    reader = open_ipc(pa.BufferReader(data), where)
    sink = pa.PythonFile(dst, mode="w")
    before = dst.tell()
    try:
        with pa.ipc.new_file(sink, reader.schema) as writer:
            for b in range(reader.num_record_batches):
                writer.write_batch(reader.get_batch(b))
                if limit is not None and dst.tell() - before > limit:
                    raise too_big(
                        where, "the staged shard", limit, "the manifest allows for this shard"
                    )
    except (pa.ArrowInvalid, OSError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: corrupt Arrow record batch ({err})") from err
    return dst.tell() - before
