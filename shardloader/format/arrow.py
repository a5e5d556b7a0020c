"""Arrow IPC shards: one row per sample, a ``__key__`` column and one binary column per field.

Why IPC and not Parquet: IPC record batches are addressable without decoding row groups and, once
staged uncompressed, memory-map with zero copies, so reading one sample is a slice.  Stored
shards use IPC's zstd buffer compression (batches of up to ``_ROWS_PER_BATCH`` rows or about
``_BYTES_PER_BATCH`` bytes, whichever comes first).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import pyarrow as pa
import xxhash

from shardloader.errors import ChecksumError, ShardError, UsageError
from shardloader.format.base import Format, Sample, WrittenShard
from shardloader.format.compress import HashingCounter, too_big
from shardloader.format.ipc import declared_sizes
from shardloader.format.registry import register_format
from shardloader.keys import unsafe_key_reason
from shardloader.manifest import SampleIndex
from shardloader.schema import unsafe_key_error

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo, ShardInfo

__all__ = [
    "FORMAT",
    "KEY_COLUMN",
    "ArrowFormat",
    "ArrowShardReader",
    "ArrowShardWriter",
    "row_checksum",
]

_ROWS_PER_BATCH = 1024
_BYTES_PER_BATCH = 8 << 20
KEY_COLUMN = "__key__"


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
        codec = None if compression == "none" else compression
        if codec not in (None, "zstd"):
            raise UsageError(f"arrow shards compress with 'zstd' or 'none', not {compression!r}")
        options = pa.ipc.IpcWriteOptions(compression=codec)
        self._writer = pa.ipc.new_file(
            pa.PythonFile(self._out, mode="w"), self._schema, options=options
        )
        self._rows: list[Sample] = []
        self._pending = 0
        self._keys: list[str] = []
        self._sizes: list[int] = []
        self._lengths: list[int] = []
        self._sums: list[int] = []

    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None:
        unknown = set(fields) - set(self._columns)
        if unknown:
            raise ShardError(f"sample {key!r} has fields {sorted(unknown)} not in the schema")
        self._rows.append((key, dict(fields)))
        size = sum(len(v) for v in fields.values())
        self._keys.append(key)
        self._sizes.append(size)
        self._lengths.append(-1 if length is None else length)
        self._sums.append(row_checksum(key, fields))
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
        n = len(self._keys)
        has_lengths = bool(self._lengths) and min(self._lengths) >= 0
        index = SampleIndex(
            keys=self._keys,
            offsets=np.arange(n, dtype=np.int64),
            sizes=np.asarray(self._sizes, np.int64),
            lengths=np.asarray(self._lengths, np.int64) if has_lengths else None,
            checksums=np.asarray(self._sums, np.uint64),
        )
        raw = sum(self._sizes) + sum(len(k) for k in self._keys)
        return WrittenShard(n, self._out.count, raw, self._out.sha.hexdigest(), index)


def _open(src: BinaryIO | pa.NativeFile, where: str) -> pa.ipc.RecordBatchFileReader:
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
    reader = _open(pa.BufferReader(data), where)
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
    reader = _open(pa.BufferReader(data), where)
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


class ArrowShardReader:
    """Row access on a memory-mapped uncompressed IPC file.

    The file must hold no compressed buffers (staged copies never do; a stored file of
    compression ``none`` that does contradicts its manifest): rows are zero-copy slices, and
    nothing is decompressed at a size the file alone declares.  Each row's key must equal the
    sidecar's, and with ``verify`` its checksum must too.
    """

    def __init__(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> None:
        self._where = where
        self._index = index
        self._keys = index.keys
        self._sums = index.checksums.tolist() if verify and index.checksums is not None else None
        self._mmap = pa.memory_map(local_path)
        try:
            whole = self._mmap.read_buffer()
            sizes = declared_sizes(memoryview(whole), where)
            del whole
            if sizes.compressed:
                raise ShardError(
                    f"{where}: the Arrow file has compressed buffers where an uncompressed file "
                    "was expected (does the manifest say compression 'none' for a zstd shard?)"
                )
            self._reader = _open(self._mmap, where)
            counts = [
                self._reader.get_batch(b).num_rows for b in range(self._reader.num_record_batches)
            ]
        except BaseException:
            self._mmap.close()
            raise
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        if self._starts[-1] != len(index):
            self._mmap.close()
            raise ShardError(
                f"{where}: shard has {self._starts[-1]} rows but its index lists {len(index)}"
            )

    def read(self, i: int) -> Sample:
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        batch = self._reader.get_batch(b)
        r = i - int(self._starts[b])
        names = [n for n in batch.schema.names if n != KEY_COLUMN]
        key = batch.column(KEY_COLUMN)[r].as_py()
        if key != self._keys[i]:
            raise ShardError(
                f"{self._where}: row {i} has key {key!r}, its sidecar says {self._keys[i]!r}; "
                "the shard and its .idx.arrow sidecar do not match"
            )
        fields = {}
        for n in names:
            value = batch.column(n)[r].as_py()
            if value is not None:
                fields[n] = value
        if self._sums is not None and row_checksum(key, fields) != self._sums[i]:
            raise ChecksumError(
                f"{self._where}: sample {key!r} does not match its checksum in the sidecar: the "
                "shard is damaged; `shardloader verify` checks the whole dataset "
                "(ReadOptions(verify_samples=False) skips this per-sample check)"
            )
        return key, fields

    def close(self) -> None:
        self._mmap.close()


class ArrowFormat(Format):
    """Arrow IPC shards: offsets are row numbers, ``raw_bytes`` counts keys and field bytes."""

    name = "arrow"
    suffixes = {"zstd": ".arrow", "none": ".arrow"}

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> ArrowShardWriter:
        return ArrowShardWriter(fileobj, compression, fields)

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        return len(key) + sum(size for _, size in sizes)

    def reader(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> ArrowShardReader:
        return ArrowShardReader(local_path, index, where, verify)

    def stage(
        self,
        src: BinaryIO,
        dst: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
    ) -> int:
        return stage_arrow(src, dst, where, limit)

    def iter_stored(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[Sample]:
        return iter_arrow(src, where, limit, max_member)

    def staged_bound(self, info: ShardInfo, num_fields: int) -> int:
        """``raw_bytes`` counts the field and key bytes only; an uncompressed IPC file adds
        offsets (4-8 bytes per row and column), validity bitmaps, and per-batch metadata and
        alignment (at most 8x the stored metadata), so those are allowed for."""
        per_row = 4 + 8 * num_fields + 2
        return info.raw_bytes + info.num_samples * per_row + 8 * info.bytes + (1 << 20)

    def index_problem(self, index: SampleIndex, info: ShardInfo) -> str | None:
        """Offsets are row numbers; the fields' bytes must fit ``raw_bytes``."""
        total = int(index.sizes.sum()) if len(index) else 0
        if total > info.raw_bytes:
            return (
                f"the sample index declares {total:,} bytes of fields, more than the shard's "
                f"raw_bytes {info.raw_bytes:,}"
            )
        return None


FORMAT = register_format(ArrowFormat())
