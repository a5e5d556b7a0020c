"""A node-local cache of *staged* shards: uncompressed, random-access copies.

NOTE [sharing the cache between processes]: every DataLoader worker of every local rank may
need the same shard at once.  Each shard has a lock file next to its staged copy; a process
takes an exclusive ``fcntl.flock`` on it, checks whether the copy exists, and if not stages it
to a temp name and renames it.  Others block on the lock and then find the copy, so a shard is
fetched and decompressed once per node.  ``flock`` locks die with their process, so a killed run
leaves nothing that blocks the next one (at most a stale temp file, removed on the next stage of
that shard).  Staged copies that are evicted while another process reads them stay readable
through that process's open file (POSIX unlink semantics).

Eviction touches only ``*.raw`` files in this cache's own folder, least recently used first
(each use refreshes the mtime), so consumed shards go first and nothing the cache did not
create is ever deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from shardloader.errors import ChecksumError, UsageError

__all__ = ["CacheOptions", "ShardCache"]

log = logging.getLogger(__name__)

_MARKER = ".shardloader-cache"


@dataclass(frozen=True)
class CacheOptions:
    """``dir``: where staged shards go (default: a folder under the system temp dir).
    ``max_bytes``: the cache's size limit; ``None`` sizes it from the plan's working set."""

    dir: str | None = None
    max_bytes: int | None = None


def default_cache_root() -> str:
    return os.path.join(tempfile.gettempdir(), "shardloader-cache")


class _HashingReader:
    """Read-through wrapper that hashes every byte it hands out."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.count = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        self.count += len(data)
        return data

    def readinto(self, buf: bytearray | memoryview) -> int:
        n = self._f.readinto(buf)  # type: ignore[attr-defined]
        self.sha.update(memoryview(buf)[:n])
        self.count += n
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False


class ShardCache:
    """Stages shards into ``<dir>/<dataset fingerprint>/`` once per node."""

    def __init__(self, options: CacheOptions, fingerprint: str) -> None:
        root = options.dir or default_cache_root()
        self.folder = os.path.join(root, fingerprint)
        self.max_bytes = options.max_bytes
        os.makedirs(self.folder, exist_ok=True)
        marker = os.path.join(self.folder, _MARKER)
        if not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write("staged shards of one shardloader dataset; safe to delete when idle\n")

    def path_for(self, name: str) -> str:
        return os.path.join(self.folder, name.replace("/", "__") + ".raw")

    def require(self, needed: int) -> None:
        """Fail at start, not with a throughput cliff, when the limit cannot hold the plan."""
        if self.max_bytes is not None and needed > self.max_bytes:
            raise UsageError(
                f"cache limit {self.max_bytes:,} bytes is below the {needed:,} bytes of staged "
                "shards this plan keeps in use at once; raise CacheOptions.max_bytes or lower "
                "the shuffle block / read-ahead"
            )

    def get(
        self,
        name: str,
        raw_bytes: int,
        sha256: str,
        where: str,
        open_stored: Callable[[], BinaryIO],
        stage: Callable[[BinaryIO, BinaryIO], int],
        verified: bool = False,
        wait: bool = True,
    ) -> str | None:
        """Path of the staged copy of shard ``name``, staging it first if needed.

        ``open_stored`` opens the stored shard; ``stage`` copies it uncompressed into a file.
        The stored bytes are hashed on the way and must match ``sha256``; a mismatch is staged
        once more (a flaky read), then raised as :class:`ChecksumError`.  ``verified`` says
        ``open_stored`` already checked the bytes (a verified download), so they are not
        hashed twice.  With ``wait=False`` (read-ahead) a shard that another process is staging
        right now returns None at once, so the caller can fetch a different one meanwhile.
        """
        final = self.path_for(name)
        if os.path.exists(final):
            _touch(final)
            return final
        with open(final + ".lock", "a+b") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None
            try:
                if os.path.exists(final):
                    _touch(final)
                    return final
                self._make_room(raw_bytes)
                for attempt in (1, 2):
                    digest = self._stage_once(final, sha256, open_stored, stage, verified)
                    if digest == sha256:
                        return final
                    log.warning("%s: checksum mismatch on attempt %d", where, attempt)
                raise ChecksumError(
                    f"{where}: stored bytes hash to sha256 {digest}, the manifest says {sha256}; "
                    "the shard is corrupt or was replaced: re-pack it or restore it from a copy"
                )
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _stage_once(
        self,
        final: str,
        sha256: str,
        open_stored: Callable[[], BinaryIO],
        stage: Callable[[BinaryIO, BinaryIO], int],
        verified: bool,
    ) -> str:
        tmp = f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            with open_stored() as src, open(tmp, "wb") as dst:
                if verified:
                    stage(src, dst)
                    digest = sha256
                else:
                    hashing = _HashingReader(src)
                    stage(hashing, dst)  # type: ignore[arg-type]
                    hashing.drain()
                    digest = hashing.sha.hexdigest()
            if digest == sha256:
                os.replace(tmp, final)
            return digest
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _make_room(self, incoming: int) -> None:
        if self.max_bytes is None:
            return
        entries = []
        for name in os.listdir(self.folder):
            if name.endswith(".raw"):
                path = os.path.join(self.folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                entries.append((st.st_mtime, st.st_size, path))
        used = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if used + incoming <= self.max_bytes:
                break
            try:
                os.remove(path)
                used -= size
                log.debug("evicted %s (%d bytes)", path, size)
            except FileNotFoundError:
                pass


def _touch(path: str) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:
        pass
