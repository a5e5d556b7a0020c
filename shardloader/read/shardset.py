"""Samples by global id: locate them, read them shard by shard, in one process.

A :class:`ShardSet` lives for one pass of one worker; it locates global ids, reads each batch
shard by shard in one pass, and keeps a few readers open.  Getting a shard there (staging
through the node cache, read-ahead, sample indexes, and why nothing here trusts the dataset)
is :mod:`shardloader.read.staged`'.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.errors import ChecksumError, ShardError, StorageError, UsageError
from shardloader.format.base import Rows, Sample, ShardReader, read_rows
from shardloader.manifest import Manifest, SampleIndex
from shardloader.plan.shuffle import ShuffleOptions
from shardloader.read.staged import ShardFiles
from shardloader.read.watchdog import check_stall_timeout
from shardloader.storage.cache import CacheOptions, ShardCache, is_cache_full
from shardloader.storage.objectstream import PART_SIZE
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy
from shardloader.storage.store import Store

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]

_OPEN_READERS = 128  # file handles; a shuffle block touches many shards at once


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

    ``stall_timeout`` (seconds, default None: off): a pass that produces no batch for this
    long while asked for one ends with a :class:`~shardloader.errors.StallError` naming rank,
    worker, shard, sample and the stuck stack (:mod:`shardloader.read.watchdog`).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheOptions = field(default_factory=CacheOptions)
    readahead: int = 2
    retry: RetryPolicy = DEFAULT_POLICY
    verify_samples: bool = True
    part_size: int = PART_SIZE
    stall_timeout: float | None = None

    def __post_init__(self) -> None:
        check_stall_timeout(self.stall_timeout)
        if not isinstance(self.part_size, int) or self.part_size < 1 << 20:
            raise UsageError(
                f"ReadOptions.part_size must be at least 1 MiB, got {self.part_size!r}"
            )

    def store(self, url: str) -> Store:
        """The :class:`~shardloader.storage.Store` of ``url`` with these options and policy."""
        return Store(url, self.storage_options, self.retry)


def shard_starts(manifest: Manifest) -> np.ndarray:
    """Global id of each shard's first sample, plus the total at the end."""
    return np.concatenate([[0], np.cumsum(manifest.shard_sizes)]).astype(np.int64)


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


class ShardSet:
    """Reads samples of one dataset by global id, for one process."""

    def __init__(
        self,
        manifest: Manifest,
        base: str,
        options: ReadOptions,
        where: str,
        working_set: int = 0,
    ) -> None:
        self.manifest = manifest
        self.base = base
        self.options = options
        self.where = where  # e.g. "rank 0/2, worker 1/4": goes into every error message
        self.files = ShardFiles(manifest, base, options, where, working_set)
        self.store = self.files.store
        self.starts = shard_starts(manifest)
        self.format = self.files.format
        self.in_place = self.files.in_place
        self.working_set = working_set  # staged bytes the plan keeps in use at once
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._corrupt: dict[int, ChecksumError] = {}  # failed their checksum (fetched twice)

    # -- locating -------------------------------------------------------------------------
    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, index inside the shard) of each global id."""
        shards = np.searchsorted(self.starts, ids, side="right") - 1
        return shards, ids - self.starts[shards]

    def url(self, shard: int) -> str:
        return self.files.url(shard)

    def describe(self, shard: int) -> str:
        return self.files.describe(shard)

    # -- getting shards here (read/staged.py) ------------------------------------------------
    def shard_store(self, shard: int) -> Store:
        return self.files.shard_store(shard)

    def index(self, shard: int) -> SampleIndex:
        return self.files.index(shard)

    def cache(self) -> ShardCache:
        return self.files.cache()

    def local_file(self, shard: int) -> str:
        """A local uncompressed file for ``shard``: the shard itself, or its staged copy."""
        return self.files.local_file(shard)

    def prefetch(self, shards: Iterable[int]) -> None:
        """Stage these shards in the background (read-ahead); no-op for in-place shards and
        for shards open already or known bad."""
        self.files.prefetch(s for s in shards if s not in self._readers and s not in self._corrupt)

    def staging(self, shards: Iterable[int]) -> bool:
        """Whether any of these shards is still being staged by this process's read-ahead."""
        return self.files.staging(shards)

    # -- reading --------------------------------------------------------------------------
    def reader(self, shard: int) -> ShardReader:
        reader = self._readers.get(shard)
        if reader is not None:
            self._readers.move_to_end(shard)
            return reader
        bad = self._corrupt.get(shard)
        if bad is not None:  # on_error="skip" asks once per sample: fetch a bad shard once
            raise ChecksumError(str(bad)) from bad
        try:
            reader = self.files.open_reader(shard)
        except ChecksumError as err:
            self._corrupt[shard] = err
            raise
        self._readers[shard] = reader
        if len(self._readers) > _OPEN_READERS:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def read(self, shard: int, local: int) -> Sample:
        try:
            return self.reader(shard).read(int(local))
        except StorageError:
            raise
        except ShardError as err:  # a damaged staged copy is staged once more
            if not self._restage(shard):
                if not self.in_place:
                    raise self.files.damaged(shard, err) from err
                raise
            return self.read(shard, local)
        except OSError as err:
            raise ShardError(f"{self.describe(shard)}: read failed ({err})") from err

    def read_batch(self, ids: np.ndarray) -> Rows:
        """The samples of global ids ``ids``, in that order, read shard by shard (one pass over
        each shard's rows, :func:`~shardloader.format.base.read_rows`).  A sample that cannot
        be read (its shard cannot be opened, or it fails its checksum) has its error in
        ``errors`` instead of raising, so the caller decides (``on_error``)."""
        out = Rows(len(ids))
        for shard, (rows, at) in self._by_shard(ids).items():
            self._read_rows(shard, rows, out, at)
        return out

    def read_into(self, ids: np.ndarray, into: Rows, at: Sequence[int]) -> None:
        """:meth:`read_batch` of ``ids`` into positions ``at`` of ``into`` (a batch that
        several datasets fill: :class:`shardloader.read.mixed.MixedShards`)."""
        for shard, (rows, where) in self._by_shard(ids).items():
            self._read_rows(shard, rows, into, [at[k] for k in where])

    def read_batches(self, batches: Sequence[np.ndarray]) -> list[Rows]:
        """:meth:`read_batch` for several batches in one pass: each shard's rows of all of them
        are read together, which shares the per-shard work (a handful of numpy calls) among
        many batches."""
        if len(batches) == 1:
            return [self.read_batch(batches[0])]
        return self.read_batch(np.concatenate(batches)).split([len(b) for b in batches])

    def ready(self, batches: Sequence[np.ndarray]) -> int:
        """How many of ``batches``, from the first on, read only shards that are open already
        (or read in place): batches that can be read now without staging anything."""
        if not batches:
            return 0
        if self.in_place:
            return len(batches)
        shard_of = self.locate(np.concatenate(batches))[0]
        is_open = np.zeros(len(self.manifest.shards), bool)
        is_open[list(self._readers)] = True
        opened = is_open[shard_of]
        ends = np.cumsum([len(b) for b in batches])
        closed = np.flatnonzero(~opened)
        if closed.size == 0:
            return len(batches)
        return int(np.searchsorted(ends, closed[0], side="right"))

    def _by_shard(self, ids: np.ndarray) -> dict[int, tuple[list[int], list[int]]]:
        """shard → (rows inside it, positions in ``ids``), shards in order of first use."""
        shard_of, local_of = self.locate(ids)
        shards = shard_of.tolist()
        if shards and shards.count(shards[0]) == len(shards):  # unshuffled: mostly one shard
            return {shards[0]: (local_of.tolist(), list(range(len(shards))))}
        if len(shards) <= 64:  # a batch: a Python loop costs less than numpy's calls
            groups: dict[int, tuple[list[int], list[int]]] = {}
            for pos, (shard, row) in enumerate(zip(shards, local_of.tolist(), strict=True)):
                group = groups.get(shard)
                if group is None:
                    group = groups[shard] = ([], [])
                group[0].append(row)
                group[1].append(pos)
            return groups
        order = np.argsort(shard_of, kind="stable")
        cuts = np.flatnonzero(np.diff(shard_of[order])) + 1
        ordered, rows = order.tolist(), local_of[order].tolist()
        bounds = [0, *cuts.tolist(), len(ordered)]
        return {
            shards[ordered[a]]: (rows[a:b], ordered[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        }

    def _read_rows(self, shard: int, rows: list[int], into: Rows, at: Sequence[int]) -> None:
        """Rows of one shard into ``into``; if the shard cannot be opened (or a read fails
        outright), every row not yet read gets that error."""
        try:
            read_rows(self.reader(shard), rows, into, at)
        except (ShardError, StorageError) as err:
            if is_cache_full(err):  # not one bad sample: every read would fail the same way
                raise
            problem: ShardError | StorageError = err
        except OSError as err:
            problem = ShardError(f"{self.describe(shard)}: read failed ({err})")
        else:
            self._read_damaged_again(shard, rows, into, at)
            return
        for pos in at:
            if not into.done(pos):
                into.fail(pos, problem)

    def _read_damaged_again(
        self, shard: int, rows: list[int], into: Rows, at: Sequence[int]
    ) -> None:
        """Rows whose read found the staged copy damaged are read once more from a copy staged
        again (NOTE [re-staging a damaged copy] in storage/cache.py); if that one is damaged
        too, their errors say the source is."""
        bad = [k for k, pos in enumerate(at) if isinstance(into.errors.get(pos), ShardError)]
        if not bad or self.in_place:
            return
        if not self._restage(shard):
            for k in bad:
                err = into.errors[at[k]]
                assert isinstance(err, ShardError)
                into.errors[at[k]] = self.files.damaged(shard, err)
            return
        again = [at[k] for k in bad]
        for pos in again:
            del into.errors[pos]
        self._read_rows(shard, [rows[k] for k in bad], into, again)

    def _restage(self, shard: int) -> bool:
        """Close the reader of a damaged staged copy and drop the copy (once a pass)."""
        if not self.files.restage(shard):
            return False
        reader = self._readers.pop(shard, None)
        if reader is not None:
            reader.close()
        return True

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self.files.close()
