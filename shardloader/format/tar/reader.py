"""Random access to staged tar shards: one sample by its index entry, or a batch in one pass.

Why a module of its own: this is the read path's hot loop (a worker keeps one reader per open
shard), apart from writing (``format/tar/writer.py``) and streaming a stored shard front to back
(``format/tar/stream.py``, whose member parser is the slow path here, and which names the
problem in a sample that is not as its sidecar says).
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence
from typing import BinaryIO, cast

import numpy as np
import xxhash

from shardloader.errors import ShardError
from shardloader.format.compress import Bounded
from shardloader.format.keys import key_lengths
from shardloader.format.mapped import LARGE, MappedFile
from shardloader.format.rows import Rows, Sample, copy_fields, damaged, read_each
from shardloader.format.tar.layout import EMPTY, derive_layout
from shardloader.format.tar.stream import BLOCK, iter_members, iter_samples
from shardloader.manifest import SampleIndex

__all__ = ["TarShardReader"]

_XXH3 = xxhash.xxh3_64_intdigest
# read_rows derives the layout of at least this many rows at once (numpy's per-call cost is
# then shared); fewer underived rows are parsed one by one (large samples, few per batch)
_DERIVE_AT_LEAST = 96
_DERIVE_CHUNK = 2048  # rows derived ahead per read (about 2 ms)


def _fields_in(
    buf: mmap.mmap | bytes, start: int, end: int, key: str, copy: Callable[[int, int], bytes]
) -> dict[str, bytes] | None:
    """Fast path for one sample of plain ustar members named ``key.ext``, read in place (the
    headers from ``buf``, each member's data by ``copy(start, stop)``).

    Header checksums are not recomputed here: staged shards were verified whole against the
    manifest's SHA-256, and any header that does not look like ours (pax/GNU records, another
    key, a non-octal size) returns None, so the caller falls back to the general parser, which
    also produces the precise error.
    """
    fields: dict[str, bytes] = {}
    prefix = (key + ".").encode("utf-8", "surrogateescape")
    plen = len(prefix)
    pos = start
    while pos < end:
        if buf[pos + 156 : pos + 157] not in (b"0", b"\0") or buf[pos : pos + plen] != prefix:
            return None
        name_end = buf.find(b"\0", pos, pos + 100)
        ext = buf[pos + plen : name_end if name_end >= 0 else pos + 100]
        try:
            size = int(buf[pos + 124 : pos + 135], 8)
        except ValueError:
            return None
        if not ext or b"/" in ext:
            return None
        data_start = pos + BLOCK
        if data_start + size > end:  # never copy past the sample's extent in the sidecar
            return None
        name = ext.decode("utf-8", "surrogateescape")
        if name in fields:
            return None
        if name != EMPTY:  # the marker of a sample with no fields is no field
            fields[name] = copy(data_start, data_start + size)
        pos = data_start + size + (-size % BLOCK)
    return fields if pos == end else None


class _Span:
    """Bytes ``[start, start + size)`` of a staged file as a stream (the general parser's
    input), read by :meth:`MappedFile.copy`: a large member's data is one file read."""

    def __init__(self, file: MappedFile, start: int, size: int) -> None:
        self._file, self._at, self._end = file, start, start + size

    def read(self, n: int = -1) -> bytes:
        n = self._end - self._at if n < 0 else min(n, self._end - self._at)
        data = self._file.copy(self._at, self._at + n)
        self._at += n
        return data


class TarShardReader:
    """Random access to samples of an uncompressed local tar via its sample index.

    The file is memory-mapped: a sample costs slices of the page cache, no seek/read calls.
    With ``verify`` and a sidecar that has per-sample checksums, each sample's byte range is
    hashed (XXH3-64) and compared before it is parsed.

    :meth:`read_rows` reads a batch in one pass: where each sample's fields lie is derived with
    numpy for many samples at once (:mod:`shardloader.format.tar.layout`, :meth:`prepare`), so a
    sample costs its checksum and a copy per field; samples the layout does not cover, and
    batches with few underived samples, take the per-sample parser (:meth:`read`'s).
    """

    def __init__(self, local_path: str, index: SampleIndex, verify: bool = True) -> None:
        self._file = MappedFile(local_path)
        self._file.populate()  # NOTE [populating the map] in format/mapped.py
        self._map, self._view, self._size = self._file.map, self._file.view, self._file.size
        self._offsets = np.asarray(index.offsets, np.int64)
        self._sizes = np.asarray(index.sizes, np.int64)
        sums = index.checksums if verify else None
        self._sums = None if sums is None else np.asarray(sums, np.uint64)
        self._keys = index.keys
        self._rows_table: np.ndarray | None = None  # see _table
        self._early = 0  # rows read one by one before the first derivation (read_rows)
        self._chunked = 0  # rows [0, _chunked) were offered to prepare() (_with_next_chunk)
        # key lengths (and without checksums, to compare names with, their starts and bytes)
        self._key_bytes: tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None = None
        self._names: list[str] = []  # the fields the table has columns for

    def read(self, i: int) -> Sample:
        """Sample ``i`` checked against its sidecar checksum (with ``verify``) before it is
        parsed: ShardError where the file's end cuts it short or it does not match its
        checksum or its sidecar (``.item()``: cheaper than numpy's scalars, for the many
        one-by-one reads)."""
        offset, size = self._offsets.item(i), self._sizes.item(i)
        want = None if self._sums is None else self._sums.item(i)
        key = self._keys[i]
        if offset + size > self._size:
            raise ShardError(f"truncated shard: sample {key!r} is cut short")
        if want is not None:
            got = self._file.digest(offset, offset + size)
            if got != want:
                raise damaged(
                    f"sample {key!r} (bytes {offset}..{offset + size}) has checksum {got:016x}, "
                    f"its sidecar says {want:016x}"
                )
        fields = _fields_in(self._map, offset, offset + size, key, self._file.copy)
        if fields is not None:
            return key, fields
        span = cast(BinaryIO, _Span(self._file, offset, size))
        members = Bounded(span, size, "the sample index declares for this sample")
        samples = list(iter_samples(iter_members(members, False)))
        if len(samples) != 1 or samples[0][0] != key:
            raise ShardError(
                f"sample index says {key!r} at byte {offset}, found "
                f"{[k for k, _ in samples]}; the shard and its .idx.arrow sidecar do not match"
            )
        return samples[0]

    def _table(self) -> np.ndarray:
        """One row per sample, so a batch costs one fancy index: byte range (offset, end), the
        layout's state (0: not derived yet, 1: derived, 2: the layout does not describe the
        sample), then (start, stop) of each field of ``self._names`` (-1: absent); int32
        where the file allows (a worker keeps one per open shard)."""
        if self._rows_table is None:
            kind = np.int32 if self._size < 2**31 else np.int64
            n = len(self._offsets)
            ends = self._offsets + self._sizes
            self._rows_table = np.stack([self._offsets, ends, np.zeros(n, np.int64)], axis=1)
            self._rows_table = self._rows_table.astype(kind)
        return self._rows_table

    def prepare(self, rows: Sequence[int] | np.ndarray) -> None:
        """Derive the layout of ``rows`` (those not derived yet) in one vectorised pass, so
        numpy's per-call cost is shared by many rows (NOTE [what the layout trusts]);
        :meth:`read_rows` calls it for the rows it reads."""
        table = self._table()
        wanted = np.asarray(rows, np.int64)
        todo = np.unique(wanted[table[wanted, 2] == 0])
        if todo.size == 0:
            return
        if self._key_bytes is None:  # the keys' bytes are kept only to compare names with
            lengths, starts, encoded = key_lengths(self._keys)
            keep = self._sums is None
            self._key_bytes = (lengths, starts, encoded) if keep else (lengths, None, None)
        klen, kstart, joined = self._key_bytes
        buf = np.frombuffer(self._map, np.uint8) if self._size else np.zeros(0, np.uint8)
        try:
            layout = derive_layout(
                buf,
                self._offsets[todo],
                self._sizes[todo],
                klen[todo],
                (kstart[todo], joined) if kstart is not None and joined is not None else None,
            )
        finally:
            del buf  # the map cannot close while an array exports it
        for name in sorted(set(layout.fields) - set(self._names)):  # a field not seen yet
            self._names.append(name)
            more = np.full((len(table), 2), -1, table.dtype)
            table = np.concatenate([table, more], axis=1)
        self._rows_table = table
        table[todo, 2] = np.where(layout.regular, 1, 2)
        for name, (starts, stops) in layout.fields.items():
            f = 3 + 2 * self._names.index(name)
            table[todo, f] = starts
            table[todo, f + 1] = stops

    def _with_next_chunk(self, listed: list[int]) -> np.ndarray:
        """``listed`` and the next :data:`_DERIVE_CHUNK` rows of the shard not offered yet:
        shuffled batches take a few rows of each shard, too few to share numpy's per-call cost,
        so each read derives a chunk more until the whole shard is (never all at once: the
        first batch does not wait for it)."""
        lo = self._chunked
        hi = min(lo + _DERIVE_CHUNK, len(self._offsets))
        self._chunked = hi
        return np.concatenate([np.asarray(listed, np.int64), np.arange(lo, hi)])

    def read_rows(self, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """Samples ``rows`` for positions ``at`` of ``into``.

        Per sample a checksum and a copy of each field out of the map, each made by C-level
        ``map`` over the row table's columns rather than a Python loop, the copies right after
        the checksums while the pages are fresh in the caches; samples the layout does not
        describe, or whose checksum differs, go through :meth:`read`, which names the problem.
        """
        listed = rows.tolist() if isinstance(rows, np.ndarray) else list(rows)
        if self._rows_table is None and self._early + len(listed) < _DERIVE_AT_LEAST:
            # the first reads of a shard: one by one, no derivation before them, so the first
            # batches (a worker's first bundle: NOTE [raw bundles]) do not wait for a chunk's
            # layout per shard and read (measured: 16 batches of documents over 12 shards
            # came 28 ms after the first, mostly deriving); no numpy calls at all
            self._early += len(listed)
            read_each(self.read, zip(at, listed, strict=True), into, self._keys)
            return
        index = np.array(listed, np.intp)  # one conversion for the table's and the sums' lookups
        picked = self._table()[index]
        state = picked[:, 2]
        if not state.all():  # derive the missing layouts, and the next chunk of the shard's
            self.prepare(self._with_next_chunk(listed))
            picked = self._table()[index]
            state = picked[:, 2]
        slow: list[tuple[int, int]] = []
        fast = (state == 1) & (picked[:, 1] - picked[:, 0] < LARGE)  # large: read() reads
        if not fast.all():  # few underived rows (one by one is cheaper), irregular or large ones
            slow = [(at[k], listed[k]) for k in np.flatnonzero(~fast).tolist()]
            keep = np.flatnonzero(fast).tolist()
            listed, at, picked = [listed[k] for k in keep], [at[k] for k in keep], picked[keep]
            index = index[keep]
        if self._sums is not None and listed:
            get = self._view.__getitem__
            spans = map(slice, picked[:, 0].tolist(), picked[:, 1].tolist())
            digests = np.fromiter(map(_XXH3, map(get, spans)), np.uint64, len(listed))
            good = digests == self._sums[index]
            if not good.all():  # read() names the damaged samples
                slow += [(at[k], listed[k]) for k in np.flatnonzero(~good).tolist()]
                keep = np.flatnonzero(good).tolist()
                listed, at, picked = [listed[k] for k in keep], [at[k] for k in keep], picked[keep]
        # a slice of the map is a bytes copy; a field no row has stays out, as in read()
        fields = copy_fields(self._map.__getitem__, self._names, picked, 3, all_fields=False)
        if listed:
            into.add(at, list(map(self._keys.__getitem__, listed)), fields)
        if slow:
            read_each(self.read, slow, into, self._keys)

    def close(self) -> None:
        self._file.close()
