"""How a pass reads shards (:class:`ReadOptions`) and how many staged bytes its plan keeps in
use (:func:`working_set_bytes`).  The reading itself, samples by global id through staged
shards, is :class:`shardloader.read.staged.ShardSet` (re-exported here, where callers import
it from).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardloader.batching.base import batch_ids
from shardloader.manifest import Manifest
from shardloader.options import ReadOptions, ShuffleOptions
from shardloader.plan.order import EpochOrder
from shardloader.plan.split import FixedBatchList
from shardloader.read.staged import ShardSet, shard_starts

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]


def working_set_bytes(
    manifest: Manifest,
    shuffle: ShuffleOptions,
    plan: EpochPlan,
    readahead: int,
    bounds: np.ndarray | None = None,
) -> int:
    """Staged bytes ``plan`` keeps in use at once, plus its read-ahead.

    Shuffled: the shards under the largest shuffle block of the order.  Unshuffled: a batch
    spans at most two neighbouring shards (unless batches are larger than shards).  ``bounds``:
    the first unit (sample, or token row) of each shard and the end; default the samples'.  A
    lazy plan (fixed batches of an :class:`~shardloader.plan.order.EpochOrder`) is weighed from
    its order, never from per-sample arrays.
    """
    raw = np.fromiter((s.raw_bytes for s in manifest.shards), np.int64, len(manifest.shards))
    if not len(plan.batches) or raw.size == 0:
        return 0
    largest = int(raw.max())
    order, batches = plan.order, plan.batches
    bounds = shard_starts(manifest) if bounds is None else bounds
    if not shuffle.enabled:
        if isinstance(batches, FixedBatchList):
            widest = batches.batch_size
        else:
            widest = max(len(batch_ids(b)) for b in batches)
        per_batch = widest // max(int(np.diff(bounds).min()), 1) + 2
        return min(per_batch, len(raw)) * largest + readahead * largest
    if isinstance(batches, FixedBatchList) and isinstance(order, EpochOrder):  # lazy
        return order.peak_block_weight(raw) + readahead * largest
    ids = np.concatenate([batch_ids(b) for b in batches])
    shard_of = np.searchsorted(bounds, ids, side="right") - 1
    peak = 0
    for lo, hi in shuffle.blocks(len(ids)):
        peak = max(peak, int(raw[np.unique(shard_of[lo:hi])].sum()))
    return peak + readahead * largest
