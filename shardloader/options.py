"""The option objects a user hands the dataset, at the bottom of the package: how shards are
read (:class:`ReadOptions`) and how an epoch is shuffled (:class:`ShuffleOptions`).

Small frozen values that import nothing of the read path, so ``help()`` on them, and the
planning that takes them, stay clear of the pass machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.errors import UsageError
from shardloader.storage.cache import CacheOptions
from shardloader.storage.objectstream import PART_SIZE
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy

if TYPE_CHECKING:
    from shardloader.storage.store import Store

__all__ = ["ReadOptions", "ShuffleOptions"]


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
        from shardloader.storage.store import Store

        return Store(url, self.storage_options, self.retry)


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
