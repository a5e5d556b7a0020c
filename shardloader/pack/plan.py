"""Cut the sample stream into shards, and shards into parts: pure functions of the stream.

NOTE [shard boundaries]: boundaries are decided here, in the main process, from sizes known
before any byte is compressed: the exact *uncompressed* size of each sample in the shard format,
as the format states it (``Format.sample_raw_size``; tar: member headers + data padded to 512
bytes; arrow: field bytes + key, as the writers count ``raw_bytes``).  So the same input and
options give the same shards whatever the compression, ``--workers`` or ``--num-parts``.
Fields derived in the workers (``tokens``) are not known here and are not counted.

NOTE [parts]: shard ``n`` of the single-machine plan belongs to part ``n mod N``.  Every part
walks the whole stream (listing files costs a ``stat``; record files are read, not written), so
each knows the global number of its shards and ``merge`` can restore the single-machine order
exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from shardloader.format.registry import get_format, shard_suffix
from shardloader.pack.refs import SampleRef

__all__ = [
    "ShardPlan",
    "Planner",
    "field_size",
    "sample_raw_size",
    "tar_header_size",
    "shard_names",
    "part_of",
]


@dataclass(frozen=True)
class ShardPlan:
    """One shard of the plan: its global number and its samples in order."""

    number: int
    samples: tuple[SampleRef, ...]
    raw_bytes: int  # planned uncompressed size (fields known up front)


def tar_header_size(name: str, size: int) -> int:
    """Bytes of the pax/ustar header(s) format/tar.py writes for a member, computed exactly."""
    from shardloader.format.tar import header_size

    return header_size(name, size)


def field_size(value: object) -> int:
    return len(value) if isinstance(value, bytes) else value.size  # type: ignore[attr-defined]


def sample_raw_size(fmt: str, sample: SampleRef) -> int:
    """Uncompressed bytes the sample adds to a shard of format ``fmt``."""
    return get_format(fmt).sample_raw_size(
        sample.key, [(ext, field_size(v)) for ext, v in sample.fields]
    )


class Planner:
    """Groups samples into :class:`ShardPlan` s; ``current`` is the shard being filled.

    A shard closes before the sample that would push it past ``shard_size`` bytes (0: no limit)
    or when it holds ``max_samples`` samples; a single bigger sample gets a shard of its own.
    """

    def __init__(self, fmt: str, shard_size: int, max_samples: int | None) -> None:
        self.fmt = fmt
        self.format = get_format(fmt)
        self.shard_size = shard_size
        self.max_samples = max_samples
        self.current = 0

    def shards(self, samples: Iterable[SampleRef]) -> Iterator[ShardPlan]:
        base = self.format.shard_overhead
        raw_size = self.format.sample_raw_size
        batch: list[SampleRef] = []
        size = base
        for sample in samples:
            sizes = [(e, len(v) if isinstance(v, bytes) else v.size) for e, v in sample.fields]
            add = raw_size(sample.key, sizes)
            full = bool(batch) and (
                (self.shard_size > 0 and size + add > self.shard_size)
                or (self.max_samples is not None and len(batch) >= self.max_samples)
            )
            if full:
                yield ShardPlan(self.current, tuple(batch), size)
                self.current += 1
                batch, size = [], base
            batch.append(sample)
            size += add
        if batch:
            yield ShardPlan(self.current, tuple(batch), size)
            self.current += 1

    @property
    def planned(self) -> int:
        """Shards planned so far (all of them once :meth:`shards` is exhausted)."""
        return self.current


def part_of(number: int, num_parts: int) -> int:
    """Which part packs shard ``number`` (round robin: balanced, needs no total up front)."""
    return number % num_parts


def shard_names(
    number: int, fmt: str, compression: str, part: int | None = None, local_number: int = 0
) -> tuple[str, str]:
    """(shard file, sidecar file) names; parts name shards ``part-PPPP-shard-LLLLL``."""
    stem = f"shard-{number:05d}" if part is None else f"part-{part:04d}-shard-{local_number:05d}"
    return stem + shard_suffix(fmt, compression), stem + ".idx.arrow"
