"""Token deadlines: a blend of documents whose token shares hold at every prefix.

NOTE [token deadlines]
    ``Mixture(..., by="tokens")`` means its weights in tokens.  A blend that counts documents
    (NOTE [the blend] in :mod:`shardloader.plan.blend`) gives a source of 5,000-token
    documents the same place as one of 50-token documents, so token shares would hold only on
    average over a source's epoch.  Here each position goes to the source whose next document
    finishes earliest in its own token time: ``(delivered_s + len(next_s)) / w_s``, ties to
    the lower source index (weighted fair queueing's finish-time rule, every source always
    backlogged).  The recorded lengths (the manifest's length field) fix every choice, so
    every process computes the same blend without talking.  After any prefix of ``T`` tokens
    each source's ``delivered_s`` is within one of its longest documents of ``w_s * T``: a
    source falls behind only while others' earlier deadlines go first, and a deadline is at
    most one document ahead of its share.

    The choices depend on the documents each source's stream offers next, so the blend is
    walked from the start of its schedule segment (a weight change starts a fresh walk, as in
    the document blend); the state at each mixture epoch's start (documents and tokens each
    source has given) is kept per process, so epoch ``e`` costs one epoch's walk once the
    earlier ones are known.  A source's next document is read from its own one-partition
    epoch order, so the blend, and the bound, is the same for any number of partitions; with
    several partitions each takes its positions as :class:`MixOrder` deals them, which holds
    each source's token share per source epoch rather than per prefix.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shardloader.plan.blend import MixOrder, _source_epoch

__all__ = ["TokenMixOrder", "deadline_sources"]

_STATES = 64  # walks remembered per process (each a few integers per mixture epoch)
_walks: dict[tuple[object, ...], list[tuple[np.ndarray, np.ndarray]]] = {}


def deadline_sources(
    parts: Sequence[int],
    next_length: Sequence[object],
    n: int,
    cursors: np.ndarray,
    tokens: np.ndarray,
) -> np.ndarray:
    """Source of each of ``n`` positions by token deadline (module NOTE), from stream
    positions ``cursors`` and delivered ``tokens`` (both updated in place).
    ``next_length[s](cursor)`` is the length of source ``s``'s document at that position of
    its stream."""
    out = np.empty(n, np.int32)
    heap: list[tuple[float, int, int]] = []
    for s, p in enumerate(parts):
        if p > 0:
            length = int(next_length[s](int(cursors[s])))  # type: ignore[operator]
            heapq.heappush(heap, ((int(tokens[s]) + length) / p, s, length))
    for i in range(n):
        _, s, length = heapq.heappop(heap)
        out[i] = s
        tokens[s] += length
        cursors[s] += 1
        nxt = int(next_length[s](int(cursors[s])))  # type: ignore[operator]
        heapq.heappush(heap, ((int(tokens[s]) + nxt) / parts[s], s, nxt))
    return out


@dataclass(frozen=True)
class TokenMixOrder(MixOrder):
    """:class:`MixOrder` whose positions go to sources by token deadline (module NOTE).

    ``lengths``: per source, its documents' recorded lengths by local id (compared through
    ``lengths_key``, a checksum, so the order stays hashable by value)."""

    lengths: tuple[np.ndarray, ...] = field(default=(), compare=False, repr=False)
    lengths_key: int = 0

    def signature(self) -> str:
        return super().signature().replace("mix(", "mix(by=tokens;", 1)

    def _next_length(self, s: int) -> object:
        sizes, lens = self.sizes, self.lengths[s]
        size = int(sizes[s])

        memo: dict[int, np.ndarray] = {}  # the source epoch being walked

        def length(cursor: int) -> int:
            e, i = divmod(cursor, size)
            order = memo.get(e)
            if order is None:
                memo.clear()
                order = memo[e] = _source_epoch(
                    self.shard_sizes[s], self.seeds[s], e, self.shuffles[s]
                )
            return int(lens[order[i]])

        return length

    def _segment(self, epoch: int) -> tuple[int, tuple[int, ...]]:
        start = max(s for s, _ in self.schedule if s <= epoch)
        return start, self.parts_at(epoch)

    def _walk(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(documents given since the stream began, tokens given since the schedule segment
        began) per source at the start of mixture epoch ``epoch``, walked once per process."""
        start, parts = self._segment(epoch)
        key = (
            self.shard_sizes, self.seeds, self.shuffles, self.epoch_samples, self.lengths_key,
            tuple(e for e in self.schedule if e[0] <= start),
        )  # fmt: skip
        states = _walks.get(key)
        if states is None:
            k = len(parts)
            begin = np.zeros(k, np.int64) if start == 0 else self._walk_end(start)
            states = [(begin, np.zeros(k, np.int64))]
            if len(_walks) >= _STATES:
                del _walks[next(iter(_walks))]
            _walks[key] = states
        lengths = [self._next_length(s) for s in range(len(parts))]
        while len(states) <= epoch - start:
            cursors, tokens = (a.copy() for a in states[-1])
            deadline_sources(parts, lengths, self.epoch_samples, cursors, tokens)
            states.append((cursors, tokens))
        return states[epoch - start]

    def _walk_end(self, start: int) -> np.ndarray:
        """Documents each source has given when the segment beginning at ``start`` begins: the
        previous segment walked to its end."""
        before = start - 1
        cursors, tokens = (a.copy() for a in self._walk(before))
        lengths = [self._next_length(s) for s in range(len(cursors))]
        deadline_sources(self.parts_at(before), lengths, self.epoch_samples, cursors, tokens)
        return cursors

    def _staged(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """Stages (NOTE [stages] in :mod:`shardloader.plan.stages`): the walk's state at the start
        of mixture epoch ``epoch``, walked from the stream's start; a stage may begin
        mid-epoch, and its token time starts at 0 there (a fresh walk, as a weight change)."""
        key = (
            self.shard_sizes, self.seeds, self.shuffles, self.epoch_samples, self.lengths_key,
            self.stages,
        )  # fmt: skip
        states = _walks.get(key)
        if states is None:
            k = len(self.shard_sizes)
            states = [(np.zeros(k, np.int64), np.zeros(k, np.int64))]
            if len(_walks) >= _STATES:
                del _walks[next(iter(_walks))]
            _walks[key] = states
        while len(states) <= epoch:
            cursors, tokens = (a.copy() for a in states[-1])
            self._staged_epoch(len(states) - 1, cursors, tokens)
            states.append((cursors, tokens))
        return states[epoch]

    def _staged_epoch(self, epoch: int, cursors: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """Sources of mixture epoch ``epoch``'s positions, stage by stage (state updated)."""
        first = epoch * self.epoch_samples
        end = first + self.epoch_samples
        lengths = [self._next_length(s) for s in range(len(cursors))]
        out = []
        for start, stop, parts in self.segments():
            lo, hi = max(start, first), end if stop is None else min(stop, end)
            if lo >= hi:
                continue
            if lo == start:
                tokens[:] = 0  # a stage's token time starts with it
            out.append(deadline_sources(parts, lengths, hi - lo, cursors, tokens))
        return np.concatenate(out)

    def cursors(self, epoch: int) -> np.ndarray:
        if self.stages:
            return self._staged(epoch)[0].copy()
        return self._walk(epoch)[0].copy()

    def sources(self, epoch: int) -> np.ndarray:
        if self.stages:
            cursors, tokens = (a.copy() for a in self._staged(epoch))
            return self._staged_epoch(epoch, cursors, tokens)
        cursors, tokens = (a.copy() for a in self._walk(epoch))
        lengths = [self._next_length(s) for s in range(len(cursors))]
        parts = self.parts_at(epoch)
        return deadline_sources(parts, lengths, self.epoch_samples, cursors, tokens)
