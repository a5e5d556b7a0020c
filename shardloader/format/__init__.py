"""Shard formats behind one small protocol.

A format knows three things: how to *write* samples into a (compressed) shard while recording
each sample's offset in the uncompressed stream, how to *stage* a stored shard into a local
uncompressed random-access file, and how to *read* one sample by its index entry from a staged
(or uncompressed) file.  It also *streams* a stored shard front to back (verify, index).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo, SampleIndex

__all__ = [
    "Sample",
    "WrittenShard",
    "ShardWriter",
    "ShardReader",
    "open_writer",
    "open_reader",
    "stage",
    "iter_stored",
    "shard_suffix",
]

Sample = tuple[str, dict[str, bytes]]  # (key, {extension: raw bytes})


@dataclass(frozen=True)
class WrittenShard:
    """What a writer reports on close; the pack step turns it into a ShardInfo."""

    num_samples: int
    bytes: int
    raw_bytes: int
    sha256: str
    index: SampleIndex


class ShardWriter(Protocol):
    def add(self, key: str, fields: Mapping[str, bytes], length: int | None = None) -> None: ...

    def close(self) -> WrittenShard: ...


class ShardReader(Protocol):
    def read(self, i: int) -> Sample: ...

    def close(self) -> None: ...


def shard_suffix(fmt: str, compression: str) -> str:
    """File suffix for a shard: ``.tar.zst``, ``.tar.gz``, ``.tar`` or ``.arrow``."""
    if fmt == "arrow":
        return ".arrow"
    return {"zstd": ".tar.zst", "gzip": ".tar.gz", "none": ".tar"}[compression]


def open_writer(
    fmt: str, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
) -> ShardWriter:
    if fmt == "tar":
        from shardloader.format.tar import TarShardWriter

        return TarShardWriter(fileobj, compression)
    if fmt == "arrow":
        from shardloader.format.arrow import ArrowShardWriter

        return ArrowShardWriter(fileobj, compression, fields)
    raise UsageError(f"unknown shard format {fmt!r}; choose 'tar' or 'arrow'")


def open_reader(
    fmt: str, local_path: str, index: SampleIndex, where: str, verify: bool = True
) -> ShardReader:
    """Open a local *uncompressed* shard (staged, or stored without compression).

    ``verify``: check each sample against the sidecar's checksum (when the sidecar has them).
    """
    if fmt == "tar":
        from shardloader.format.tar import TarShardReader

        return TarShardReader(local_path, index, where, verify)
    from shardloader.format.arrow import ArrowShardReader

    return ArrowShardReader(local_path, index, where, verify)


def stage(
    fmt: str, compression: str, src: BinaryIO, dst: BinaryIO, where: str, limit: int | None = None
) -> int:
    """Copy a stored shard into ``dst`` as an uncompressed random-access file; return bytes.

    ``limit``: the most bytes the copy may take (from the manifest); past it, ShardError.
    """
    if fmt == "tar":
        from shardloader.format.tar import stage_tar

        return stage_tar(src, dst, compression, where, limit)
    from shardloader.format.arrow import stage_arrow

    return stage_arrow(src, dst, where, limit)


def iter_stored(
    fmt: str, compression: str, src: BinaryIO, where: str, limit: int | None = None,
    max_member: int | None = None,
) -> Iterator[Sample]:
    """Stream every sample of a stored shard front to back, checking its structure.

    ``limit`` bounds the uncompressed bytes, ``max_member`` any one tar member's.
    """
    if fmt == "tar":
        from shardloader.format.tar import iter_tar

        return iter_tar(src, compression, where, limit, max_member)
    from shardloader.format.arrow import iter_arrow

    return iter_arrow(src, where, limit)
