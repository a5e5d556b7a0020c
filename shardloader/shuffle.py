"""Seeded orders: every random choice derives from the seed, never from time, pid or globals.

NOTE [the epoch order]: all ranks and workers compute the same global order independently,
from (manifest shard sizes, seed, epoch) alone.  Shards are permuted, their samples laid end to
end, and samples are permuted inside consecutive blocks of ``block`` samples (the first blocks
smaller with ``first_block``: ``first_block``, twice that, ... up to ``block``).  The block bounds
how many shards must be staged at once (the node's cache working set) while mixing samples from
``block / shard_size`` shards into every batch.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # torch is imported where a generator is made, not by every importer
    import torch

__all__ = [
    "ShuffleOptions",
    "EpochOrder",
    "derive_seed",
    "derive_seeds",
    "rng_for",
    "epoch_order",
    "plan_rng",
    "batch_generator",
    "generator_of",
    "seed_global_rngs",
    "transform_seeds",
]


@dataclass(frozen=True)
class ShuffleOptions:
    """``block``: samples permuted together (bigger mixes better, needs more cache).

    ``first_block`` (off by default): the epoch's first block holds only this many samples and
    each next one twice as many, up to ``block``.  The first batches then need the shards of a
    small block only, so they arrive after a few shards are staged rather than a whole block's
    (remote data, large shards); the price is less mixing in the first blocks of every epoch
    (tools/bench_read.py measures it).  Part of the plan signature when set.
    """

    enabled: bool = True
    block: int = 1 << 16
    first_block: int | None = None

    def __post_init__(self) -> None:
        for name in ("block", "first_block"):
            value = getattr(self, name)
            if name == "first_block" and value is None:
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                from shardloader.errors import UsageError

                raise UsageError(f"shuffle {name} must be an integer >= 1 sample, got {value!r}")

    def signature(self) -> str:
        """What the plan signature records (NOTE [plan signature] in batching/base.py): without
        ``first_block`` exactly what it recorded before that option existed."""
        from shardloader.batching.base import stable_value

        text = (
            f"ShuffleOptions(enabled={stable_value(self.enabled)}, block={stable_value(self.block)}"
        )
        if self.first_block is not None:
            text += f", first_block={stable_value(self.first_block)}"
        return text + ")"

    def blocks(self, total: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each shuffle block of an epoch of ``total`` samples."""
        out = []
        lo, size = 0, min(self.first_block or self.block, self.block)
        while lo < total:
            hi = min(lo + size, total)
            out.append((lo, hi))
            lo, size = hi, min(2 * size, self.block)
        return out


def derive_seed(*parts: int) -> int:
    """Mix integers into one 63-bit seed (numpy's SeedSequence: well mixed, stable)."""
    return int(
        np.random.SeedSequence([int(p) & 0xFFFFFFFFFFFFFFFF for p in parts])
        .generate_state(2, np.uint32)
        .view(np.uint64)[0]
        >> np.uint64(1)
    )


# numpy's SeedSequence (bit_generator.pyx), to mix many entropy lists at once in derive_seeds
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715
_MASK32 = 0xFFFFFFFF
_POOL = 4


def derive_seeds(*parts: int | np.ndarray) -> np.ndarray:
    """:func:`derive_seed` for every value of the one array among ``parts``, all at once.

    ``derive_seeds(seed, epoch, np.arange(k))[j] == derive_seed(seed, epoch, j)``: the same
    SeedSequence mixing (its entropy words hashed into a pool of four, two words of state
    drawn), done over arrays.  A pass derives its batches' seeds in one call instead of one
    SeedSequence (about 30 us) per batch.  Values of 2**32 and more take derive_seed's path.
    """
    (at,) = [k for k, p in enumerate(parts) if isinstance(p, np.ndarray)]
    values = np.asarray(parts[at], np.int64)
    n = len(values)
    if n == 0:
        return np.zeros(0, np.int64)
    if values.min() < 0 or values.max() > _MASK32:
        fixed = [int(p) for p in parts[:at]], [int(p) for p in parts[at + 1 :]]  # type: ignore[arg-type]
        return np.array([derive_seed(*fixed[0], int(v), *fixed[1]) for v in values], np.int64)
    words: list[np.ndarray] = []
    for k, part in enumerate(parts):
        if k == at:
            words.append(values.astype(np.uint32))
            continue
        p = int(part) & 0xFFFFFFFFFFFFFFFF  # type: ignore[arg-type]
        while True:  # numpy's _int_to_uint32_array: little-endian 32-bit words, 0 → [0]
            words.append(np.full(n, p & _MASK32, np.uint32))
            p >>= 32
            if not p:
                break
    const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal const
        value = value ^ np.uint32(const)
        const = (const * _MULT_A) & _MASK32
        value = value * np.uint32(const)
        return value ^ (value >> np.uint32(16))  # type: ignore[no-any-return]

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        result = np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y
        return result ^ (result >> np.uint32(16))  # type: ignore[no-any-return]

    zero = np.zeros(n, np.uint32)
    pool = [hashmix(words[i] if i < len(words) else zero) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(words)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(words[src]))
    const = _INIT_B
    state = []
    for word in pool[:2]:  # generate_state(2, uint32)
        value = word ^ np.uint32(const)
        const = (const * _MULT_B) & _MASK32
        value = value * np.uint32(const)
        state.append((value ^ (value >> np.uint32(16))).astype(np.uint64))
    return ((state[0] | (state[1] << np.uint64(32))) >> np.uint64(1)).astype(np.int64)


def rng_for(*parts: int) -> np.random.Generator:
    """A local generator for one purpose, e.g. ``rng_for(seed, epoch, block)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(p) for p in parts])))


_SHARDS, _BLOCK, _PLAN = 1, 2, 3  # domain tags so different uses never share a stream
_TRANSFORMS = 1 << 41  # last part of a transform generator's seed (as 1 << 40 of a worker's)


def epoch_order(
    shard_sizes: np.ndarray, seed: int, epoch: int, options: ShuffleOptions
) -> np.ndarray:
    """Global sample ids (int64) in this epoch's order; ids count shards in manifest order.

    The whole order at once: :class:`EpochOrder` materialised (planners that look at every
    sample need it; the fixed-batch path never does)."""
    return np.asarray(EpochOrder(shard_sizes, seed, epoch, options))


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
        self, shard_sizes: np.ndarray, seed: int, epoch: int, options: ShuffleOptions
    ) -> None:
        sizes = np.asarray(shard_sizes, np.int64)
        self.seed, self.epoch, self.options = int(seed), int(epoch), options
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # by shard id
        self.total = int(self.starts[-1])
        if options.enabled:
            self.shard_perm = rng_for(seed, epoch, _SHARDS).permutation(len(sizes))
        else:
            self.shard_perm = np.arange(len(sizes), dtype=np.int64)
        # where the k-th shard of the permuted stream starts, plus the total at the end
        self.run_starts = np.concatenate([[0], np.cumsum(sizes[self.shard_perm])]).astype(np.int64)
        block = options.block
        ramp, size, lo = [0], min(options.first_block or block, block), 0
        while size < block and lo < self.total:  # the first_block ramp: size, 2*size, ...
            lo += size
            ramp.append(lo)
            size = min(2 * size, block)
        self._ramp = np.array(ramp, np.int64)  # starts of the ramp's blocks, then its end
        self._kept: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.total

    # -- blocks --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        if not self.total:
            return 0
        return int(self.block_of(np.array([self.total - 1]))[0]) + 1

    def block_of(self, positions: np.ndarray) -> np.ndarray:
        """Shuffle block of each position (arithmetic, nothing generated)."""
        pos = np.asarray(positions, np.int64)
        ramp_blocks, ramp_end = len(self._ramp) - 1, int(self._ramp[-1])
        out = ramp_blocks + (pos - ramp_end) // self.options.block
        early = pos < ramp_end
        if early.any():
            out[early] = np.searchsorted(self._ramp, pos[early], side="right") - 1
        return out

    def block_at(self, p: int) -> int:
        """:meth:`block_of` one position, without numpy's per-call cost."""
        ramp_blocks, ramp_end = len(self._ramp) - 1, int(self._ramp[-1])
        if p >= ramp_end:
            return ramp_blocks + (p - ramp_end) // self.options.block
        return int(np.searchsorted(self._ramp, p, side="right")) - 1

    def block_range(self, b: int) -> tuple[int, int]:
        """``(lo, hi)`` positions of block ``b`` (as :meth:`ShuffleOptions.blocks` lists)."""
        ramp_blocks = len(self._ramp) - 1
        if b < ramp_blocks:
            lo, hi = int(self._ramp[b]), int(self._ramp[b + 1])
        else:
            lo = int(self._ramp[-1]) + (b - ramp_blocks) * self.options.block
            hi = lo + self.options.block
        return lo, min(hi, self.total)

    def stream_ids(self, lo: int, hi: int) -> np.ndarray:
        """Ids at stream positions ``[lo, hi)``: shards permuted and laid end to end, before
        the blocks are shuffled."""
        pos = np.arange(lo, hi, dtype=np.int64)
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
            ids = ids[rng_for(self.seed, self.epoch, _BLOCK, b).permutation(hi - lo)]
        if len(self._kept) >= self._KEEP:
            del self._kept[next(iter(self._kept))]
        self._kept[b] = ids
        return ids

    def block_shards(self, b: int) -> np.ndarray:
        """Shard ids block ``b`` reads from (a run of the shard permutation)."""
        lo, hi = self.block_range(b)
        first, last = np.searchsorted(self.run_starts, [lo, hi - 1], side="right") - 1
        runs = slice(first, last + 1)
        return self.shard_perm[runs][np.diff(self.run_starts)[runs] > 0]

    def run_of(self, positions: np.ndarray) -> np.ndarray:
        """Which shard run of the (permuted) stream each position lies in."""
        return np.searchsorted(self.run_starts, positions, side="right") - 1  # type: ignore[no-any-return]

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
            los = self._block_starts(bs)
            his = np.minimum(self._block_starts(bs + 1), self.total)
            first = np.searchsorted(self.run_starts, los, side="right") - 1
            last = np.searchsorted(self.run_starts, his - 1, side="right") - 1
            peak = max(peak, int((prefix[last + 1] - prefix[first]).max()))
        return peak

    def _block_starts(self, bs: np.ndarray) -> np.ndarray:
        ramp_blocks = len(self._ramp) - 1
        clipped = np.minimum(bs, ramp_blocks)
        late = np.maximum(bs - ramp_blocks, 0) * self.options.block
        return np.asarray(self._ramp[clipped] + late, np.int64)

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
            ids = self.block(b)
            parts.append(ids[max(lo, blo) - blo : min(hi, bhi) - blo])
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
        """The whole order (what :func:`epoch_order` returns): the stream laid out at once,
        then each block permuted in place with its draw."""
        out = np.arange(self.total, dtype=np.int64)
        if self.options.enabled:
            shift = (self.starts[self.shard_perm] - self.run_starts[:-1]).tolist()
            bounds = self.run_starts.tolist()
            for k, by in enumerate(shift):  # each shard's run: its ids, in place
                out[bounds[k] : bounds[k + 1]] += by
            for b in range(self.num_blocks):
                lo, hi = self.block_range(b)
                out[lo:hi] = out[lo:hi][
                    rng_for(self.seed, self.epoch, _BLOCK, b).permutation(hi - lo)
                ]
        return out if dtype is None else out.astype(dtype)


def plan_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator handed to batch planners (bucketing shuffles batches with it)."""
    return rng_for(seed, epoch, _PLAN)


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The torch generator shardloader's own transforms draw from for global batch ``batch``
    (NOTE [transform generators] in :mod:`shardloader.vision.transforms`): a stream of its own,
    apart from the global generators that :func:`seed_global_rngs` seeds for user transforms."""
    return generator_of(derive_seed(seed, epoch, batch, _TRANSFORMS))


def transform_seeds(seed: int, epoch: int, batches: np.ndarray) -> np.ndarray:
    """The seeds of :func:`batch_generator` for many global batches at once."""
    return derive_seeds(seed, epoch, np.asarray(batches, np.int64), _TRANSFORMS)


def generator_of(seed: int) -> torch.Generator:
    """A ``torch.Generator`` seeded with ``seed`` (one of :func:`transform_seeds`)."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return generator


def seed_global_rngs(seed: int) -> None:
    """Seed torch, numpy and ``random`` for user transforms that use the global generators."""
    import torch

    # The CPU generator only: torch.manual_seed also seeds (and lazily initialises) every
    # accelerator backend, which costs milliseconds per call; transforms in workers run on CPU.
    torch.random.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)
