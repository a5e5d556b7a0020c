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
        groups = np.searchsorted(self._starts, listed, side="right") - 1
        by_group: dict[int, list[tuple[int, int]]] = {}
        for pos, row, g in zip(at, listed, groups.tolist(), strict=True):
            if 0 <= row < len(self._keys):
                by_group.setdefault(g, []).append((pos, row))
            else:
                into.fail(pos, ShardError(f"no row {row}"))
        good_at: list[int] = []
        keys: list[str] = []
        fields: dict[str, list[bytes | None]] = {n: [] for n in self._names}
        for g, wanted in by_group.items():
            first = int(self._starts[g])
            table = self._group(g).take(pa.array([row - first for _, row in wanted], pa.int64()))
            cells = self._table.encode(table, [row for _, row in wanted])
            for j, (pos, row) in enumerate(wanted):
                key = str(self._keys[row])
                damage = self._damage(key, row, {n: column[j] for n, column in cells.items()})
                if damage is not None:
                    into.fail(pos, damage, key)
                    continue
                good_at.append(pos)
                keys.append(key)
                for n, column in fields.items():
                    column.append(cells[n][j])
        if keys:
            into.add(good_at, keys, fields)

    def _damage(self, key: str, row: int, cells: dict[str, bytes | None]) -> ChecksumError | None:
        """The error of a row whose cells (those read) do not match the sidecar's checksum of the
        row, or of a column (NOTE [projected checksums]); None when they do or are not checked."""
        if self._sums is not None:
            present = {n: v for n, v in cells.items() if v is not None}
            if row_checksum(key, present) == int(self._sums[row]):
                return None
            what = "its checksum"
        elif self._field_sums is not None:
            sums = self._field_sums
            bad = [
                n
                for n, v in cells.items()
                if row_checksum(key, {} if v is None else {n: v}) != int(sums[n][row])
            ]
            if not bad:
                return None
            what = f"the checksum of its column {bad[0]!r}"
        else:
            return None
        return ChecksumError(
            f"sample {key!r} (row {row}) does not match {what} in the "
            "sidecar: the file changed since it was indexed; run `shardloader index` again"
        )

    def close(self) -> None:
        self._groups.clear()
        self._kept = 0
        self._table.pf.close()
