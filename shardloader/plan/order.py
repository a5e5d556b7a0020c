"""The epoch's order computed where it is read (NOTE [lazy order]), never whole.

NOTE [the epoch order] (in :mod:`shardloader.plan.shuffle`) says what the order is; this module
holds the object every plan reads it through: a shard permutation, where each permuted shard starts,
and a span of that stream (a partition's: NOTE [node spans]), its blocks permuted on first use.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shardloader.options import ShuffleOptions
from shardloader.plan.shuffle import _BLOCK, _SHARDS, rng_for

__all__ = ["EpochOrder", "count_blocks", "epoch_order"]


class EpochOrder:
    """The epoch's order (NOTE [the epoch order]) computed where it is read, never whole.

    NOTE [lazy order]: what a process holds is the shard permutation and where each permuted
    shard starts in the stream (24 bytes a shard), never 8 bytes a sample.  Position ``p``
    lies in shuffle block ``b`` (arithmetic: the ramp of ``first_block`` then equal blocks);
    the block's ids are the stream's positions ``[lo, hi)`` mapped through the shard runs,
    permuted by the same ``rng_for(seed, epoch, block tag, b)`` draw as always, so every
    order (and every saved position) is exactly what :func:`epoch_order` gave before it was
    lazy.  A block costs about 1 ms and 8 bytes a sample of it to generate; the last few are
    kept, so a worker walking its steps generates each block it touches about once.
    """

    _KEEP = 4  # blocks kept: a batch may straddle two, and read-ahead looks a few steps on

    def __init__(
        self,
        shard_sizes: np.ndarray,
        seed: int,
        epoch: int,
        options: ShuffleOptions,
        span: tuple[int, int] | None = None,
        first_block: int = 0,
    ) -> None:
        sizes = np.asarray(shard_sizes, np.int64)
        self.seed, self.epoch, self.options = int(seed), int(epoch), options
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # by shard id
        if options.enabled:
            self.shard_perm = rng_for(seed, epoch, _SHARDS).permutation(len(sizes))
        else:
            self.shard_perm = np.arange(len(sizes), dtype=np.int64)
        # where the k-th shard of the permuted stream starts, plus the total at the end
        self.run_starts = np.concatenate([[0], np.cumsum(sizes[self.shard_perm])]).astype(np.int64)
        # NOTE [node spans]: a node's order is positions [lo, hi) of the permuted stream, its
        # blocks counted from lo and drawn as blocks first_block, first_block + 1, ...
        lo, hi = (0, int(self.starts[-1])) if span is None else (int(span[0]), int(span[1]))
        self.offset, self.total, self.first_block = lo, hi - lo, int(first_block)
        self._ramp = np.array(options.ramp(self.total), np.int64)  # its blocks' starts, its end
        self._ramp_blocks, self._ramp_end = len(self._ramp) - 1, int(self._ramp[-1])
        self._kept: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.total

    # -- blocks --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return count_blocks(self.total, self.options)

    def block_of(self, positions: np.ndarray) -> np.ndarray:
        """Shuffle block of each position (arithmetic, nothing generated)."""
        pos = np.asarray(positions, np.int64)
        out = self._ramp_blocks + (pos - self._ramp_end) // self.options.block
        early = pos < self._ramp_end
        if early.any():
            out[early] = np.searchsorted(self._ramp, pos[early], side="right") - 1
        return out

    def block_at(self, p: int) -> int:
        """:meth:`block_of` one position, without numpy's per-call cost."""
        if p >= self._ramp_end:
            return self._ramp_blocks + (p - self._ramp_end) // self.options.block
        return int(np.searchsorted(self._ramp, p, side="right")) - 1

    def block_range(self, b: int) -> tuple[int, int]:
        """``(lo, hi)`` positions of block ``b`` (as :meth:`ShuffleOptions.blocks` lists)."""
        if b < self._ramp_blocks:
            lo, hi = int(self._ramp[b]), int(self._ramp[b + 1])
        else:
            lo = self._ramp_end + (b - self._ramp_blocks) * self.options.block
            hi = lo + self.options.block
        return lo, min(hi, self.total)

    def stream_ids(self, lo: int, hi: int) -> np.ndarray:
        """Ids at positions ``[lo, hi)`` of this order's span of the stream (shards permuted
        and laid end to end), before the blocks are shuffled."""
        pos = np.arange(self.offset + lo, self.offset + hi, dtype=np.int64)
        run = np.searchsorted(self.run_starts, pos, side="right") - 1
        return self.starts[self.shard_perm[run]] + (pos - self.run_starts[run])

    def block(self, b: int) -> np.ndarray:
        """The ids of block ``b`` in their shuffled order (generated, or kept from before)."""
        ids = self._kept.get(b)
        if ids is not None:
            return ids
        lo, hi = self.block_range(b)
        ids = self.stream_ids(lo, hi)
        if self.options.enabled:
            ids = ids[self._draw(b).permutation(hi - lo)]
        if len(self._kept) >= self._KEEP:
            del self._kept[next(iter(self._kept))]
        self._kept[b] = ids
        return ids

    def block_shards(self, b: int) -> np.ndarray:
        """Shard ids block ``b`` reads from (a run of the shard permutation)."""
        return self.shards_under(*self.block_range(b))

    def shards_under(self, lo: int, hi: int) -> np.ndarray:
        """Shard ids under positions ``[lo, hi)`` (``lo < hi``), in stream order."""
        at = [self.offset + lo, self.offset + hi - 1]
        first, last = np.searchsorted(self.run_starts, at, side="right") - 1
        runs = slice(first, last + 1)
        return self.shard_perm[runs][np.diff(self.run_starts)[runs] > 0]

    def run_of(self, positions: np.ndarray) -> np.ndarray:
        """Which shard run of the (permuted) stream each position lies in."""
        at = np.asarray(positions, np.int64) + self.offset
        return np.searchsorted(self.run_starts, at, side="right") - 1  # type: ignore[no-any-return]

    def run_shards(self, run: int) -> np.ndarray:
        """The shard of a run (none for an empty shard's run)."""
        nonempty = self.run_starts[run + 1] > self.run_starts[run]
        return self.shard_perm[run : run + 1] if nonempty else self.shard_perm[:0]

    def peak_block_weight(self, weights: np.ndarray) -> int:
        """Largest total ``weights[shard]`` over the shards under one block: the staged bytes
        a shuffled pass keeps in use at once, with ``weights`` the shards' raw bytes."""
        runs = np.diff(self.run_starts) > 0  # an empty shard lies under no block
        weighed = np.asarray(weights, np.int64)[self.shard_perm] * runs
        prefix = np.concatenate([[0], np.cumsum(weighed)])
        peak = 0
        for at in range(0, self.num_blocks, 1 << 16):  # bounded memory for tiny blocks
            bs = np.arange(at, min(at + (1 << 16), self.num_blocks))
            los = self._block_starts(bs) + self.offset
            his = np.minimum(self._block_starts(bs + 1), self.total) + self.offset
            first = np.searchsorted(self.run_starts, los, side="right") - 1
            last = np.searchsorted(self.run_starts, his - 1, side="right") - 1
            peak = max(peak, int((prefix[last + 1] - prefix[first]).max()))
        return peak

    def _block_starts(self, bs: np.ndarray) -> np.ndarray:
        late = np.maximum(bs - self._ramp_blocks, 0) * self.options.block
        return np.asarray(self._ramp[np.minimum(bs, self._ramp_blocks)] + late, np.int64)

    # -- reading -------------------------------------------------------------------------
    def __getitem__(self, key: int | slice | np.ndarray) -> Any:
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.total)
            if step != 1:
                return self.take(np.arange(lo, hi, step, dtype=np.int64))
            return self.span(lo, hi)
        if isinstance(key, (int, np.integer)):
            p = int(key) + (self.total if key < 0 else 0)
            if not 0 <= p < self.total:
                raise IndexError(f"position {key} is outside the epoch's {self.total} samples")
            return int(self.span(p, p + 1)[0])
        return self.take(np.asarray(key, np.int64))

    def span(self, lo: int, hi: int) -> np.ndarray:
        """Ids at positions ``[lo, hi)`` (a copy)."""
        lo, hi = max(lo, 0), min(hi, self.total)
        if hi <= lo:
            return np.zeros(0, np.int64)
        parts = []
        for b in range(self.block_at(lo), self.block_at(hi - 1) + 1):
            blo, bhi = self.block_range(b)
            parts.append(self.block(b)[max(lo, blo) - blo : min(hi, bhi) - blo])
        return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)

    def take(self, positions: np.ndarray) -> np.ndarray:
        """Ids at arbitrary positions (each block they touch generated once)."""
        pos = np.asarray(positions, np.int64)
        out = np.empty(pos.shape, np.int64)
        if not pos.size:
            return out
        if pos.min() < 0 or pos.max() >= self.total:
            raise IndexError(f"positions outside the epoch's {self.total} samples")
        blocks = self.block_of(pos)
        for b in np.unique(blocks).tolist():
            at = blocks == b
            out[at] = self.block(b)[pos[at] - self.block_range(b)[0]]
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The whole order (what :func:`epoch_order` returns): the span of the stream laid out
        at once, then each block permuted in place with its draw."""
        out = np.arange(self.offset, self.offset + self.total, dtype=np.int64)
        first, last = np.searchsorted(self.run_starts, [self.offset, self.offset + self.total])
        first = max(int(first) - 1, 0)
        shift = (self.starts[self.shard_perm] - self.run_starts[:-1]).tolist()
        end = self.offset + self.total
        bounds = (np.clip(self.run_starts, self.offset, end) - self.offset).tolist()
        for k in range(first, min(int(last) + 1, len(shift))):  # each shard's run, in place
            out[bounds[k] : bounds[k + 1]] += shift[k]
        if self.options.enabled:
            for b in range(self.num_blocks):
                lo, hi = self.block_range(b)
                out[lo:hi] = out[lo:hi][self._draw(b).permutation(hi - lo)]
        return out if dtype is None else out.astype(dtype)

    def _draw(self, b: int) -> np.random.Generator:
        """The generator that permutes block ``b`` of this span (NOTE [node spans])."""
        return rng_for(self.seed, self.epoch, _BLOCK, self.first_block + b)


def count_blocks(total: int, options: ShuffleOptions) -> int:
    """Shuffle blocks of an order of ``total`` samples (:attr:`EpochOrder.num_blocks`)."""
    if total <= 0:
        return 0
    ramp = options.ramp(total)  # its blocks all start before total, then full blocks
    return len(ramp) - 1 + max(-(-(total - ramp[-1]) // options.block), 0)


def epoch_order(
    shard_sizes: np.ndarray, seed: int, epoch: int, options: ShuffleOptions
) -> np.ndarray:
    """Global sample ids (int64) in this epoch's order; ids count shards in manifest order.

    The whole order at once: :class:`EpochOrder` materialised (planners that look at every
    sample need it; the fixed-batch path never does)."""
    return np.asarray(EpochOrder(shard_sizes, seed, epoch, options))
