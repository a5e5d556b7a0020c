"""Random access to a Parquet file adopted by ``index``: rows read a row group at a time.

A row group is the unit Parquet reads (its column chunks are one byte range each), so a batch
reads each row group its rows fall in once, keeps the decoded Arrow row groups up to
``_KEEP_BYTES`` (a pass reads one row group's rows over several batches: unshuffled,
consecutive ones; shuffled, batches draw from every row group of the shuffle block), and
converts only the batch's rows as pack would (format/parquet/table.py): a text dump's row group
holds 100,000 rows, of which a shuffled batch wants one or two.  With ``verify`` each row is
checked against the XXH3-64 recorded at index time, so a file changed since it was indexed
fails on the rows that changed.

NOTE [projected checksums]
    ``fields`` (``ReadOptions.fields``) names the columns the loader asks for; only their
    column chunks are read and decoded.  The row's checksum covers every cell, so it cannot
    check a projected read: ``index`` also records per column the XXH3-64 of the key and that
    column's cell (of the key alone for a null: ``row_checksum(key, {name: cell})``), and a
    projected read checks each delivered cell against its own column.  What is delivered is
    then checked exactly as a whole row is: every delivered cell, bound to its key and its
    column's name and size, against a digest taken when the file was indexed; the cells not
    read are not delivered, so nothing unchecked reaches the caller.  A sidecar without these
    columns (indexed before they existed) reads and checks whole rows, and the columns not
    asked for are dropped after the check.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from shardloader.errors import ChecksumError, ShardError
from shardloader.format.arrow.writer import row_checksum
from shardloader.format.parquet.table import ParquetTable, open_parquet
from shardloader.format.rows import Rows, Sample, read_one
from shardloader.manifest import SampleIndex

__all__ = ["ParquetShardReader"]

# Decoded row groups kept per open file, by their Arrow bytes (always the last one read).
_KEEP_BYTES = 64 << 20


class ParquetShardReader:
    """Rows of one local Parquet file (in place, or a staged copy of a remote one)."""

    def __init__(
        self,
        local_path: str,
        index: SampleIndex,
        verify: bool = True,
        fields: Sequence[str] | None = None,
    ) -> None:
        self._keys = index.keys
        self._sums = None if not verify or index.checksums is None else index.checksums
        self._field_sums: dict[str, np.ndarray] | None = None
        self._table = ParquetTable(open_parquet(local_path), local_path)
        names = self._table.names
        # the columns delivered, and those read (all of them to check a whole row's checksum);
        # a field that is no column (an alias's logical name) reads every column
        if fields is not None and not set(fields) <= set(names):
            fields = None
        self._names = names if fields is None else [n for n in names if n in set(fields)]
        self._read = names
        if fields is not None:
            per = index.field_checksums
            if not verify or self._sums is None:
                self._read = self._names
            elif per is not None and all(n in per for n in self._names):
                self._read = self._names
                self._field_sums = {n: per[n] for n in self._names}
                self._sums = None
        if self._table.num_rows != len(index):
            self.close()
            raise ShardError(
                f"the file has {self._table.num_rows:,} rows but its sample index "
                f"lists {len(index):,}; the file changed since it was indexed: run "
                "`shardloader index` again"
            )
        self._starts = np.cumsum([0, *self._table.group_rows])
        self._groups: OrderedDict[int, pa.Table] = OrderedDict()
        self._kept = 0  # Arrow bytes of the tables in _groups

    @property
    def keys(self) -> Sequence[str]:
        return self._keys

    def _group(self, g: int) -> pa.Table:
        table = self._groups.get(g)
        if table is not None:
            self._groups.move_to_end(g)
            return table
        table = self._table.read_group(g, self._read)
        self._groups[g] = table
        self._kept += table.nbytes
        while self._kept > _KEEP_BYTES and len(self._groups) > 1:
            self._kept -= self._groups.popitem(last=False)[1].nbytes
        return table

    def read(self, i: int) -> Sample:
        return read_one(self, i)

    def read_rows(self, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """Rows ``rows`` for positions ``at`` of ``into``, row group by row group."""
        listed = [int(r) for r in rows]
        names = self._names
        keys: list[str] = []
        good_at: list[int] = []
        fields: dict[str, list[bytes | None]] = {n: [] for n in names}
        inside = [k for k, row in enumerate(listed) if 0 <= row < len(self._keys)]
        for k in sorted(set(range(len(listed))) - set(inside)):
            into.fail(at[k], ShardError(f"no row {listed[k]}"))
        groups = np.searchsorted(self._starts, [listed[k] for k in inside], side="right") - 1
        by_group: dict[int, list[int]] = {}
        for k, g in zip(inside, groups.tolist(), strict=True):
            by_group.setdefault(g, []).append(k)
        for g, ks in by_group.items():
            first = int(self._starts[g])
            wanted = [listed[k] for k in ks]
            table = self._group(g).take(pa.array([r - first for r in wanted], pa.int64()))
            cells = self._table.encode(table, wanted)
            for j, k in enumerate(ks):
                row, pos = listed[k], at[k]
                key = str(self._keys[row])
                if self._sums is not None:
                    present = {n: v for n in self._read if (v := cells[n][j]) is not None}
                    if row_checksum(key, present) != int(self._sums[row]):
                        into.fail(pos, self._damaged(key, row), key)
                        continue
                elif self._field_sums is not None:
                    ok = self._cell_ok
                    bad = next((n for n in names if not ok(key, row, n, cells[n][j])), None)
                    if bad is not None:
                        into.fail(pos, self._damaged(key, row, bad), key)
                        continue
                keys.append(key)
                good_at.append(pos)
                for n in names:
                    fields[n].append(cells[n][j])
        if keys:
            into.add(good_at, keys, dict(fields))

    def _cell_ok(self, key: str, row: int, name: str, value: bytes | None) -> bool:
        """Whether column ``name``'s cell ``value`` of ``row`` matches its own checksum (NOTE
        [projected checksums])."""
        assert self._field_sums is not None
        got = row_checksum(key, {} if value is None else {name: value})
        return got == int(self._field_sums[name][row])

    def _damaged(self, key: str, row: int, column: str | None = None) -> ChecksumError:
        what = "its checksum" if column is None else f"the checksum of its column {column!r}"
        return ChecksumError(
            f"sample {key!r} (row {row}) does not match {what} in the "
            "sidecar: the file changed since it was indexed; run `shardloader index` again"
        )

    def close(self) -> None:
        self._groups.clear()
        self._kept = 0
        self._table.pf.close()
