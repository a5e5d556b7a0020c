"""Samples by global id: locate, stage (through the node cache) and read shards in one process.

A :class:`ShardSet` lives for one pass of one worker; it opens what that worker needs, keeps a
few readers open, and stages ahead in a background thread (read-ahead) when shards are remote
or compressed.  Uncompressed local shards are read in place.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader import format as shard_format
from shardloader.errors import ChecksumError, ManifestError, ShardError, StorageError
from shardloader.format import Sample, ShardReader
from shardloader.manifest import Manifest, SampleIndex
from shardloader.shuffle import ShuffleOptions
from shardloader.storage import is_local, join, local_path, open_read, read_bytes
from shardloader.storage.cache import CacheOptions, ShardCache
from shardloader.storage.fetch import fetch_shard
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy

__all__ = ["ReadOptions", "ShardSet", "shard_starts", "working_set_bytes"]

log = logging.getLogger(__name__)

_OPEN_READERS = 128  # file handles; a shuffle block touches many shards at once


@dataclass(frozen=True)
class ReadOptions:
    """How shards are fetched: fsspec ``storage_options`` (explicit values win over the
    environment), the node cache, how many shards to stage ahead per worker, and the one
    retry budget for every remote request."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheOptions = field(default_factory=CacheOptions)
    readahead: int = 2
    retry: RetryPolicy = DEFAULT_POLICY


def shard_starts(manifest: Manifest) -> np.ndarray:
    """Global id of each shard's first sample, plus the total at the end."""
    return np.concatenate([[0], np.cumsum(manifest.shard_sizes)]).astype(np.int64)


class _RemoveOnClose(io.FileIO):
    """A downloaded temp file that disappears once staged from."""

    def __init__(self, path: str) -> None:
        super().__init__(path, "rb")

    def close(self) -> None:
        try:
            super().close()
        finally:
            if os.path.exists(self.name):  # type: ignore[arg-type]
                os.remove(self.name)  # type: ignore[arg-type]


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
    for lo in range(0, len(order), shuffle.block):
        peak = max(peak, int(raw[np.unique(shard_of[lo : lo + shuffle.block])].sum()))
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
        self.starts = shard_starts(manifest)
        self.in_place = is_local(base) and manifest.compression == "none"
        self.working_set = working_set  # staged bytes the plan keeps in use at once
        self._cache: ShardCache | None = None
        self._indexes: OrderedDict[int, SampleIndex] = OrderedDict()
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future[str | None]] = {}
        self._corrupt: dict[int, ChecksumError] = {}  # failed their checksum (fetched twice)

    # -- locating -------------------------------------------------------------------------
    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, index inside the shard) of each global id."""
        shards = np.searchsorted(self.starts, ids, side="right") - 1
        return shards, ids - self.starts[shards]

    def url(self, shard: int) -> str:
        return join(self.base, self.manifest.shards[shard].path)

    def describe(self, shard: int) -> str:
        return f"shard {self.url(shard)} ({self.where})"

    # -- sidecar index --------------------------------------------------------------------
    def index(self, shard: int) -> SampleIndex:
        idx = self._indexes.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            url = join(self.base, info.index_path)
            if is_local(url):
                data = read_bytes(url, self.options.storage_options)
            else:  # remote: fetched once per node through the cache, like the shards
                with open(self._cached_copy(info.index_path, info.index_sha256, url), "rb") as f:
                    data = f.read()
            digest = hashlib.sha256(data).hexdigest()
            if digest != info.index_sha256:
                raise ChecksumError(
                    f"sample index {url} ({self.where}) hashes to {digest}, the manifest says "
                    f"{info.index_sha256}; re-pack or re-index the dataset"
                )
            idx = SampleIndex.from_arrow_bytes(data, url)
            if len(idx) != info.num_samples:
                raise ManifestError(
                    f"sample index {url} lists {len(idx)} samples, the manifest {info.num_samples}"
                )
            self._indexes[shard] = idx
            if len(self._indexes) > 64:
                self._indexes.popitem(last=False)
        return idx

    def _cached_copy(self, name: str, sha256: str, url: str) -> str:
        def open_stored() -> Any:
            return open_read(url, self.options.storage_options, policy=self.options.retry)

        def copy(src: Any, dst: Any) -> int:
            return dst.write(src.read())

        path = self.cache().get(name, 0, sha256, url, open_stored, copy)
        assert path is not None  # waiting calls always return the staged path
        return path

    # -- staging --------------------------------------------------------------------------
    def cache(self) -> ShardCache:
        if self._cache is None:
            cache = ShardCache(self.options.cache, self.manifest.fingerprint)
            cache.require(self.working_set)
            if cache.max_bytes is None:  # bounded by default: twice what the plan needs
                cache.max_bytes = max(2 * self.working_set, 1 << 30)
            self._cache = cache
        return self._cache

    def _stage(self, shard: int, wait: bool = True) -> str | None:
        info = self.manifest.shards[shard]
        url = self.url(shard)
        m = self.manifest
        where = self.describe(shard)
        cache = self.cache()

        def open_stored() -> Any:
            if is_local(url):
                return open_read(url)
            # Remote: download whole (ranged GETs, retried, size and sha256 checked), then
            # stage from the local copy; a fault mid-body restarts the download, not the epoch.
            download = cache.path_for(info.path) + f".download-{uuid.uuid4().hex}"
            fetch_shard(
                url,
                download,
                sha256=info.sha256,
                size=info.bytes,
                policy=self.options.retry,
                storage_options=self.options.storage_options,
            )
            return _RemoveOnClose(download)

        def stage(src: Any, dst: Any) -> int:
            return shard_format.stage(m.format, m.compression, src, dst, where)

        return cache.get(
            info.path,
            info.raw_bytes,
            info.sha256,
            where,
            open_stored,
            stage,
            verified=not is_local(url),
            wait=wait,
        )

    def local_file(self, shard: int) -> str:
        """A local uncompressed file for ``shard``: the shard itself, or its staged copy."""
        if self.in_place:
            here = local_path(self.url(shard))
            try:
                size = os.path.getsize(here)
            except OSError as err:
                raise ShardError(f"{self.describe(shard)}: cannot open ({err.strerror})") from err
            expected = self.manifest.shards[shard].bytes
            if size != expected:
                raise ShardError(
                    f"{self.describe(shard)}: truncated or replaced: {size:,} bytes on disk, "
                    f"{expected:,} in the manifest"
                )
            return here
        future = self._ahead.pop(shard, None)
        path: str | None = future.result() if future is not None else None
        if path is None:  # not read ahead, or another process was staging it: wait for it
            path = self._stage(shard)
        assert path is not None
        return path

    def prefetch(self, shards: Iterable[int]) -> None:
        """Stage these shards in the background (read-ahead); no-op for in-place shards."""
        if self.in_place or self.options.readahead <= 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=min(4, self.options.readahead + 1),
                thread_name_prefix="shardloader-readahead",
            )
        for shard in shards:
            if shard in self._ahead or shard in self._readers or shard in self._corrupt:
                continue
            # wait=False: a shard another worker is staging is skipped, so read-ahead threads
            # of different workers fetch different shards in parallel instead of queueing.
            self._ahead[shard] = self._pool.submit(self._stage, shard, False)

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
            reader = self._open_reader(shard)
        except ChecksumError as err:
            self._corrupt[shard] = err
            raise
        self._readers[shard] = reader
        if len(self._readers) > _OPEN_READERS:
            _, old = self._readers.popitem(last=False)
            old.close()
        return reader

    def _open_reader(self, shard: int) -> ShardReader:
        index = self.index(shard)
        for attempt in range(3):
            path = self.local_file(shard)
            try:
                reader = shard_format.open_reader(
                    self.manifest.format, path, index, self.describe(shard)
                )
                break
            except FileNotFoundError:  # evicted by another process between stage and open
                if attempt == 2:
                    raise
        assert reader is not None
        return reader

    def read(self, shard: int, local: int) -> Sample:
        try:
            return self.reader(shard).read(int(local))
        except (ShardError, StorageError):
            raise
        except OSError as err:
            raise ShardError(f"{self.describe(shard)}: read failed ({err})") from err

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self._pool is not None:
            for future in self._ahead.values():
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()
