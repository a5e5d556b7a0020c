"""Random access to staged Arrow shards: rows as slices of a memory-mapped, uncompressed file.

Why a module of its own: this is the read path's hot loop (a worker keeps one reader per open
shard), apart from writing (``format/arrow/writer.py``) and from streaming or staging a stored
shard (``format/arrow/stream.py``).  Opening a reader checks the whole file once, so a row
costs array lookups and copies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from shardloader.errors import ShardError
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.format.arrow.stream import KEY_COLUMN, arrow_errors, open_ipc
from shardloader.format.arrow.writer import row_checksum
from shardloader.format.keys import key_lengths
from shardloader.format.mapped import LARGE, MappedFile
from shardloader.format.rows import Rows, Sample, copy_fields, damaged, read_one
from shardloader.manifest import SampleIndex

__all__ = ["ArrowShardReader"]

_XXH3 = xxhash.xxh3_64_intdigest


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

    def __init__(self, local_path: str, index: SampleIndex, verify: bool = True) -> None:
        self._keys = index.keys
        sums = index.checksums if verify else None
        self._sums = None if sums is None else np.asarray(sums, np.uint64)
        self._file = MappedFile(local_path)
        self._file.populate()  # NOTE [populating the map] in format/mapped.py
        self._map, self._view = self._file.map, self._file.view
        try:
            self._spans = _row_spans(self._view, len(index))
            key_spans = self._spans.pop(KEY_COLUMN)
            _check_keys(self._view, key_spans, index.keys)
        except BaseException:
            self.close()
            raise
        # one row per sample: checksum (int64 bits), (start, stop) of its key, then of each
        # field in name order (-1 where null), so a batch costs one fancy index
        self._names = sorted(self._spans)
        # each field's "<name>\0<size>" as a bytes template (``%`` escaped): the checksum's
        # header of a value, made by C-level ``map`` over the sizes (see _digests)
        self._headers = [n.encode().replace(b"%", b"%%") + b"\0%d" for n in self._names]
        sums = np.zeros(len(index), np.int64) if self._sums is None else self._sums.view(np.int64)
        table = [sums, *key_spans]
        for name in self._names:
            table.extend(self._spans[name])
        self._table = np.stack(table, axis=1)
        del self._spans

    def read(self, i: int) -> Sample:
        return read_one(self, i)

    def read_rows(self, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """Rows ``rows`` for positions ``at`` of ``into``, their fields copied out of the map
        (by C-level ``map`` over the row table); with ``verify`` each row's checksum
        (:func:`~shardloader.format.arrow.writer.row_checksum`) is computed over those copies."""
        listed = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
        picked = self._table[listed]
        keys = list(map(self._keys.__getitem__, listed))
        get: Callable[[slice], Any] = self._map.__getitem__
        if listed and self._names and int((picked[:, 4::2] - picked[:, 3::2]).max()) >= LARGE:
            get = self._file.get  # a large value: read through the file, not the map
        fields = copy_fields(get, self._names, picked, 3, all_fields=True)
        if self._sums is not None:
            got = self._digests(picked, keys, fields)
            bad = got != picked[:, 0].view(np.uint64)
            if bad.any():
                for k in np.flatnonzero(bad).tolist():
                    what = f"sample {keys[k]!r} does not match its checksum in the sidecar"
                    into.fail(at[k], damaged(what), keys[k])
                keep = np.flatnonzero(~bad).tolist()
                at, keys = [at[k] for k in keep], [keys[k] for k in keep]
                fields = {name: [column[k] for k in keep] for name, column in fields.items()}
        if keys:
            into.add(at, keys, fields)

    def _digests(
        self, picked: np.ndarray, keys: list[str], fields: dict[str, list[Any]]
    ) -> np.ndarray:
        """:func:`~shardloader.format.arrow.writer.row_checksum` of each picked row, over the
        copies in ``fields`` and the row's key bytes in the file (equal to its sidecar key:
        checked at open), chained by C-level ``map`` (no Python call per row): per row it is
        a few hash calls, which a Python function per row would double.  A column with a null
        takes ``row_checksum`` per row (the null field is left out of its row's hash)."""
        h, n, names = _XXH3, len(picked), self._names
        columns = [fields[name] for name in names]
        if any(None in column for column in columns):
            rows = zip(*columns, strict=True)
            present = ({f: v for f, v in zip(names, r, strict=True) if v is not None} for r in rows)
            digests = map(row_checksum, keys, present)
            return np.fromiter(digests, np.uint64, n)
        spans = map(slice, picked[:, 1].tolist(), picked[:, 2].tolist())
        chained: Any = map(h, map(self._view.__getitem__, spans))  # the key's hash
        for header, column in zip(self._headers, columns, strict=True):
            heads = map(header.__mod__, map(len, column))  # b"<name>\0<size>"
            chained = map(h, column, map(h, heads, chained))  # seeded by the previous
        return np.fromiter(chained, np.uint64, n)

    def close(self) -> None:
        self._file.close()


def _row_spans(view: memoryview, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Column → (start, stop) in the file of every row's value (-1 where null), read from the
    offset buffers of an uncompressed IPC file mapped at ``view``."""
    if declared_sizes(view).compressed:
        raise ShardError(
            "the Arrow file has compressed buffers where an uncompressed file "
            "was expected (does the manifest say compression 'none' for a zstd shard?)"
        )
    whole = pa.py_buffer(view)
    reader = open_ipc(pa.BufferReader(whole))
    with arrow_errors():
        batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
    names = reader.schema.names
    total = sum(b.num_rows for b in batches)
    if total != n:
        raise ShardError(f"shard has {total} rows but its index lists {n}")
    base, size = whole.address, whole.size
    spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for c, name in enumerate(names):
        parts = [_column_spans(b.column(c), base, size, name) for b in batches]
        starts = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)
        stops = np.concatenate([p[1] for p in parts]) if parts else np.zeros(0, np.int64)
        spans[name] = (starts, stops)
    return spans


def _column_spans(
    array: pa.Array, base: int, size: int, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """(start, stop) in the file of each value of a string/binary column; -1 for nulls."""
    kind = array.type
    if pa.types.is_large_binary(kind) or pa.types.is_large_string(kind):
        width: np.dtype[Any] = np.dtype("<i8")
    elif pa.types.is_binary(kind) or pa.types.is_string(kind):
        width = np.dtype("<i4")
    else:
        raise ShardError(f"column {name!r} is {kind}, not binary or string")
    n = len(array)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    validity, offsets_buf, data = array.buffers()
    outside = ShardError(
        f"column {name!r} has values outside the file (corrupt offsets, or a "
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
    view: memoryview, spans: tuple[np.ndarray, np.ndarray], keys: Sequence[str]
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
                f"row {i} has key {key!r}, its sidecar says {keys[i]!r}; the shard "
                "and its .idx.arrow sidecar do not match"
            )
