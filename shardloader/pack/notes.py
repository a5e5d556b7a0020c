"""What ``pack`` decides for the user, and tells them: the shard size ``auto`` picks, and advice
from what was packed (the CLI prints these as ``note:`` lines; :attr:`PackReport.notes`)."""

from __future__ import annotations

from shardloader.manifest import Manifest
from shardloader.pack.layouts.base import Source
from shardloader.pack.options import DEFAULT_SHARD_SIZE, PackOptions, auto_shard_size
from shardloader.units import human_bytes

__all__ = ["after_notes", "shard_size_for"]


def shard_size_for(options: PackOptions, source: Source) -> tuple[int, tuple[str, ...]]:
    """The shard size this pack plans with, and a note when ``auto`` chose a small one."""
    if options.shard_size is not None:
        return options.shard_size, ()
    size = auto_shard_size(source.total_bytes)
    if size >= DEFAULT_SHARD_SIZE or source.total_bytes <= size:  # one shard either way
        return size, ()
    return size, (
        f"shard size {human_bytes(size)} (auto: about an eighth of the "
        f"{human_bytes(source.total_bytes)} input, so the work splits over shards; "
        "--shard-size sets it)",
    )


def after_notes(options: PackOptions, manifest: Manifest, bytes_in: int) -> tuple[str, ...]:
    """Advice from what the pack made: tiny samples cost a tar header each."""
    samples = manifest.num_samples
    if options.format == "tar" and samples >= 1000 and bytes_in / samples < _TINY_SAMPLE:
        return (
            f"samples average {bytes_in / samples:.0f} bytes: a tar shard stores a 512-byte "
            "header and padding with each, so --format arrow packs such samples smaller",
        )
    return ()


_TINY_SAMPLE = 256  # bytes a sample, below which tar's per-member overhead dominates
