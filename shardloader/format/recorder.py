"""The sample index a writer records as it writes: what the tar, Arrow and token writers share.

Why a module of its own: only writers need it (it imports the manifest's ``SampleIndex``, which
``format/base.py`` must not: the manifest asks the registry, which imports the base).
"""

from __future__ import annotations

import numpy as np

from shardloader.format.base import WrittenShard
from shardloader.format.compress import HashingCounter
from shardloader.manifest import SampleIndex

__all__ = ["IndexRecorder"]


class IndexRecorder:
    """The sample index a writer records as it writes (per sample: key, offset, size, length,
    checksum) and the :class:`WrittenShard` it reports; lengths are kept where all have one."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.lengths: list[int] = []  # -1: none given
        self.sums: list[int] = []

    def add(self, key: str, offset: int, size: int, length: int | None, digest: int) -> None:
        self.keys.append(key)
        self.offsets.append(offset)
        self.sizes.append(size)
        self.lengths.append(-1 if length is None else length)
        self.sums.append(digest)

    def index(self, base: int = 0) -> SampleIndex:
        """The index so far, ``base`` added to every offset."""
        lengths = np.asarray(self.lengths, np.int64)
        return SampleIndex(
            keys=self.keys,
            offsets=np.asarray(self.offsets, np.int64) + base,
            sizes=np.asarray(self.sizes, np.int64),
            lengths=lengths if len(lengths) and lengths.min() >= 0 else None,
            checksums=np.asarray(self.sums, np.uint64),
        )

    def written(self, stored: HashingCounter, raw_bytes: int, index: SampleIndex) -> WrittenShard:
        """What the writer reports: ``stored`` counted and hashed the shard's stored bytes."""
        return WrittenShard(len(self.keys), stored.count, raw_bytes, stored.sha.hexdigest(), index)
