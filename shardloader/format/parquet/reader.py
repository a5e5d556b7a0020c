"""Random access to a Parquet file adopted by ``index``: rows read a row group at a time.

A row group is the unit Parquet reads (its column chunks are one byte range each), so a batch
reads each row group its rows fall in once, converts its cells as pack would
(format/parquet/table.py) and keeps the converted row groups up to ``_KEEP_BYTES``, since a
pass reads one row group's rows over several batches (unshuffled: consecutive ones; shuffled:
batches draw from every row group of the shuffle block).  With ``verify`` each row is
checked against the XXH3-64 recorded at index time, so a file changed since it was indexed
fails on the rows that changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from shardloader.errors import ChecksumError, ShardError
from shardloader.format.arrow.writer import row_checksum
from shardloader.format.base import Rows, Sample
from shardloader.format.parquet.table import ParquetTable, open_parquet
from shardloader.manifest import SampleIndex
from shardloader.pack.layouts.arrowcells import Cells

__all__ = ["ParquetShardReader"]

# Converted row groups kept per open file, by the bytes of their cells (always the last one): a
# shuffled batch draws rows from many row groups, and each is converted whole when first read.
_KEEP_BYTES = 64 << 20


class ParquetShardReader:
    """Rows of one local Parquet file (in place, or a staged copy of a remote one)."""

    def __init__(
        self, local_path: str, index: SampleIndex, where: str, verify: bool = True
    ) -> None:
        self._where = where
        self._keys = index.keys
        self._sums = None if not verify or index.checksums is None else index.checksums
        self._table = ParquetTable(open_parquet(local_path, where), where)
        if self._table.num_rows != len(index):
            self.close()
            raise ShardError(
                f"{where}: the file has {self._table.num_rows:,} rows but its sample index "
                f"lists {len(index):,}; the file changed since it was indexed: run "
                "`shardloader index` again"
            )
        self._starts = np.cumsum([0, *self._table.group_rows])
        self._groups: OrderedDict[int, tuple[dict[str, Cells], int]] = OrderedDict()
        self._kept = 0  # bytes of the cells in _groups

    @property
    def keys(self) -> Sequence[str]:
        return self._keys

    def _group(self, g: int) -> dict[str, Cells]:
        found = self._groups.get(g)
        if found is not None:
            self._groups.move_to_end(g)
            return found[0]
        cells = self._table.cells(g, int(self._starts[g]))
        size = sum(len(v) for column in cells.values() for v in column if v is not None)
        self._groups[g] = cells, size
        self._kept += size
        while self._kept > _KEEP_BYTES and len(self._groups) > 1:
            self._kept -= self._groups.popitem(last=False)[1][1]
        return cells

    def read(self, i: int) -> Sample:
        rows = Rows(1)
        self.read_rows([i], rows, [0])
        if rows.errors:
            raise rows.errors[0]
        return rows.keys[0], {n: c[0] for n, c in rows.fields.items() if c[0] is not None}

    def read_rows(self, rows: Sequence[int] | np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """Rows ``rows`` for positions ``at`` of ``into``, row group by row group."""
        listed = [int(r) for r in rows]
        groups = (np.searchsorted(self._starts, listed, side="right") - 1).tolist()
        names = self._table.names
        keys, good_at = [], []
        fields: dict[str, list[bytes | None]] = {n: [] for n in names}
        for pos, row, g in zip(at, listed, groups, strict=True):
            if not 0 <= row < len(self._keys):
                into.fail(pos, ShardError(f"{self._where}: no row {row}"))
                continue
            cells = self._group(g)
            local = row - int(self._starts[g])
            values = {n: cells[n][local] for n in names}
            key = str(self._keys[row])
            if self._sums is not None:
                present = {n: v for n, v in values.items() if v is not None}
                if row_checksum(key, present) != int(self._sums[row]):
                    into.fail(
                        pos,
                        ChecksumError(
                            f"{self._where}: sample {key!r} (row {row}) does not match its "
                            "checksum in the sidecar: the file changed since it was indexed; "
                            "run `shardloader index` again"
                        ),
                        key,
                    )
                    continue
            keys.append(key)
            good_at.append(pos)
            for n in names:
                fields[n].append(values[n])
        if keys:
            into.add(good_at, keys, dict(fields))

    def close(self) -> None:
        self._groups.clear()
        self._kept = 0
        self._table.pf.close()
