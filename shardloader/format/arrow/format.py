"""Arrow IPC shards: one row per sample, a ``__key__`` column and one binary column per field.

Why IPC and not Parquet: IPC record batches are addressable without decoding row groups and, once
staged uncompressed, memory-map with zero copies, so reading one sample is a slice.  This module
is the format object and its registration; writing is format/arrow/writer.py (zstd buffer
compression, the rows' sidecar checksums), random access to a staged copy format/arrow/reader.py,
streaming and staging a stored shard format/arrow/stream.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO

from shardloader.errors import located
from shardloader.format.arrow.reader import ArrowShardReader
from shardloader.format.arrow.stream import iter_arrow, stage_arrow
from shardloader.format.arrow.writer import ArrowShardWriter, row_checksum
from shardloader.format.base import CheckedFormat, Sample
from shardloader.format.registry import register_format
from shardloader.manifest import SampleIndex

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo, ShardInfo

__all__ = ["FORMAT", "ArrowFormat", "row_checksum"]


class ArrowFormat(CheckedFormat):
    """Arrow IPC shards: offsets are row numbers, ``raw_bytes`` counts keys and field bytes."""

    name = "arrow"
    suffixes = {"zstd": ".arrow", "none": ".arrow"}

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> ArrowShardWriter:
        return ArrowShardWriter(fileobj, compression, fields)

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        return len(key) + sum(size for _, size in sizes)

    def reader(self, local_path: str, index: SampleIndex, verify: bool = True) -> ArrowShardReader:
        return ArrowShardReader(local_path, index, verify)

    def stage(
        self, src: BinaryIO, dst: BinaryIO, compression: str, limit: int | None = None
    ) -> int:
        return stage_arrow(src, dst, limit)

    def iter_checked(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        index: SampleIndex | None,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[tuple[Sample, int | None]]:
        """Each row with :func:`row_checksum` of its key and fields, as the reader computes
        it."""
        with located(where):
            for key, fields in iter_arrow(src, limit, max_member):
                yield (key, fields), row_checksum(key, fields)

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
