"""How a pass reads shards (:class:`ReadOptions`) and how many staged bytes its plan keeps in
use (:func:`working_set_bytes`).  The reading itself, samples by global id through staged
shards, is :class:`shardloader.read.staged.ShardSet` (re-exported here, where callers import
it from).
"""

from __future__ import annotations

import numpy as np

from shardloader.manifest import Manifest
from shardloader.options import ReadOptions, ShuffleOptions
from shardloader.read.staged import ShardSet, shard_starts

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]


def working_set_bytes(
    manifest: Manifest,
    shuffle: ShuffleOptions,
    batches: list[np.ndarray],
    readahead: int,
    bounds: np.ndarray | None = None,
) -> int:
    """Staged bytes a plan keeps in use at once, plus its read-ahead.

    Shuffled: the shards under the largest shuffle block of the order.  Unshuffled: a batch
    spans at most two neighbouring shards (unless batches are larger than shards).  ``bounds``:
    the first unit (sample, or token row) of each shard and the end; default the samples'.
    """
    raw = np.fromiter((s.raw_bytes for s in manifest.shards), np.int64, len(manifest.shards))
    if not batches or raw.size == 0:
        return 0
    largest = int(raw.max())
    bounds = shard_starts(manifest) if bounds is None else bounds
    if not shuffle.enabled:
        per_batch = max(len(b) for b in batches) // max(int(np.diff(bounds).min()), 1) + 2
        return min(per_batch, len(raw)) * largest + readahead * largest
    order = np.concatenate(batches)
    shard_of = np.searchsorted(bounds, order, side="right") - 1
    peak = 0
    for lo, hi in shuffle.blocks(len(order)):
        peak = max(peak, int(raw[np.unique(shard_of[lo:hi])].sum()))
    return peak + readahead * largest
