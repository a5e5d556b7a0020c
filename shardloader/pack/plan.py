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

import numpy as np

from shardloader.format.registry import get_format
from shardloader.pack.refs import LineRun, SampleRef

__all__ = [
    "Piece",
    "ShardPlan",
    "Planner",
    "shard_names",
    "part_of",
]


Piece = SampleRef | LineRun  # what a shard plan holds: samples, and runs of lines by position


@dataclass(frozen=True)
class ShardPlan:
    """One shard of the plan: its global number and its samples in order (a
    :class:`~shardloader.pack.refs.LineRun` stands for several)."""

    number: int
    samples: tuple[Piece, ...]
    raw_bytes: int  # planned uncompressed size (fields known up front)

    @property
    def num_samples(self) -> int:
        return sum(p.num_lines if isinstance(p, LineRun) else 1 for p in self.samples)


class Planner:
    """Groups samples into :class:`ShardPlan` s; ``current`` is the shard being filled.

    A shard closes before the sample that would push it past ``shard_size`` bytes (0: no limit)
    or when it holds ``max_samples`` samples; a single bigger sample gets a shard of its own.
    A run of lines is cut by the same rule, with numpy over its sizes.
    """

    def __init__(self, fmt: str, shard_size: int, max_samples: int | None) -> None:
        self.format = get_format(fmt)
        self.shard_size = shard_size
        self.max_samples = max_samples
        self.current = 0
        self._pieces: list[Piece] = []
        self._count = 0  # samples in the shard being filled
        self._size = self.format.shard_overhead

    def shards(self, samples: Iterable[Piece]) -> Iterator[ShardPlan]:
        raw_size = self.format.sample_raw_size
        for sample in samples:
            if isinstance(sample, LineRun):
                yield from self._run(sample)
                continue
            sizes = [(e, len(v) if isinstance(v, bytes) else v.size) for e, v in sample.fields]
            add = raw_size(sample.key, sizes)
            too_big = self.shard_size > 0 and self._size + add > self.shard_size
            if self._count and (too_big or self._count == self.max_samples):  # full
                yield self._close()
            self._pieces.append(sample)
            self._count += 1
            self._size += add
        if self._count:
            yield self._close()

    def _close(self) -> ShardPlan:
        plan = ShardPlan(self.current, tuple(self._pieces), self._size)
        self.current += 1
        self._pieces, self._count, self._size = [], 0, self.format.shard_overhead
        return plan

    def _run(self, run: LineRun) -> Iterator[ShardPlan]:
        keys = [f"{run.stem}/{n:09d}" for n in run.numbers.tolist()]
        raw = self.format.record_raw_sizes(keys, run.kind, run.lengths)
        ends = np.cumsum(raw)  # ends[j]: bytes of lines 0..j
        lo, n = 0, len(raw)
        while lo < n:
            before = int(ends[lo - 1]) if lo else 0
            hi = n
            if self.shard_size > 0:  # lines lo..hi-1 fit while ends[j] - before <= room
                room = self.shard_size - self._size
                hi = int(np.searchsorted(ends, before + room, side="right"))
            if self.max_samples is not None:
                hi = min(hi, lo + self.max_samples - self._count)
            if hi <= lo:
                if self._count:  # the open shard is full: close it, then try again
                    yield self._close()
                    continue
                hi = lo + 1  # a single bigger line gets a shard of its own
            self._pieces.append(run.part(lo, hi))
            self._count += hi - lo
            self._size += int(ends[hi - 1]) - before
            lo = hi  # a shard closes when the next sample does not fit: as for single ones


def part_of(number: int, num_parts: int) -> int:
    """Which part packs shard ``number`` (round robin: balanced, needs no total up front)."""
    return number % num_parts


def shard_names(
    number: int, fmt: str, compression: str, part: int | None = None, local_number: int = 0
) -> tuple[str, str]:
    """(shard file, sidecar file) names; parts name shards ``part-PPPP-shard-LLLLL``."""
    stem = f"shard-{number:05d}" if part is None else f"part-{part:04d}-shard-{local_number:05d}"
    return stem + get_format(fmt).suffix(compression), stem + ".idx.arrow"
