"""Parquet files as shards, adopted in place by ``shardloader index`` (never written by pack).

A shard is one Parquet file, not one row group: the manifest's per-shard SHA-256 then covers
the file as it lies in the store (checked when a remote file is staged, and as every row is
read against its indexed checksum), and a shard holds what the file holds, so a Hub dump's
files give shards of similar sizes.  The row group stays the unit of reading: the reader
decodes only the row groups a batch's rows fall in, and ``index`` records each row group's
byte range and row count in the manifest (``extra["parquet"]``).  Rows are samples, columns
fields, cells stored as pack stores a Parquet column (format/parquet/table.py).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO, NoReturn

from shardloader.errors import UsageError, located
from shardloader.format.base import CheckedFormat, Sample
from shardloader.format.compress import stage_stream
from shardloader.format.parquet.reader import ParquetShardReader
from shardloader.format.parquet.scan import ParquetScan, scan_parquet
from shardloader.format.parquet.table import ParquetTable, open_parquet
from shardloader.format.registry import register_format
from shardloader.manifest import SampleIndex

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo, ShardInfo

__all__ = ["FORMAT", "ParquetFormat"]


class ParquetFormat(CheckedFormat):
    """Parquet files read in place: offsets are row numbers, ``raw_bytes`` is the file."""

    name = "parquet"
    suffixes = {"none": ".parquet"}
    stored_is_raw = True
    indexable = True
    packable = False  # registry.check_pack_format: pack writes tar, arrow or tokens shards
    projects = True  # reader(..., fields=) reads only those columns (read/shardset.py ShardSet)

    def _not_packed(self) -> NoReturn:
        raise UsageError(
            "pack does not write Parquet shards: `shardloader index` adopts existing Parquet "
            "files; pack them with --format tar, arrow or tokens"
        )

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> NoReturn:
        self._not_packed()

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        self._not_packed()

    def reader(
        self,
        local_path: str,
        index: SampleIndex,
        verify: bool = True,
        fields: Sequence[str] | None = None,
    ) -> ParquetShardReader:
        """``fields``: only these columns read (NOTE [projected checksums] in reader.py)."""
        return ParquetShardReader(local_path, index, verify, fields)

    def iter_checked(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        index: SampleIndex | None,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[tuple[Sample, int | None]]:
        """Every row as a sample (keyed as the sidecar ``index`` keys it, else as ``index``
        gives keys) with the checksum the reader checks (of that key and its cells); the file
        is spooled to a temporary file first: Parquet is read from its footer."""
        from shardloader.format.arrow.writer import row_checksum

        with located(where), tempfile.TemporaryFile(prefix="shardloader-verify-") as tmp:
            stage_stream(src, tmp, "none", limit)  # Parquet is read from its end
            tmp.seek(0)
            rows = ParquetTable(open_parquet(tmp), where).samples()
            for n, (key, fields) in enumerate(rows):
                if index is not None and n < len(index):
                    key = str(index.keys[n])
                yield (key, fields), row_checksum(key, fields)

    def scan(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        max_member: int | None,
        length_fields: Sequence[str] = (),
    ) -> ParquetScan:
        with located(where):
            return scan_parquet(src, where, max_member)

    def entry_problem(
        self, num_samples: int, stored: int, raw: int, compression: str
    ) -> tuple[str, str] | None:
        """Only ``bytes == raw_bytes``: Parquet's encodings hold many rows in a byte (a
        constant column), so no least size of a row bounds the count."""
        if raw != stored:
            return "raw_bytes", f"{raw:,} differs from bytes {stored:,} for a Parquet file"
        return None

    def index_problem(self, index: SampleIndex, info: ShardInfo) -> str | None:
        """Offsets are row numbers 0..n-1, in order."""
        if len(index) and (index.offsets != range(len(index))).any():
            return "the sample index's offsets are not the row numbers 0, 1, 2, ... in order"
        return None


FORMAT = register_format(ParquetFormat())
