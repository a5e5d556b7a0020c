"""A Parquet file's row groups as shard fields: the cells pack would store, per row.

Why a module of its own: ``index`` (scan.py), the reader (reader.py) and ``verify``
(format.py's ``iter_stored``) must turn a row group into exactly the same bytes, or the
per-row checksums recorded at index time would not match what is read.  The conversion
itself is pack's (``shardloader/codecs/arrowcells.py``, NOTE [faithful cells]), so a
field of an adopted file equals the field ``pack`` makes of the same column.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from shardloader.codecs.arrowcells import (
    Cells,
    ColumnPlan,
    _CellError,
)
from shardloader.codecs.tableschema import plan_columns
from shardloader.errors import ShardError
from shardloader.format.rows import Sample

__all__ = ["ParquetTable", "key_stem", "open_parquet"]


def key_stem(url: str) -> str:
    """A file's sample keys are ``<file name without .parquet>/<row:09d>``."""
    base = url.rstrip("/").rsplit("/", 1)[-1]
    return base[: -len(".parquet")] if base.lower().endswith(".parquet") else base


# what pyarrow raises on a damaged file: its own errors (an unknown encoding or codec is
# ArrowNotImplementedError), OSError, and a name or text in its metadata that is not UTF-8
_UNREADABLE = (pa.ArrowException, OSError, UnicodeDecodeError)


def open_parquet(source: Any) -> pq.ParquetFile:
    """A ParquetFile over a path or a seekable file; a file that is not Parquet: ShardError
    (the caller names the file: :func:`~shardloader.errors.located`, as for every error
    here)."""
    try:
        pf = pq.ParquetFile(source)
        pf.schema_arrow  # noqa: B018 - parsed now: a damaged schema fails here, not later
        return pf
    except _UNREADABLE as err:
        raise ShardError(f"not a readable Parquet file ({err})") from err


def _unreadable(message: str) -> ShardError:
    return ShardError(f"{message}; drop or cast the column and write the file again, or pack it")


def _no_path(path: str) -> bytes:
    raise ShardError("index adopts files as they are and does not follow paths")


class ParquetTable:
    """The columns of one Parquet file as fields: their plans (pack's), row groups.

    ``features``: the file's Hugging Face features (``hf_features``), which ``index`` needs for
    the fields' codecs.  A column's cells do not depend on them (an ``Image`` struct's bytes are
    its bytes either way), so the reader and ``verify`` pass none: the manifest holds what the
    metadata said since ``index``, and damage to it cannot break a read."""

    def __init__(
        self, pf: pq.ParquetFile, url: str, features: Mapping[str, Any] | None = None
    ) -> None:
        self.pf, self.url = pf, url  # the file's URL: its keys' stem
        schema = pf.schema_arrow
        self.plans: dict[str, ColumnPlan] = plan_columns(schema, features or {}, _unreadable)
        self.names = sorted(self.plans)
        self.types = {c.name: c.type for c in schema}
        md = pf.metadata
        self.group_rows = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
        self.num_rows = sum(self.group_rows)

    def byte_ranges(self) -> list[list[int]]:
        """Per row group ``[first byte, bytes, rows]``: the span of its column chunks."""
        out = []
        md = self.pf.metadata
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            starts, ends = [], []
            for c in range(rg.num_columns):
                col = rg.column(c)
                start = col.data_page_offset
                if col.has_dictionary_page and col.dictionary_page_offset is not None:
                    start = min(start, col.dictionary_page_offset)
                starts.append(start)
                ends.append(start + col.total_compressed_size)
            first = min(starts) if starts else 0
            out.append([int(first), int(max(ends, default=first) - first), rg.num_rows])
        return out

    def read_group(self, group: int, names: list[str] | None = None) -> pa.Table:
        """Row group ``group`` as Arrow, its columns ``names`` (default: all), one byte range
        per column chunk, no conversion, validated: Parquet's reader checks neither text's
        UTF-8 nor every offset, and a damaged page must not reach the cells' conversion."""
        try:
            table = self.pf.read_row_group(
                group, columns=self.names if names is None else names, use_threads=False
            )
            table.validate(full=True)
            return table
        except _UNREADABLE as err:
            raise ShardError(f"row group {group} cannot be read ({err})") from err

    def encode(self, table: pa.Table, rows: list[int]) -> dict[str, Cells]:
        """Each column's cells of ``table``, a row group's rows ``rows`` (file row numbers,
        for messages), as pack stores them."""
        out: dict[str, Cells] = {}
        for name in table.column_names:
            column = table.column(name)
            array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
            try:
                out[name] = self.plans[name].encode(array, _no_path)
            except _CellError as err:
                raise ShardError(
                    f"row {rows[err.row]}: column {name!r} ({self.types[name]}): {err.reason}"
                ) from err
        return out

    def samples(self) -> Iterator[Sample]:
        """Every row as a sample, row group by row group: keyed ``<stem>/<row:09d>``
        (:func:`key_stem`), its fields its cells as pack stores them, a null one left out."""
        stem, row = key_stem(self.url), 0
        for group, n in enumerate(self.group_rows):
            cells = self.encode(self.read_group(group), list(range(row, row + n)))
            for i in range(n):
                fields = {name: v for name, c in cells.items() if (v := c[i]) is not None}
                yield f"{stem}/{row:09d}", fields
                row += 1
