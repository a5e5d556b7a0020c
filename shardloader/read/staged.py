"""One pass's shards, for one process: staged through the node cache, indexed, opened, and
their samples read by global id.

:class:`ShardSet` lives for one pass of one worker.  It stages shards (one pass, through the
node cache's per-shard lock) when they are remote or compressed, ahead in background threads
(read-ahead), fetches and checks their sample indexes, opens their format readers (a few kept
open), locates global ids, and reads each batch shard by shard in one pass.  Uncompressed local
shards are read in place.

Nothing here trusts the dataset: a sidecar is checked against its manifest entry before use,
stored bytes are read only up to the manifest's ``bytes`` and staged only up to its
``raw_bytes`` (a decompression bomb stops there, and its temp file is removed), and samples are
checked against the sidecar's checksums (XXH3-64) as they are read.  Sidecars written before
those existed have none; an uncompressed local shard is then hashed whole on first use (SHA-256
against the manifest), and a note in the node cache saves the next process the work.

A staged copy found damaged when read (a sample's checksum, a cut-off sample, a copy the
format cannot open, a file that changed while mapped: NOTE [no SIGBUS] in format/mapped.py) is
staged once more from the source (NOTE [re-staging a damaged copy] in storage/cache.py); if
the new copy is damaged too, the source is, and the error says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.errors import ChecksumError, ShardChangedError, ShardError, StorageError
from shardloader.format.base import Rows, Sample, ShardReader, read_rows
from shardloader.format.embedded import TAIL_KEEP, embedded_index
from shardloader.format.mapped import changed_since
from shardloader.format.registry import get_format
from shardloader.manifest import Manifest, SampleIndex, ShardInfo
from shardloader.read.sidecar import check_digest, parse_sidecar, read_sidecar
from shardloader.schema import sidecar_bound, staged_bound
from shardloader.storage.cache import ShardCache, is_cache_full
from shardloader.storage.localfiles import open_regular
from shardloader.storage.private import create_private, open_private
from shardloader.storage.store import Store
from shardloader.storage.streams import BoundedReader, TailReader

if TYPE_CHECKING:
    from shardloader.options import ReadOptions

__all__ = ["ShardSet", "shard_starts"]

log = logging.getLogger(__name__)

_STAGING_THREADS = 16  # shards one process stages at once (read-ahead and a batch's shards)
_CARRIED = ".carried"  # cache name suffix of a sample index that came inside its shard
_OPEN_READERS = 128  # file handles; a shuffle block touches many shards at once


def shard_starts(manifest: Manifest) -> np.ndarray:
    """Global id of each shard's first sample, plus the total at the end."""
    return np.concatenate([[0], np.cumsum(manifest.shard_sizes)]).astype(np.int64)


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
        self.base = base
        self.options = options
        self.where = where  # e.g. "rank 0/2, worker 1/4": goes into every error message
        self.store = options.store(base)
        self.format = get_format(manifest.format)
        self.in_place = self.store.is_local and self.format.reads_in_place(manifest.compression)
        self.working_set = working_set  # staged bytes the plan keeps in use at once
        self._cache: ShardCache | None = None
        self._indexes: OrderedDict[int, SampleIndex] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future[str | None]] = {}
        self._hashed: set[int] = set()  # in-place shards whose first-use hash was checked
        self._inodes: dict[int, int] = {}  # the staged copy each open reader reads
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

    def shard_store(self, shard: int) -> Store:
        return self.store.join(self.manifest.shards[shard].path)

    def url(self, shard: int) -> str:
        return self.shard_store(shard).url

    def describe(self, shard: int) -> str:
        return f"shard {self.url(shard)} ({self.where})"

    # -- sidecar index --------------------------------------------------------------------
    def index(self, shard: int) -> SampleIndex:
        idx = self._indexes.get(shard)
        if idx is None:
            info = self.manifest.shards[shard]
            store = self.store.join(info.index_path)
            where = f"sample index {store.url} ({self.where})"
            carried = None if store.is_local else self._embedded_copy(info)
            if carried is not None:  # came inside the shard, which hashed to the manifest's sum
                data = carried
            elif store.is_local:
                data = read_sidecar(store, info, where)
                check_digest(data, info, where)
            else:  # remote: fetched once per node through the cache, like the shards
                data = self._cached_sidecar(info, store, where)
            idx = parse_sidecar(data, store.url, self.manifest.format, info, self.describe(shard))
            self._indexes[shard] = idx
            if len(self._indexes) > 64:
                self._indexes.popitem(last=False)
        return idx

    def _cached_sidecar(self, info: ShardInfo, store: Store, where: str) -> bytes:
        """A remote sidecar's bytes from its node cache copy; a copy damaged since it was
        fetched (it hashed right then) is fetched once more (NOTE [re-staging a damaged copy]
        in storage/cache.py)."""
        for attempt in (1, 2):
            path = self._cached_copy(info, store, where)
            inode = os.stat(path).st_ino
            data = read_sidecar(Store(path), info, where)
            try:
                check_digest(data, info, where)
                return data
            except ChecksumError:
                if attempt == 2:
                    raise
                log.warning("%s: its copy in the node cache is damaged; fetching it again", where)
                self.cache().discard(info.index_path, inode)
        raise AssertionError("unreachable")

    def _cached_copy(self, info: ShardInfo, store: Store, where: str) -> str:
        def open_stored() -> Any:  # one GET, no HEAD: the bound stands in for the size
            return store.open_stream(limit=sidecar_bound(info))

        def copy(src: Any, dst: Any) -> int:
            return dst.write(src.read())

        path = self.cache().get(info.index_path, 0, info.index_sha256, store.url, open_stored, copy)
        assert path is not None  # waiting calls always return the staged path
        return path

    def _embedded_copy(self, info: ShardInfo) -> bytes | None:
        """The sample index a staged shard carried (format/embedded.py), if it did."""
        try:
            path = self.cache().path_for(info.index_path + _CARRIED)
            with open_private(path, os.O_RDONLY, "rb") as f:
                if os.fstat(f.fileno()).st_size > sidecar_bound(info):
                    return None  # never written so (see _keep_embedded): not ours to trust
                return f.read()
        except (FileNotFoundError, StorageError):
            return None

    def _keep_embedded(self, shard: int, stored: TailReader) -> None:
        """Save the sample index a shard carries next to its staged copy (called under the
        shard's cache lock, after its stored bytes hashed to the manifest's SHA-256: the copy
        is as trustworthy as the shard; it is still checked like a sidecar when parsed)."""
        info = self.manifest.shards[shard]
        data = embedded_index(stored.tail)
        if data is None or len(data) > sidecar_bound(info):
            return
        final = self.cache().path_for(info.index_path + _CARRIED)
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            with create_private(tmp) as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as err:  # only costs a GET of the sidecar later
            log.debug("%s: cannot keep the embedded sample index (%s)", self.describe(shard), err)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    # -- staging --------------------------------------------------------------------------
    def cache(self) -> ShardCache:
        if self._cache is None:
            cache = ShardCache(self.options.cache, self.manifest.fingerprint, self.store.url)
            cache.require(self.working_set)
            self._cache = cache
        return self._cache

    def _stage(self, shard: int, wait: bool = True) -> str | None:
        info = self.manifest.shards[shard]
        store = self.shard_store(shard)
        m = self.manifest
        where = self.describe(shard)
        cache = self.cache()
        streamed: list[TailReader] = []

        def open_stored() -> Any:
            if store.is_local:
                return BoundedReader(store.open_read(), info.bytes, where)
            # Remote: one pass.  The GET body streams through the hash (the cache's) and the
            # decompressor into the staged file; a fault mid-body resumes where it broke off.
            keep = min(TAIL_KEEP, sidecar_bound(info) + 64)
            stream = TailReader(
                store.open_stream(info.bytes, part_size=self.options.part_size), keep
            )
            streamed.append(stream)
            return stream

        limit = staged_bound(m.format, info, len(m.fields))

        def stage(src: Any, dst: Any) -> int:
            return self.format.stage(src, dst, m.compression, where, limit)

        def staged() -> None:
            if streamed:
                self._keep_embedded(shard, streamed[-1])

        return cache.get(
            info.path,
            info.raw_bytes,
            info.sha256,
            where,
            open_stored,
            stage,
            wait=wait,
            on_staged=staged,
        )

    def local_file(self, shard: int) -> str:
        """A local uncompressed file for ``shard``: the shard itself, or its staged copy."""
        if self.in_place:
            here = self.shard_store(shard).local_path
            try:
                with open_regular(here, self.url(shard)) as f:  # not a FIFO, not a device
                    size = os.fstat(f.fileno()).st_size
            except StorageError as err:
                raise ShardError(f"{self.describe(shard)}: {err}") from err
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
        """Stage these shards in the background (read-ahead); no-op for in-place shards and
        for shards open already or known bad."""
        if self.in_place or self.options.readahead <= 0:
            return
        shards = [s for s in shards if s not in self._readers and s not in self._corrupt]
        if self._pool is None:  # threads mostly wait on the network: a batch's shards at once
            self._pool = ThreadPoolExecutor(
                max_workers=_STAGING_THREADS, thread_name_prefix="shardloader-readahead"
            )
        for shard in shards:
            if shard in self._ahead:
                continue
            # wait=False: a shard another worker is staging is skipped, so read-ahead threads
            # of different workers fetch different shards in parallel instead of queueing.
            self._ahead[shard] = self._pool.submit(self._stage, shard, False)

    def staging(self, shards: Iterable[int]) -> bool:
        """Whether any of these shards is still being staged by this process's read-ahead."""
        return any((f := self._ahead.get(s)) is not None and not f.done() for s in shards)

    # -- opening ---------------------------------------------------------------------------
    def open_reader(self, shard: int) -> ShardReader:
        """A new format reader of ``shard``: staged (or in place), its sample index checked."""
        verify = self.options.verify_samples
        # Local: the sidecar first (a bad one is refused before the shard is staged).  Remote:
        # the shard first, since a shard that carries its sample index brings it along.
        index = self.index(shard) if self.store.is_local else None
        for attempt in range(3):
            try:
                path = self.local_file(shard)
            except ChecksumError as err:  # staging again after damage: the source is bad too
                if shard in self._restaged:
                    raise self.damaged(shard, err) from err
                raise
            if index is None:
                index = self.index(shard)
            if verify and self.in_place and index.checksums is None and shard not in self._hashed:
                _hash_once(path, self.manifest.shards[shard], self._notes(), self.describe(shard))
                self._hashed.add(shard)
            try:
                st = os.stat(path)
                reader = self.format.reader(path, index, self.describe(shard), verify)
            except FileNotFoundError:  # evicted by another process between stage and open
                if attempt == 2:
                    raise
                continue
            except ShardError as err:  # a staged copy that cannot be opened: damaged?
                if self.in_place:
                    raise
                if not self.restage(shard):
                    raise self.damaged(shard, err) from err
                index = self.index(shard) if self.store.is_local else None
                continue
            if not self.in_place:
                self._inodes[shard] = st.st_ino
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

    def read(self, shard: int, local: int) -> Sample:
        try:
            reader = self.reader(shard)
            self.check(shard)  # NOTE [no SIGBUS] in format/mapped.py
            return reader.read(int(local))
        except StorageError:
            raise
        except ShardError as err:  # a damaged staged copy is staged once more
            if not self.restage(shard):
                if isinstance(err, ShardChangedError):
                    self._forget(shard)
                if not self.in_place:
                    raise self.damaged(shard, err) from err
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
            reader = self.reader(shard)
            self.check(shard)  # NOTE [no SIGBUS] in format/mapped.py
            read_rows(reader, rows, into, at)
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
        bad = [k for k, pos in enumerate(at) if isinstance(into.errors.get(pos), ShardError)]
        if not bad or self.in_place:
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

    def check(self, shard: int) -> None:
        """ShardChangedError when the file an open reader of ``shard`` maps shrank or grew since it
        was opened: reading the map now could kill the process (NOTE [no SIGBUS] in
        format/mapped.py).  Called before each batch read from it."""
        opened = self._opened.get(shard)
        if opened is None:
            return
        change = changed_since(*opened)
        if change is not None:
            raise ShardChangedError(f"{self.describe(shard)}: {change}")

    # -- damaged staged copies (NOTE [re-staging a damaged copy] in storage/cache.py) ------
    def restage(self, shard: int) -> bool:
        """Drop the staged copy of ``shard``, found damaged, so that the next open stages it
        again from the source; False when that was done already in this pass (or the shard is
        read in place: there is no copy), so the damage is the source's."""
        if self.in_place or shard in self._restaged:
            return False
        self._restaged.add(shard)
        log.warning("%s: its staged copy is damaged; staging it again", self.describe(shard))
        self.cache().discard(self.manifest.shards[shard].path, self._inodes.pop(shard, None))
        self._indexes.pop(shard, None)  # a sample index it carried is staged again with it
        self._opened.pop(shard, None)
        self._ahead.pop(shard, None)
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

    def _notes(self) -> str:
        """The node cache folder, where first-use hashes of in-place shards are noted."""
        return ShardCache(self.options.cache, self.manifest.fingerprint).folder

    def close(self) -> None:
        """Close the open readers and stop read-ahead: cancel what has not started, wait for
        what has."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self._pool is not None:
            for future in self._ahead.values():
                future.cancel()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._ahead.clear()


def _hash_once(path: str, info: ShardInfo, folder: str, where: str) -> None:
    """Check an in-place shard against the manifest's SHA-256, once per node and file version.

    NOTE [first-use hash notes]: the note's name hashes the file's device, inode, size and
    mtime with the expected digest, so a replaced or rewritten shard is hashed again; an
    ``flock`` on the note's lock file makes concurrent workers wait for one hash instead of
    each reading the shard.  A note is written only after the digest matched.
    """
    st = os.stat(path)
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{info.sha256}"
    note = os.path.join(folder, f"verified-{hashlib.sha256(stamp.encode()).hexdigest()[:32]}")
    if os.path.exists(note):
        return
    with open_private(note + ".lock", os.O_RDWR | os.O_CREAT, "r+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if os.path.exists(note):
                return
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                while chunk := f.read(4 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != info.sha256:
                raise ChecksumError(
                    f"{where}: hashes to sha256 {digest.hexdigest()}, the manifest says "
                    f"{info.sha256}: the shard is damaged or was replaced; re-pack it or restore "
                    "it from a copy (`shardloader verify` lists every bad shard)"
                )
            tmp = f"{note}.tmp-{uuid.uuid4().hex}"
            with create_private(tmp) as f:
                f.write(f"{path}\n{info.sha256}\n".encode())
            os.replace(tmp, note)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
