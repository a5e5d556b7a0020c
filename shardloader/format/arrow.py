"""Arrow IPC shards: one row per sample, a ``__key__`` column and one binary column per field.

Why IPC and not Parquet: IPC record batches are addressable without decoding row groups and, once
staged uncompressed, memory-map with zero copies, so reading one sample is a slice.  Stored
shards use IPC's zstd buffer compression (batches of up to ``_ROWS_PER_BATCH`` rows or about
``_BYTES_PER_BATCH`` bytes, whichever comes first).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
import pyarrow as pa
import xxhash

from shardloader.errors import ChecksumError, ShardError, UsageError
from shardloader.format.base import Format, Rows, Sample, WrittenShard, copy_fields
from shardloader.format.compress import HashingCounter, too_big
from shardloader.format.ipc import declared_sizes
from shardloader.format.registry import register_format
from shardloader.keys import key_lengths, unsafe_key_reason
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
_XXH3 = xxhash.xxh3_64_intdigest
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

    Opening finds, once, where every row's key and fields lie in the file (the columns' offset
    buffers, vectorised over whole record batches), checks every span lies inside the file and
    every key against the sidecar; after that a row is two array lookups per field and a
    slice of the map (:meth:`read_rows`), with no per-row pyarrow calls.
    """

    def __init__(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> None:
        self._where = where
        self._keys = index.keys
        sums = index.checksums if verify else None
        self._sums = None if sums is None else np.asarray(sums, np.uint64)
        self._f = open(local_path, "rb")  # noqa: SIM115 - closed in close()
        size = os.fstat(self._f.fileno()).st_size
        self._map = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        self._view = memoryview(self._map)
        try:
            self._spans = _row_spans(self._view, len(index), where)
            _check_keys(self._view, self._spans.pop(KEY_COLUMN), index.keys, where)
        except BaseException:
            self.close()
            raise
        # one row per sample: checksum (int64 bits), then (start, stop) of each field in name
        # order (-1 where null), so a batch costs one fancy index
        self._names = sorted(self._spans)
        self._encoded = [n.encode() for n in self._names]
        sums = np.zeros(len(index), np.int64) if self._sums is None else self._sums.view(np.int64)
        table = [sums]
        for name in self._names:
            table.extend(self._spans[name])
        self._table = np.stack(table, axis=1)
        del self._spans

    def read(self, i: int) -> Sample:
        rows = Rows(1)
        self.read_rows([i], rows, [0])
        if rows.errors:
            raise rows.errors[0]
        fields = {n: bytes(col[0]) for n, col in rows.fields.items() if col[0] is not None}
        return rows.keys[0], fields

    def read_rows(self, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """Rows ``rows`` for positions ``at`` of ``into``, their fields copied out of the map
        (by C-level ``map`` over the row table); with ``verify`` each row's checksum
        (:func:`row_checksum`) is computed over those copies."""
        listed = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
        picked = self._table[listed]
        keys = list(map(self._keys.__getitem__, listed))
        fields = copy_fields(self._map.__getitem__, self._names, picked, 1, all_fields=True)
        if self._sums is not None:
            columns = [fields[n] for n in self._names]
            digests = map(self._digest, keys, *columns) if columns else map(self._digest, keys)
            got = np.fromiter(digests, np.uint64, len(listed))
            bad = np.flatnonzero(got != picked[:, 0].view(np.uint64)).tolist()
            if bad:
                for k in bad:
                    into.fail(
                        at[k],
                        ChecksumError(
                            f"{self._where}: sample {keys[k]!r} does not match its checksum in "
                            "the sidecar: the shard is damaged; `shardloader verify` checks the "
                            "whole dataset (ReadOptions(verify_samples=False) skips this "
                            "per-sample check)"
                        ),
                    )
                keep = sorted(set(range(len(listed))) - set(bad))
                at = [at[k] for k in keep]
                keys = [keys[k] for k in keep]
                fields = {name: [column[k] for k in keep] for name, column in fields.items()}
        if keys:
            into.add(at, keys, fields)

    def _digest(self, key: str, *values: Any) -> int:
        """:func:`row_checksum` of a row, its fields in name order (None: absent)."""
        h = _XXH3
        digest = h(key.encode("utf-8", "surrogateescape"))
        for name, value in zip(self._encoded, values, strict=True):
            if value is not None:
                digest = h(value, h(b"%s\0%d" % (name, len(value)), digest))
        return digest

    def close(self) -> None:
        try:
            self._view.release()
            if isinstance(self._map, mmap.mmap):
                self._map.close()
        except BufferError:  # a view is still alive: the map closes when the last one goes
            pass
        self._f.close()


def _row_spans(view: memoryview, n: int, where: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Column → (start, stop) in the file of every row's value (-1 where null), read from the
    offset buffers of an uncompressed IPC file mapped at ``view``."""
    if declared_sizes(view, where).compressed:
        raise ShardError(
            f"{where}: the Arrow file has compressed buffers where an uncompressed file "
            "was expected (does the manifest say compression 'none' for a zstd shard?)"
        )
    whole = pa.py_buffer(view)
    try:
        reader = _open(pa.BufferReader(whole), where)
        batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
        names = reader.schema.names
    except (pa.ArrowInvalid, OSError) as err:
        if isinstance(err, ShardError):
            raise
        raise ShardError(f"{where}: corrupt Arrow record batch ({err})") from err
    if KEY_COLUMN not in names:
        raise ShardError(f"{where}: the Arrow file has no {KEY_COLUMN!r} column")
    total = sum(b.num_rows for b in batches)
    if total != n:
        raise ShardError(f"{where}: shard has {total} rows but its index lists {n}")
    base, size = whole.address, whole.size
    spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c, name in enumerate(names):
        parts = [_column_spans(b.column(c), base, size, name, where) for b in batches]
        starts = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        stops = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        spans[name] = (starts, stops)
    return spans


def _column_spans(
    array: pa.Array, base: int, size: int, name: str, where: str
) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) in the file of each value of a string/binary column; -1 for nulls."""
    kind = array.type
    if pa.types.is_large_binary(kind) or pa.types.is_large_string(kind):
        width: np.dtype[Any] = np.dtype("<i8")
    elif pa.types.is_binary(kind) or pa.types.is_string(kind):
        width = np.dtype("<i4")
    else:
        raise ShardError(f"{where}: column {name!r} is {kind}, not binary or string")
    n = len(array)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    validity, offsets_buf, data = array.buffers()
    outside = ShardError(
        f"{where}: column {name!r} has values outside the file (corrupt offsets, or a "
        "buffer that is not read in place)"
    )
    if offsets_buf is None or offsets_buf.size < (array.offset + n + 1) * width.itemsize:
        raise outside
    offsets = np.frombuffer(offsets_buf, width, n + 1, array.offset * width.itemsize)
    offsets = offsets.astype(np.int64)
    if (offsets[1:] < offsets[:-1]).any() or offsets[0] < 0:
        raise outside
    if data is None or data.size == 0:  # only empty values (or nulls): no data buffer
        if offsets[-1] != offsets[0]:
            raise outside
        starts = stops = np.zeros(n, np.int64)
    else:
        data_at = data.address - base
        if not 0 <= data_at <= size - data.size or offsets[-1] > data.size:
            raise outside
        starts, stops = offsets[:-1] + data_at, offsets[1:] + data_at
    if array.null_count:
        bits = np.frombuffer(validity, np.uint8)
        valid = np.unpackbits(bits, bitorder="little")[array.offset : array.offset + n]
        starts = np.where(valid.astype(bool), starts, -1)
        stops = np.where(valid.astype(bool), stops, -1)
    return starts, stops


def _check_keys(
    view: memoryview, spans: tuple[np.ndarray, np.ndarray], keys: Sequence[str], where: str
) -> None:
    """Every row's key equals its sidecar's, compared as bytes over runs of adjacent keys (one
    per record batch); a mismatch is then found row by row for the message."""
    starts, stops = spans
    lengths, kstart, joined = key_lengths(keys)
    if len(starts) == 0:
        return
    if (starts >= 0).all() and np.array_equal(stops - starts, lengths):
        buf = np.frombuffer(view, np.uint8)
        try:
            bounds = [0, *(np.flatnonzero(stops[:-1] != starts[1:]) + 1).tolist(), len(starts)]
            if all(
                np.array_equal(
                    buf[starts[a] : stops[b - 1]],
                    joined[kstart[a] : kstart[b - 1] + lengths[b - 1]],
                )
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ):
                return
        finally:
            del buf  # the map cannot close while an array exports it
    for i, (a, b) in enumerate(zip(starts.tolist(), stops.tolist(), strict=True)):
        key = None if a < 0 else bytes(view[a:b]).decode("utf-8", "surrogateescape")
        if key != keys[i]:
            raise ShardError(
                f"{where}: row {i} has key {key!r}, its sidecar says {keys[i]!r}; the shard "
                "and its .idx.arrow sidecar do not match"
            )


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
