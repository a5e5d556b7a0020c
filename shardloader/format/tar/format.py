"""POSIX (pax) tar shards, webdataset-compatible: one sample = consecutive members sharing a key.

This module is the format object and its registration: the sizes the planner and the manifest
checks rely on, and which module does what.  Writing is format/tar/writer.py (deterministic
members, the tar compressed as a whole, a zstd shard's sample index in a skippable frame);
random access to a staged copy format/tar/reader.py (offsets and sizes in the *uncompressed*
tar, batches laid out by format/tar/layout.py); streaming a stored shard format/tar/stream.py;
shardloader ``index`` adopts existing tar shards through format/tar/index.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from shardloader.errors import located
from shardloader.format.base import CheckedFormat, Sample, ScannedShard
from shardloader.format.registry import register_format
from shardloader.format.tar.index import scan_tar
from shardloader.format.tar.reader import TarShardReader
from shardloader.format.tar.stream import BLOCK, SpanDigests, iter_tar, split_key
from shardloader.format.tar.writer import END, USTAR_MAX_SIZE, TarShardWriter, header_size
from shardloader.manifest import SampleIndex

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo

__all__ = ["BLOCK", "FORMAT", "TarFormat", "split_key"]


class TarFormat(CheckedFormat):
    """Tar shards: byte offsets into the uncompressed tar, 512-byte blocks."""

    name = "tar"
    suffixes = {"zstd": ".tar.zst", "gzip": ".tar.gz", "none": ".tar"}
    index_suffixes = {".tgz": "gzip", ".tar.zstd": "zstd"}
    min_sample_bytes = BLOCK  # at least one member header
    end_bytes = BLOCK  # at least one zero block (GNU tar and we write two)
    alignment = BLOCK
    shard_overhead = END
    stored_is_raw = True
    indexable = True

    def writer(
        self, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
    ) -> TarShardWriter:
        return TarShardWriter(fileobj, compression)

    def sample_raw_size(self, key: str, sizes: Sequence[tuple[str, int]]) -> int:
        plain = key.isascii()
        room = 99 - len(key)  # ``key.ext`` fits a plain ustar name (100 bytes)
        total = 0
        for ext, size in sizes:
            if plain and size < USTAR_MAX_SIZE and len(ext) <= room and ext.isascii():
                head = BLOCK  # the common member: no pax record (the planner's hot path)
            else:
                head = header_size(f"{key}.{ext}", size)
            total += head + size + (-size % BLOCK)
        return total or BLOCK  # no fields: the writer's empty marker member

    def record_raw_sizes(self, keys: Sequence[str], ext: str, sizes: np.ndarray) -> np.ndarray:
        """Vectorised when every ``key.ext`` fits a plain ustar header (the usual case)."""
        longest = max(map(len, keys), default=0)
        plain = (
            longest + 1 + len(ext) <= 100
            and ext.isascii()
            and "".join(keys).isascii()
            and (not len(sizes) or int(sizes.max()) < USTAR_MAX_SIZE)
        )
        if not plain:
            return super().record_raw_sizes(keys, ext, sizes)
        sizes = sizes.astype(np.int64)
        return BLOCK + sizes + (-sizes % BLOCK)

    def reader(self, local_path: str, index: SampleIndex, verify: bool = True) -> TarShardReader:
        return TarShardReader(local_path, index, verify)

    def iter_checked(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        index: SampleIndex | None,
        limit: int | None = None,
        max_member: int | None = None,
    ) -> Iterator[tuple[Sample, int | None]]:
        """Each sample with the XXH3-64 of the bytes its sidecar span covers, as the reader
        hashes them (``stream.SpanDigests``)."""
        spans = None if index is None else SpanDigests(index.offsets.tolist(), index.sizes.tolist())
        with located(where):
            yield from iter_tar(src, compression, limit, max_member, spans)

    def scan(
        self,
        src: BinaryIO,
        compression: str,
        where: str,
        max_member: int | None,
        length_fields: Sequence[str] = (),
    ) -> ScannedShard:
        with located(where):
            return scan_tar(src, compression, max_member, length_fields)


FORMAT = register_format(TarFormat())
