"""Seeded orders: every random choice derives from the seed, never from time, pid or globals.

NOTE [the epoch order]: all ranks and workers compute the same global order independently,
from (manifest shard sizes, seed, epoch) alone.  Shards are permuted, their samples laid end to
end, and samples are permuted inside consecutive blocks of ``block`` samples (the first blocks
smaller with ``first_block``: ``first_block``, twice that, ... up to ``block``).  The block bounds
how many shards must be staged at once (the node's cache working set) while mixing samples from
``block / shard_size`` shards into every batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from shardloader.options import ShuffleOptions

__all__ = [
    "ShuffleOptions",
    "derive_seed",
    "derive_seeds",
    "rng_for",
    "plan_rng",
    "regroup_rng",
    "transform_seeds",
]


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
        else:  # numpy's _int_to_uint32_array: little-endian 32-bit words, 0 → [0]
            p = int(part) & 0xFFFFFFFFFFFFFFFF  # type: ignore[arg-type]
            low, high = p & _MASK32, p >> 32
            words += [np.full(n, w, np.uint32) for w in ((low, high) if high else (low,))]
    hashmix = _hasher(_INIT_A, _MULT_A)

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
    output = _hasher(_INIT_B, _MULT_B)
    state = [output(word).astype(np.uint64) for word in pool[:2]]  # generate_state(2, uint32)
    return ((state[0] | (state[1] << np.uint64(32))) >> np.uint64(1)).astype(np.int64)


def _hasher(const: int, mult: int) -> Callable[[np.ndarray], np.ndarray]:
    """SeedSequence's hash of a word, its constant advanced by ``mult`` on every call."""

    def hashed(value: np.ndarray) -> np.ndarray:
        nonlocal const
        value = value ^ np.uint32(const)
        const = (const * mult) & _MASK32
        value = value * np.uint32(const)
        return value ^ (value >> np.uint32(16))  # type: ignore[no-any-return]

    return hashed


def rng_for(*parts: int) -> np.random.Generator:
    """A local generator for one purpose, e.g. ``rng_for(seed, epoch, block)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(p) for p in parts])))


_SHARDS, _BLOCK, _PLAN, _REGROUP = 1, 2, 3, 4  # domain tags: uses never share a stream
TRANSFORMS = 1 << 41  # last part of a transform generator's seed (as 1 << 40 of a worker's)


def plan_rng(seed: int, epoch: int, node: int = 0, nodes: int = 1) -> np.random.Generator:
    """The generator handed to batch planners (bucketing shuffles batches with it); with
    several partitions each node's planner draws from a stream of its own."""
    if nodes == 1:
        return rng_for(seed, epoch, _PLAN)
    return rng_for(seed, epoch, _PLAN, nodes, node)


def regroup_rng(seed: int, epoch: int, link: int, node: int, block: int) -> np.random.Generator:
    """The draw that shuffles block ``block`` of node ``node``'s share of what an epoch's
    first ``link`` links left, after a resume re-partitioned it (NOTE [re-partition] in
    :mod:`shardloader.plan.elastic`)."""
    return rng_for(seed, epoch, _REGROUP, link, node, block)


def transform_seeds(seed: int, epoch: int, batches: np.ndarray) -> np.ndarray:
    """The seeds of :func:`batch_generator` for many global batches at once."""
    return derive_seeds(seed, epoch, np.asarray(batches, np.int64), TRANSFORMS)
