"""Writing Arrow shards: rows buffered into record batches, and the checksum the sidecar records.

Why a module of its own: this is what pack workers run; nothing here reads a shard.  Stored
shards use IPC's zstd buffer compression (batches of up to ``_ROWS_PER_BATCH`` rows or about
``_BYTES_PER_BATCH`` bytes, whichever comes first).  :func:`row_checksum` defines each row's
sidecar checksum, which the reader (``format/arrow/reader.py``) recomputes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, BinaryIO

import pyarrow as pa
import xxhash

from shardloader.errors import ShardError
from shardloader.format.arrow.stream import KEY_COLUMN
from shardloader.format.base import Sample, WrittenShard
from shardloader.format.compress import HashingCounter
from shardloader.format.recorder import IndexRecorder

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo

__all__ = ["ArrowShardWriter", "row_checksum"]

_ROWS_PER_BATCH = 1024
_BYTES_PER_BATCH = 8 << 20


def row_checksum(key: str, fields: Mapping[str, bytes]) -> int:
    """XXH3-64 of a row as the sidecar records it: key, then each field's name, size and bytes
    in name order, each hash seeding the next (sizes included, so bytes cannot move between
    fields unnoticed)."""
    h = xxhash.xxh3_64_intdigest(key.encode("utf-8", "surrogateescape"))
    for name in sorted(fields):
        value = fields[name]
        h = xxhash.xxh3_64_intdigest(b"%s\0%d" % (name.encode(), len(value)), seed=h)
        h = xxhash.xxh3_64_intdigest(value, seed=h)
    return h


def _schema(fields: Mapping[str, FieldInfo]) -> pa.Schema:
    return pa.schema([(KEY_COLUMN, pa.string())] + [(f, pa.large_binary()) for f in sorted(fields)])


class ArrowShardWriter:
    """Buffers rows into record batches and writes a compressed IPC file."""

    def __init__(self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]):
        self._out = HashingCounter(fileobj)
        self._columns = sorted(fields)
        self._schema = _schema(fields)
        options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)
        self._writer = pa.ipc.new_file(
            pa.PythonFile(self._out, mode="w"), self._schema, options=options
        )
        self._rows: list[Sample] = []
        self._pending = 0
        self._index = IndexRecorder()
        self._raw = 0

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        unknown = set(fields) - set(self._columns)
        if unknown:
            raise ShardError(f"sample {key!r} has fields {sorted(unknown)} not in the schema")
        self._rows.append((key, dict(fields)))
        size = sum(len(v) for v in fields.values())
        self._index.add(key, len(self._index.keys), size, length, row_checksum(key, fields))
        self._raw += size + len(key)
        self._pending += size
        if len(self._rows) >= _ROWS_PER_BATCH or self._pending >= _BYTES_PER_BATCH:
            self._flush()

    def _flush(self) -> None:
        if not self._rows:
            return
        arrays = [pa.array([k for k, _ in self._rows], pa.string())]
        for col in self._columns:
            arrays.append(pa.array([f.get(col) for _, f in self._rows], pa.large_binary()))
        self._writer.write_batch(pa.record_batch(arrays, schema=self._schema))
        self._rows, self._pending = [], 0

    def close(self) -> WrittenShard:
        self._flush()
        self._writer.close()
        return self._index.written(self._out, self._raw, self._index.index())
