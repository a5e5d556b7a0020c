"""How a pass reads shards (:class:`ReadOptions`) and how many staged bytes its plan keeps in
use (:func:`working_set_bytes`).  The reading itself, samples by global id through staged
shards, is :class:`shardloader.read.staged.ShardSet` (re-exported here, where callers import
it from).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.errors import UsageError
from shardloader.manifest import Manifest
from shardloader.plan.shuffle import ShuffleOptions
from shardloader.read.staged import ShardSet, shard_starts
from shardloader.storage.cache import CacheOptions
from shardloader.storage.objectstream import PART_SIZE
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy
from shardloader.storage.store import Store

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]


@dataclass(frozen=True)
class ReadOptions:
    """How shards are fetched: fsspec ``storage_options`` (explicit values win over the
    environment), the node cache, how many shards to stage ahead per worker, and the one
    retry budget for every remote request (``storage_options`` and ``retry`` make the
    :class:`~shardloader.storage.Store` of each URL: :meth:`store`).

    ``verify_samples`` (default on) checks every sample read against the checksum (XXH3-64) in
    its shard's sidecar (well under a microsecond a sample), and for sidecars without checksums
    (packed before they existed) hashes each uncompressed local shard once per node on first
    use.  Turning it off turns off exactly those two checks; the SHA-256 of compressed and
    remote shards when they are staged, and every size and structure check, stay on.

    ``part_size``: a remote shard up to this size is one GET; a larger one comes as concurrent
    byte ranges of this size (more requests, more throughput per shard).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheOptions = field(default_factory=CacheOptions)
    readahead: int = 2
    retry: RetryPolicy = DEFAULT_POLICY
    verify_samples: bool = True
    part_size: int = PART_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.part_size, int) or self.part_size < 1 << 20:
            raise UsageError(
                f"ReadOptions.part_size must be at least 1 MiB, got {self.part_size!r}"
            )

    def store(self, url: str) -> Store:
        """The :class:`~shardloader.storage.Store` of ``url`` with these options and policy."""
        return Store(url, self.storage_options, self.retry)


def working_set_bytes(
    manifest: Manifest, shuffle: ShuffleOptions, batches: list[np.ndarray], readahead: int
) -> int:
    """Staged bytes a plan keeps in use at once, plus its read-ahead.

    Shuffled: the shards under the largest shuffle block of the order.  Unshuffled: a batch
    spans at most two neighbouring shards (unless batches are larger than shards).
    """
    raw = np.fromiter((s.raw_bytes for s in manifest.shards), np.int64, len(manifest.shards))
    if not batches or raw.size == 0:
        return 0
    largest = int(raw.max())
    if not shuffle.enabled:
        per_batch = max(len(b) for b in batches) // max(int(manifest.shard_sizes.min()), 1) + 2
        return min(per_batch, len(raw)) * largest + readahead * largest
    order = np.concatenate(batches)
    shard_of = np.searchsorted(shard_starts(manifest), order, side="right") - 1
    peak = 0
    for lo, hi in shuffle.blocks(len(order)):
        peak = max(peak, int(raw[np.unique(shard_of[lo:hi])].sum()))
    return peak + readahead * largest
