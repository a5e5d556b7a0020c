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
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a generator is made, not by every importer
    import torch

__all__ = [
    "ShuffleOptions",
    "derive_seed",
    "rng_for",
    "epoch_order",
    "plan_rng",
    "batch_generator",
    "seed_global_rngs",
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


def rng_for(*parts: int) -> np.random.Generator:
    """A local generator for one purpose, e.g. ``rng_for(seed, epoch, block)``."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(p) for p in parts])))


_SHARDS, _BLOCK, _PLAN = 1, 2, 3  # domain tags so different uses never share a stream
_TRANSFORMS = 1 << 41  # last part of a transform generator's seed (as 1 << 40 of a worker's)


def epoch_order(
    shard_sizes: np.ndarray, seed: int, epoch: int, options: ShuffleOptions
) -> np.ndarray:
    """Global sample ids (int64) in this epoch's order; ids count shards in manifest order."""
    sizes = np.asarray(shard_sizes, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    if not options.enabled:
        return np.arange(total, dtype=np.int64)
    shard_perm = rng_for(seed, epoch, _SHARDS).permutation(len(sizes))
    order = np.concatenate(
        [np.arange(starts[s], starts[s] + sizes[s], dtype=np.int64) for s in shard_perm]
        or [np.zeros(0, np.int64)]
    )
    for b, (lo, hi) in enumerate(options.blocks(total)):
        order[lo:hi] = order[lo:hi][rng_for(seed, epoch, _BLOCK, b).permutation(hi - lo)]
    return order


def plan_rng(seed: int, epoch: int) -> np.random.Generator:
    """The generator handed to batch planners (bucketing shuffles batches with it)."""
    return rng_for(seed, epoch, _PLAN)


def batch_generator(seed: int, epoch: int, batch: int) -> torch.Generator:
    """The torch generator shardloader's own transforms draw from for global batch ``batch``
    (NOTE [transform generators] in :mod:`shardloader.vision.transforms`): a stream of its own,
    apart from the global generators that :func:`seed_global_rngs` seeds for user transforms."""
    import torch

    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, epoch, batch, _TRANSFORMS))
    return generator


def seed_global_rngs(seed: int) -> None:
    """Seed torch, numpy and ``random`` for user transforms that use the global generators."""
    import torch

    # The CPU generator only: torch.manual_seed also seeds (and lazily initialises) every
    # accelerator backend, which costs milliseconds per call; transforms in workers run on CPU.
    torch.random.default_generator.manual_seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    random.seed(seed)
