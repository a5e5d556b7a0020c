"""Deterministic blending of several sources by weight: pure functions, no randomness.

NOTE [the blend]: every process must agree on which source each position of the mixed stream
comes from, and after any prefix of ``n`` positions source ``s`` must have had ``w_s * n``
positions within one (``|count_s(n) - w_s n| <= 1``).  Megatron's greedy rule (the source
furthest below ``w_s (n + 1)``) keeps that for two sources but drifts past one sample for
some weights of more (4:5:5:25:25:25 reaches 1.03: tests/test_mixture.py); the chairman
assignment problem (Tijdeman 1980) has the exact answer.  Each source's ``j``-th pick
(``j`` = 1, 2, ...) may sit at positions ``n`` with
``(j - B) / w_s <= n <= (j - 1 + B) / w_s + 1``, and placing picks earliest deadline first
fills every position with ``B = 1 - 1/Q`` (Steiner and Yeomans 1993).  Weights are integer
parts ``q_s`` of ``Q = sum(q)``, so every window is exact integer arithmetic and the blend
repeats with period ``Q`` (each period holds exactly ``q_s`` picks of source ``s``): counts at
any position are ``(n // Q) * q + counts(period[: n % Q])``, with no simulation of the past.

A *mixture epoch* is ``epoch_samples`` consecutive positions of the blended stream.  Weights
may change from a mixture epoch on (a schedule): each segment of the schedule starts a fresh
blend where the previous one stopped, so every segment keeps the bound for its own weights.
Each source walks its own stream of epochs (its own seeded permutation each), so within each
of its epochs every sample comes exactly once, whatever the mixture does.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from shardloader.errors import UsageError
from shardloader.options import ShuffleOptions
from shardloader.plan.lists import node_order

__all__ = ["MAX_PARTS", "integer_parts", "blend_period", "blend_counts", "MixOrder"]

MAX_PARTS = 1 << 16  # weights that need a finer period are rounded to 1/65536


def integer_parts(weights: Sequence[float]) -> tuple[int, ...]:
    """Weights as the smallest integer parts with the same ratios (``0.7, 0.3`` → ``7, 3``);
    weights that would need more than :data:`MAX_PARTS` parts are rounded to that many
    (largest remainder, every positive weight keeps at least one part)."""
    fracs = []
    for w in weights:
        number = isinstance(w, (int, float, np.integer, np.floating)) and not isinstance(w, bool)
        if not number or not math.isfinite(float(w)) or w < 0:
            raise UsageError(f"a weight must be a finite number >= 0, got {w!r}")
        fracs.append(
            Fraction(repr(float(w))) if isinstance(w, (float, np.floating)) else Fraction(int(w))
        )
    total = sum(fracs)
    if total == 0:
        raise UsageError(f"at least one weight must be positive, got {list(weights)}")
    denominator = math.lcm(*(f.denominator for f in fracs))
    parts = [int(f * denominator) for f in fracs]
    g = math.gcd(*parts)
    parts = [p // g for p in parts]
    if sum(parts) <= MAX_PARTS:
        return tuple(parts)
    exact = [f / total * MAX_PARTS for f in fracs]
    rounded = [max(int(e), 1) if e > 0 else 0 for e in exact]
    positive = [i for i, e in enumerate(exact) if e > 0]
    by_remainder = sorted(positive, key=lambda i: (-(exact[i] - int(exact[i])), i))
    # floors lose less than one part each: fewer parts are missing than there are weights
    for i in by_remainder[: max(MAX_PARTS - sum(rounded), 0)]:
        rounded[i] += 1
    while sum(rounded) > MAX_PARTS:  # minimums pushed it over: take from the largest
        rounded[rounded.index(max(rounded))] -= 1
    g = math.gcd(*rounded)
    return tuple(r // g for r in rounded)


@functools.lru_cache(maxsize=16)
def blend_period(parts: tuple[int, ...]) -> np.ndarray:
    """Source of each position of one period (``sum(parts)`` positions, ``parts[s]`` of source
    ``s``): earliest deadline first over the windows of NOTE [the blend], ties to the lower
    source index.  Cached per process; read-only."""
    total = sum(parts)
    out = np.empty(total, np.int32)
    # pick j of source s (1-based) is released at ceil(((j-1)Q + 1) / q_s) and due at
    # floor((jQ - 1) / q_s) + 1: B = 1 - 1/Q in integers
    # (release, source, j): pick 1 is released at ceil(1 / q_s) = 1 (a sorted list is a heap)
    releases = [(1, s, 1) for s, q in enumerate(parts) if q]
    ready: list[tuple[int, int, int]] = []  # (deadline, source, j)
    for n in range(1, total + 1):
        while releases and releases[0][0] <= n:
            _, s, j = heapq.heappop(releases)
            heapq.heappush(ready, ((j * total - 1) // parts[s] + 1, s, j))
        deadline, s, j = heapq.heappop(ready)
        if deadline < n:  # cannot happen (the theorem); kept so a bug cannot pass silently
            raise AssertionError(f"blend of {parts} missed a deadline at position {n}")
        out[n - 1] = s
        if j < parts[s]:
            heapq.heappush(releases, (-(-(j * total + 1) // parts[s]), s, j + 1))
    out.setflags(write=False)
    return out


def blend_counts(parts: tuple[int, ...], n: int) -> np.ndarray:
    """Picks of each source among the first ``n`` positions of the blend (int64)."""
    total = sum(parts)
    period = blend_period(parts)
    whole, rest = divmod(int(n), total)
    counts = np.asarray(parts, np.int64) * whole
    return counts + np.bincount(period[:rest], minlength=len(parts)).astype(np.int64)


@functools.lru_cache(maxsize=32)
def _source_epoch(
    sizes: tuple[int, ...], seed: int, epoch: int, shuffle: ShuffleOptions, nodes: int = 1
) -> np.ndarray:
    """A source's own epoch order; with several partitions their orders dealt in turn
    (position ``c`` from partition ``c mod nodes``: NOTE [mixture partitions] in MixOrder);
    one partition's order is the epoch order."""
    units = np.asarray(sizes, np.int64)
    order = np.empty(int(units.sum()), np.int64)
    for n in range(nodes):
        order[n::nodes] = np.asarray(node_order(seed, shuffle, epoch, nodes, n, units))
    order.setflags(write=False)
    return order


@dataclass(frozen=True)
class MixOrder:
    """The blended order of a mixture epoch over *virtual* sample ids: source ``s``'s local id
    ``i`` is ``offsets[s] + i``.  Pure: every rank and worker computes the same order.

    ``schedule``: ``(from_epoch, parts)`` entries, first from epoch 0, epochs increasing.
    """

    shard_sizes: tuple[tuple[int, ...], ...]  # per source, its shards' sample counts
    seeds: tuple[int, ...]  # per source, the seed of its own epoch orders
    shuffles: tuple[ShuffleOptions, ...]
    epoch_samples: int
    schedule: tuple[tuple[int, tuple[int, ...]], ...]
    # NOTE [stages]: ``(stream position, parts)`` from position 0 on, increasing; when given
    # they replace ``schedule`` and the weights change mid-epoch; ``stage_key`` names them in
    # the signature by optimizer step (what stays equal at a resume on another world)
    stages: tuple[tuple[int, tuple[int, ...]], ...] = ()
    stage_key: str = ""

    def segments(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """``(first stream position, stop or None, parts)`` of each blend segment: a stage,
        or a run of mixture epochs with one weight (each segment a fresh blend)."""
        starts = self.stages or tuple((e * self.epoch_samples, p) for e, p in self.schedule)
        stops = [s for s, _ in starts[1:]] + [None]
        return [(a, b, p) for (a, p), b in zip(starts, stops, strict=True)]

    @property
    def sizes(self) -> np.ndarray:
        return np.array([sum(s) for s in self.shard_sizes], np.int64)

    @property
    def offsets(self) -> np.ndarray:
        sizes = self.sizes
        return np.cumsum(sizes) - sizes

    def signature(self) -> str:
        """What fixes sample identity and order apart from the weights (which may change at a
        resume: the schedule travels in the loader state, not in the plan signature)."""
        shuffles = ",".join(s.signature() for s in self.shuffles)
        stages = f";stages={self.stage_key}" if self.stage_key else ""
        return (
            f"mix(samples={self.epoch_samples};seeds={list(self.seeds)};"
            f"shuffle=[{shuffles}]{stages})"
        )

    def parts_at(self, epoch: int) -> tuple[int, ...]:
        """The integer weights in force at the start of mixture epoch ``epoch``."""
        at = epoch * self.epoch_samples
        return next(p for a, b, p in self.segments() if b is None or at < b)

    def cursors(self, epoch: int) -> np.ndarray:
        """Samples each source has given before mixture epoch ``epoch`` (its stream position):
        each segment a fresh blend, counted in closed form."""
        position = epoch * self.epoch_samples
        used = np.zeros(len(self.shard_sizes), np.int64)
        for start, stop, parts in self.segments():
            if start >= position:
                break
            end = position if stop is None else min(stop, position)
            used += blend_counts(parts, end - start)
        return used

    def sources(self, epoch: int) -> np.ndarray:
        """Source index of each position of mixture epoch ``epoch``."""
        at = epoch * self.epoch_samples + np.arange(self.epoch_samples, dtype=np.int64)
        out = np.empty(self.epoch_samples, np.int32)
        for start, stop, parts in self.segments():
            mine = (at >= start) & (at < (stop if stop is not None else at[-1] + 1))
            if mine.any():
                period = blend_period(parts)
                out[mine] = period[(at[mine] - start) % len(period)]
        return out

    def order(self, epoch: int) -> np.ndarray:
        """Virtual sample ids of mixture epoch ``epoch``, in blended order."""
        return self.partitioned(epoch, 1)[0]

    def partitioned(self, epoch: int, nodes: int) -> tuple[np.ndarray, np.ndarray]:
        """Virtual sample ids of mixture epoch ``epoch`` in blended order, and the partition
        each position belongs to (of ``nodes``).

        NOTE [mixture partitions]: each source's own epoch deals its positions to the
        partitions in turn (pick ``c`` of a source epoch from partition ``c mod nodes``'s
        span of that epoch's shuffled shards), so every partition gets its share of every
        source, spread evenly over the blend, and reads only its own spans' shards; a
        partition's order is the blend's positions that are its own.  With one partition this
        is the blend as it always was."""
        src = self.sources(epoch)
        cursors, offsets, sizes = self.cursors(epoch), self.offsets, self.sizes
        out = np.empty(len(src), np.int64)
        node_of = np.zeros(len(src), np.int64)
        for s in range(len(self.shard_sizes)):
            at = np.flatnonzero(src == s)
            if not at.size:
                continue
            # its picks are positions cursor .. cursor + m - 1 of its own stream of epochs
            first, size = int(cursors[s]), int(sizes[s])
            for e in range(first // size, (first + at.size - 1) // size + 1):
                lo, hi = max(first, e * size), min(first + at.size, (e + 1) * size)
                order = _source_epoch(
                    self.shard_sizes[s], self.seeds[s], e, self.shuffles[s], nodes
                )
                where = at[lo - first : hi - first]
                out[where] = offsets[s] + order[lo - e * size : hi - e * size]
                node_of[where] = np.arange(lo - e * size, hi - e * size) % nodes
        return out, node_of

    def source_epochs(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Per source: its own epoch at the end of mixture epoch ``epoch`` and how many of its
        epochs have started by then."""
        started = -(-self.cursors(epoch + 1) // self.sizes)  # samples given, in source epochs
        return np.maximum(started - 1, 0), started


def schedule_parts(
    names: Sequence[str], weights: Mapping[str, float], where: str = "weights"
) -> tuple[int, ...]:
    """Integer parts of ``weights`` (a mapping by source name, every source named)."""
    unknown = sorted(set(weights) - set(names))
    missing = [n for n in names if n not in weights]
    if unknown or missing:
        raise UsageError(
            f"{where} must name each source once: sources {list(names)}"
            + (f", unknown {unknown}" if unknown else "")
            + (f", missing {missing}" if missing else "")
        )
    return integer_parts([weights[n] for n in names])
