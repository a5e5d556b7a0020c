"""A pass's shards as local files (:class:`ShardFiles`): read in place, or staged through the
node cache, ahead in background threads (read-ahead).

Uncompressed local shards are read in place: checked against their manifest size, and hashed
whole on first use when their sidecar has no per-sample checksums (NOTE [first-use hash notes]
below).  Remote or compressed shards are staged once per node, under the node cache's per-shard
lock, in one pass: stored bytes are read only up to the manifest's ``bytes`` and staged only up
to its ``raw_bytes`` (a decompression bomb stops there, and its temp file is removed).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from shardloader.errors import ChecksumError, ShardError, StorageError, located
from shardloader.format.embedded import tail_to_keep
from shardloader.manifest import SampleIndex, ShardInfo
from shardloader.schema import sidecar_bound
from shardloader.storage.cache import ShardCache
from shardloader.storage.private import open_private, open_regular, write_private
from shardloader.storage.streams import HashingReader, TailReader

if TYPE_CHECKING:
    from shardloader.read.shardset import ShardSet

__all__ = ["ShardFiles"]

_STAGING_THREADS = 16  # shards one process stages at once (read-ahead and a batch's shards)


class ShardFiles:
    """The local file of each shard of one dataset, for one process (one pass)."""

    def __init__(self, shards: ShardSet) -> None:
        self.shards = shards  # its node cache, shard names and sample indexes
        self.manifest, self.store, self.options = shards.manifest, shards.store, shards.options
        self.format = shards.format
        self.in_place = self.store.is_local and self.format.reads_in_place(
            self.manifest.compression
        )
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future[str | None]] = {}
        self._hashed: set[int] = set()  # in-place shards whose first-use hash was checked

    def stage(self, shard: int, wait: bool = True) -> str | None:
        """Stage ``shard`` into the node cache (once per node) and return its copy's path;
        None with ``wait=False`` when another process is staging it."""
        info = self.manifest.shards[shard]
        store = self.store.join(info.path)
        m = self.manifest
        where = self.shards.describe(shard)
        streamed: list[TailReader] = []

        def open_stored() -> Any:
            # One pass: the stored bytes stream through the hash (the cache's) and the
            # decompressor into the staged file; a remote fault mid-body resumes where it broke
            # off.  A remote shard's tail is kept for the sample index it may carry.
            stream = store.open_stream(info.bytes, part_size=self.options.part_size)
            if store.is_local:
                return stream
            tail = TailReader(stream, tail_to_keep(sidecar_bound(info)))
            streamed.append(tail)
            return tail

        limit = self.format.staged_bound(info, len(m.fields))

        def stage(src: Any, dst: Any) -> int:
            with located(where):
                return self.format.stage(src, dst, m.compression, limit)

        def staged() -> None:
            if streamed:
                self.shards.indexes.keep_embedded(shard, streamed[-1])

        return self.shards.cache().get(
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
            store = self.store.join(self.manifest.shards[shard].path)
            here = store.local_path
            try:
                with open_regular(here, store.url) as f:  # not a FIFO, not a device
                    size = os.fstat(f.fileno()).st_size
            except StorageError as err:
                raise ShardError(f"{self.shards.describe(shard)}: {err}") from err
            expected = self.manifest.shards[shard].bytes
            if size != expected:
                raise ShardError(
                    f"{self.shards.describe(shard)}: truncated or replaced: {size:,} bytes on "
                    f"disk, {expected:,} in the manifest"
                )
            return here
        future = self._ahead.pop(shard, None)
        path: str | None = future.result() if future is not None else None
        if path is None:  # not read ahead, or another process was staging it: wait for it
            path = self.stage(shard)
        assert path is not None
        return path

    def first_use(self, shard: int, path: str, index: SampleIndex) -> None:
        """Hash an in-place shard whole once, when samples are verified but its sidecar has no
        per-sample checksums (written before they existed): NOTE [first-use hash notes]."""
        if not self.in_place or not self.options.verify_samples or index.checksums is not None:
            return
        if shard not in self._hashed:
            notes = ShardCache(self.options.cache, self.manifest.fingerprint).folder
            _hash_once(path, self.manifest.shards[shard], notes, self.shards.describe(shard))
            self._hashed.add(shard)

    def prefetch(self, shards: Iterable[int]) -> None:
        """Stage these shards in the background (read-ahead); no-op for in-place shards."""
        if self.in_place or self.options.readahead <= 0:
            return
        if self._pool is None:  # threads mostly wait on the network: a batch's shards at once
            self._pool = ThreadPoolExecutor(
                max_workers=_STAGING_THREADS, thread_name_prefix="shardloader-readahead"
            )
        for shard in shards:
            if shard in self._ahead:
                continue
            # wait=False: a shard another worker is staging is skipped, so read-ahead threads
            # of different workers fetch different shards in parallel instead of queueing.
            self._ahead[shard] = self._pool.submit(self.stage, shard, False)

    def staging(self, shards: Iterable[int]) -> bool:
        """Whether any of these shards is still being staged by this process's read-ahead."""
        return any((f := self._ahead.get(s)) is not None and not f.done() for s in shards)

    def discard(self, shard: int, inode: int | None) -> None:
        """Drop the staged copy of ``shard`` (found damaged): the next use stages it again."""
        self.shards.cache().discard(self.manifest.shards[shard].path, inode)
        self._ahead.pop(shard, None)

    def close(self) -> None:
        """Stop read-ahead: cancel what has not started, wait for what has."""
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
            with open(path, "rb") as f:
                whole = HashingReader(f)
                whole.drain()
            if whole.hexdigest() != info.sha256:
                raise ChecksumError(
                    f"{where}: hashes to sha256 {whole.hexdigest()}, the manifest says "
                    f"{info.sha256}: the shard is damaged or was replaced; re-pack it or restore "
                    "it from a copy (`shardloader verify` lists every bad shard)"
                )
            write_private(note, f"{path}\n{info.sha256}\n".encode())
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
