"""One pass's shards, for one process: their samples read by global id, and how many staged
bytes a pass keeps in use (:func:`working_set_bytes`).

:class:`ShardSet` lives for one pass of one worker.  It holds the shards as local files
(:class:`~shardloader.read.staging.ShardFiles`: read in place, or staged through the node cache,
ahead in background threads) and their checked sample indexes
(:class:`~shardloader.read.indexes.SampleIndexes`); it opens the format readers (a few kept
open), locates global ids, and reads each batch shard by shard in one pass.

Nothing here trusts the dataset: samples are checked against the sidecar's checksums (XXH3-64)
as they are read.  A staged copy found damaged when read (a sample's checksum, a cut-off sample,
a copy the format cannot open, a file that changed while mapped: NOTE [no SIGBUS] in
format/mapped.py) is staged once more from the source (NOTE [re-staging a damaged copy] in
storage/cache.py); if the new copy is damaged too, the source is, and the error says so.

NOTE [per-sample checks on staged copies]: a staged copy is checked sample by sample as it is
read, like a shard read in place, although staging hashed the shard whole.  Checking it once
per staged shard instead would not give the same guarantee:

- staging hashed the *stored* bytes on their way into the copy (SHA-256, storage/cache.py).
  The copy is then a long-lived file of the node cache that every later process (the other
  workers, ranks, later runs) maps without hashing it again, and it can be damaged after it was
  staged (NOTE [re-staging a damaged copy]: a flipped bit, a same-size rewrite, a truncation).
  The per-batch size check (NOTE [no SIGBUS]) catches a truncation only; a flipped bit or a
  same-size rewrite is caught only by hashing the bytes as they are read
  (``tests/test_cache_damage.py`` flips a byte in a copy and expects it staged again).
- a stamp that would let a process trust a copy unhashed (device, inode, size and mtime, as
  the first-use notes of in-place shards use: NOTE [first-use hash notes] in read/staging.py)
  does not hold for the cache: every process that takes a copy touches its mtime (eviction
  goes by last use).  Hashing each copy whole when it is opened leaves the rest of the pass
  unchecked, and with workers that each read part of a shard it hashes more bytes than the
  per-sample checks do (every worker the whole copy).
- what it could save is bounded: with the check off entirely (``verify_samples=False``) a raw
  read cost 5-10 % less CPU a sample for 1.5 KB documents and ~18 % for 30 KB photos (one
  process, medians of 3 interleaved runs),
  because the hash is the first to touch a sample's bytes and most of its cost is fetching
  them into the CPU's caches, which the copy that follows would pay otherwise.  Pre-faulting
  the map (``MAP_POPULATE``, ``MADV_WILLNEED``, ``MADV_POPULATE_READ``) measured the same.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.base import batch_ids
from shardloader.errors import (
    ChecksumError,
    ShardChangedError,
    ShardError,
    ShardloaderError,
    StorageError,
    located,
)
from shardloader.format.base import Rows, ShardReader, read_rows
from shardloader.format.mapped import changed_since
from shardloader.format.registry import get_format
from shardloader.manifest import Manifest
from shardloader.options import ReadOptions, ShuffleOptions
from shardloader.plan.order import EpochOrder
from shardloader.plan.split import FixedBatchList
from shardloader.read.indexes import SampleIndexes
from shardloader.read.staging import ShardFiles
from shardloader.storage.cache import ShardCache, is_cache_full

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]

log = logging.getLogger(__name__)

_OPEN_READERS = 128  # file handles; a shuffle block touches many shards at once


def shard_starts(manifest: Manifest) -> np.ndarray:
    """Global id of each shard's first sample, plus the total at the end."""
    return np.concatenate([[0], np.cumsum(manifest.shard_sizes)]).astype(np.int64)


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


class ShardSet:
    """Reads samples of one dataset by global id, for one process (one pass): its shards as
    local files and open readers."""

    def __init__(
        self,
        manifest: Manifest,
        base: str,
        options: ReadOptions,
        where: str,
        working_set: int = 0,
    ) -> None:
        self.manifest = manifest
        self.options = options
        self.where = where  # e.g. "rank 0/2, worker 1/4": goes into every error message
        self.store = options.store(base)
        self.format = get_format(manifest.format)
        # ReadOptions.fields: a format whose reader ``projects`` (Parquet, whose columns are
        # stored apart) reads only those; others read whole samples
        fields = options.fields if self.format.projects else None
        self._projection: dict[str, Any] = {} if fields is None else {"fields": fields}
        self.working_set = working_set  # staged bytes the plan keeps in use at once
        self._cache: ShardCache | None = None
        self.indexes = SampleIndexes(self)
        self.files = ShardFiles(self)
        self.in_place = self.files.in_place  # shards read where they are, never staged
        self._opened: dict[int, tuple[str, int, int]] = {}  # path, inode, size of each reader
        self._restaged: set[int] = set()  # staged again after damage (once per shard a pass)
        self.starts = shard_starts(manifest)
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._corrupt: dict[int, ChecksumError] = {}  # failed their checksum (fetched twice)

    # -- locating -------------------------------------------------------------------------
    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, index inside the shard) of each global id."""
        shards = np.searchsorted(self.starts, ids, side="right") - 1
        return shards, ids - self.starts[shards]

    def describe(self, shard: int) -> str:
        """The shard's URL and this process's place, for error messages."""
        return f"shard {self.store.join(self.manifest.shards[shard].path).url} ({self.where})"

    def cache(self) -> ShardCache:
        """The node cache (created on first use: in-place shards never need it)."""
        if self._cache is None:
            cache = ShardCache(self.options.cache, self.manifest.fingerprint, self.store.url)
            cache.require(self.working_set)
            self._cache = cache
        return self._cache

    # -- read-ahead (the interface ReadAhead and MixedShards use) -------------------------
    def prefetch(self, shards: Iterable[int]) -> None:
        """Stage these shards in the background (read-ahead), bar those open already or known
        bad."""
        self.files.prefetch(s for s in shards if s not in self._readers and s not in self._corrupt)

    def staging(self, shards: Iterable[int]) -> bool:
        """Whether any of these shards is still being staged by this process's read-ahead."""
        return self.files.staging(shards)

    # -- opening ---------------------------------------------------------------------------
    def local_file(self, shard: int) -> str:
        """A local uncompressed file of ``shard``: the shard itself, or its staged copy."""
        return self.files.local_file(shard)

    def open_reader(self, shard: int) -> ShardReader:
        """A new format reader of ``shard``: staged (or in place), its sample index checked."""
        # Local: the sidecar first (a bad one is refused before the shard is staged).  Remote:
        # the shard first, since a shard that carries its sample index brings it along.
        index = self.indexes.of(shard) if self.store.is_local else None
        for attempt in range(3):
            try:
                path = self.files.local_file(shard)
            except ChecksumError as err:  # staging again after damage: the source is bad too
                if shard in self._restaged:
                    raise self.damaged(shard, err) from err
                raise
            if index is None:
                index = self.indexes.of(shard)
            self.files.first_use(shard, path, index)
            try:
                st = os.stat(path)
                with located(self.describe(shard)):
                    reader = self.format.reader(
                        path, index, self.options.verify_samples, **self._projection
                    )
            except FileNotFoundError:  # evicted by another process between stage and open
                if attempt == 2:
                    raise
                continue
            except ShardError as err:  # a staged copy that cannot be opened: damaged?
                if self.in_place:
                    raise
                if not self.restage(shard):
                    raise self.damaged(shard, err) from err
                index = self.indexes.of(shard) if self.store.is_local else None
                continue
            self._opened[shard] = (path, st.st_ino, st.st_size)
            return reader
        raise ShardError(f"{self.describe(shard)}: its staged copy kept changing while opened")

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
            reader = self.open_reader(shard)
        except ChecksumError as err:
            self._corrupt[shard] = err
            raise
        self._readers[shard] = reader
        if len(self._readers) > _OPEN_READERS:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

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
            reader = self.reader(shard)
            # the file its reader maps shrank or grew since it was opened: reading the map now
            # could kill the process (NOTE [no SIGBUS] in format/mapped.py)
            change = changed_since(*self._opened[shard])
            if change is not None:
                raise ShardChangedError(f"{self.describe(shard)}: {change}")
            try:  # readers raise without the place: it is named here, a shard a batch
                read_rows(reader, rows, into, at)
            except ShardloaderError as err:
                err.where = err.where or self.describe(shard)
                raise
            if into.errors:  # rows of this shard that failed
                for pos in at:
                    failed = into.errors.get(pos)
                    if failed is not None and failed.where is None:
                        failed.where = self.describe(shard)
        except (ShardError, StorageError) as err:
            if is_cache_full(err):  # not one bad sample: every read would fail the same way
                raise
            if isinstance(err, ShardChangedError):
                if self.restage(shard):
                    self._read_rows(shard, rows, into, at)  # from a copy staged again
                    return
                self._forget(shard)
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
        if not into.errors or self.in_place:  # the common case: no per-row scan at all
            return
        bad = [k for k, pos in enumerate(at) if isinstance(into.errors.get(pos), ShardError)]
        if not bad:
            return
        if not self.restage(shard):
            for k in bad:
                err = into.errors[at[k]]
                assert isinstance(err, ShardError)
                into.errors[at[k]] = self.damaged(shard, err)
            return
        again = [at[k] for k in bad]
        for pos in again:
            del into.errors[pos]
        self._read_rows(shard, [rows[k] for k in bad], into, again)

    # -- damaged staged copies (NOTE [re-staging a damaged copy] in storage/cache.py) ------
    def restage(self, shard: int) -> bool:
        """Drop the staged copy of ``shard``, found damaged, so that the next open stages it
        again from the source; False when that was done already in this pass (or the shard is
        read in place: there is no copy), so the damage is the source's."""
        if self.in_place or shard in self._restaged:
            return False
        self._restaged.add(shard)
        log.warning("%s: its staged copy is damaged; staging it again", self.describe(shard))
        opened = self._opened.pop(shard, None)  # the inode: the staged copy its reader read
        self.files.discard(shard, None if opened is None else opened[1])
        self.indexes.forget(shard)  # a sample index it carried is staged again with it
        self._forget(shard)
        return True

    def _forget(self, shard: int) -> None:
        """Close the reader of ``shard`` (its file changed: a new open sees the new state)."""
        reader = self._readers.pop(shard, None)
        if reader is not None:
            reader.close()

    def damaged(self, shard: int, err: ShardError) -> ShardError:
        """``err`` of a staged copy that was staged again and is still damaged, saying so."""
        path = self.cache().path_for(self.manifest.shards[shard].path)
        return type(err)(
            f"{err}; its staged copy {path} in the node cache was found damaged and was staged "
            "again from the source, which is damaged too: restore or re-pack the shard "
            "(`shardloader verify` checks the whole dataset, `shardloader cache clear` "
            "removes the staged copies)"
        )

    def close(self) -> None:
        """Close the open readers and stop read-ahead: cancel what has not started, wait for
        what has."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        self.files.close()
