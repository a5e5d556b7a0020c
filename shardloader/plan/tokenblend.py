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
from typing import Any

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
        size, lens = int(self.sizes[s]), self.lengths[s]

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

    def _states(self, segs: tuple[tuple[int, tuple[int, ...]], ...], epoch: int) -> list[Any]:
        """``(documents given since the stream began, tokens given since the segment began)``
        per source at the start of each mixture epoch up to ``epoch`` under the blend segments
        ``segs`` (``(stream position, parts)``: those begun by the end of ``epoch``), walked
        once per process: a walk under fewer segments is reused up to where the next begins."""
        key = (
            self.shard_sizes, self.seeds, self.shuffles, self.epoch_samples, self.lengths_key,
            segs,
        )  # fmt: skip
        states = _walks.get(key)
        if states is None:
            k = len(self.shard_sizes)
            if len(segs) == 1:
                states = [(np.zeros(k, np.int64), np.zeros(k, np.int64))]
            else:  # epochs that end by the last segment's start walked as before it
                upto = segs[-1][0] // self.epoch_samples
                states = self._states(segs[:-1], upto)[: upto + 1]
            if len(_walks) >= _STATES:
                del _walks[next(iter(_walks))]
            _walks[key] = states
        while len(states) <= epoch:
            cursors, tokens = (a.copy() for a in states[-1])
            self._walk(segs, len(states) - 1, cursors, tokens)
            states.append((cursors, tokens))
        return states

    def _walk(
        self,
        segs: tuple[tuple[int, tuple[int, ...]], ...],
        epoch: int,
        cursors: np.ndarray,
        tokens: np.ndarray,
    ) -> np.ndarray:
        """Sources of mixture epoch ``epoch``'s positions, segment by segment (state updated);
        a segment's token time starts at 0 where it begins, mid-epoch too (a stage)."""
        first, end = epoch * self.epoch_samples, (epoch + 1) * self.epoch_samples
        lengths = [self._next_length(s) for s in range(len(cursors))]
        stops = [a for a, _ in segs[1:]] + [end]
        out = []
        for (start, parts), stop in zip(segs, stops, strict=True):
            lo, hi = max(start, first), min(stop, end)
            if lo >= hi:
                continue
            if lo == start:
                tokens[:] = 0
            out.append(deadline_sources(parts, lengths, hi - lo, cursors, tokens))
        return np.concatenate(out)

    def _begun(self, epoch: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The blend segments that begin by the end of mixture epoch ``epoch``."""
        end = (epoch + 1) * self.epoch_samples
        return tuple((a, p) for a, _, p in self.segments() if a < end)

    def cursors(self, epoch: int) -> np.ndarray:
        return self._states(self._begun(epoch), epoch)[epoch][0].copy()

    def sources(self, epoch: int) -> np.ndarray:
        segs = self._begun(epoch)
        cursors, tokens = (a.copy() for a in self._states(segs, epoch)[epoch])
        return self._walk(segs, epoch, cursors, tokens)
