"""A node-local cache of *staged* shards: uncompressed, random-access copies, staged once per
node and shared by every process (where it lives, how big it grows and how shards leave it:
cachedir.py).

NOTE [sharing the cache between processes]: every DataLoader worker of every local rank (and
every other run on the node) may need the same shard at once.  Each staged copy ``X.raw`` has a
lock file ``X.raw.lock``; a process takes an exclusive ``fcntl.flock`` on it, checks whether
the copy exists, and if not stages it to a temp name (``X.raw.tmp-*``, ``X.raw.download-*``) and
renames it.  Others block on the lock and then find the copy, so a shard is fetched and
decompressed once per node.  ``flock`` locks die with their process, so a killed run leaves
nothing that blocks the next one; its temp files are stale and go with the next eviction or
``shardloader cache clear`` (NOTE [eviction and clearing] in cachedir.py).

NOTE [re-staging a damaged copy]: a staged copy can be damaged after it was staged (a bit flip,
a truncation, a disk emptied under it).  A reader that finds its copy damaged calls
:meth:`ShardCache.discard` with the inode it read: under the shard's lock the copy is removed
only if it is still that file, so when several processes find the same damage, the first
removes it and stages it again, and the others, finding a new file, read that one instead of
removing it once more.  Whoever finds the new copy damaged too knows the source is.

NOTE [room note]: stagers keep a running count of what the root holds in ``<root>/.room``
(bytes the root held at the last full count, plus every reservation since, and when that count
was made), read and written only under the root's lock (NOTE [reservations]).  A reservation
that fits the noted figure is made without listing the root; one that does not, or a note
older than :data:`RECOUNT_SECONDS`, counts the root again and evicts as before.  Whatever
shrinks the cache without noting it (eviction, ``cache clear``, a staged copy shorter than its
reservation) leaves the note too high, which only brings the next count forward; what grows it
unnoted (sample indexes staged next to their shards, other versions of shardloader) is caught
by the next count, at most :data:`RECOUNT_SECONDS` later.  Counting every time cost an epoch
over many small shards time quadratic in their number.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from shardloader.errors import (
    ChecksumError,
    ObjectChangedError,
    ShardError,
    ShardloaderError,
    StorageError,
    UsageError,
)
from shardloader.storage.cachedir import (
    DEFAULT_SOURCES,
    DIR_ENV,
    LOCK,
    MARKER,
    MAX_BYTES_ENV,
    ROOM_LOCK,
    ROOM_NOTE,
    cache_limit,
    cache_name,
    cache_root,
    dataset_folders,
    lock_file,
    remove_entry,
    remove_quietly,
    staged_entries,
    touch,
    write_marker,
)
from shardloader.storage.private import create_private, open_private, own_dir, write_private
from shardloader.storage.protocols import chain
from shardloader.storage.streams import HashingReader

__all__ = ["RECOUNT_SECONDS", "CacheOptions", "ShardCache", "is_cache_full"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheOptions:
    """``dir``: the cache root (default :func:`cache_root`).  ``max_bytes``: the limit on all
    staged shards under the root, every dataset together (default :func:`cache_limit`)."""

    dir: str | None = None
    max_bytes: int | None = None


class ShardCache:
    """Stages shards into ``<root>/<dataset fingerprint>/`` once per node, within one limit
    for the whole root."""

    def __init__(self, options: CacheOptions, fingerprint: str, source: str = "") -> None:
        self.source = source  # the dataset's URL, noted in the folder's marker for cache info
        self.root, root_source = cache_root(options.dir)
        self._default_root = root_source in DEFAULT_SOURCES
        self.folder = os.path.join(self.root, fingerprint)
        self._explicit = options.max_bytes is not None or bool(os.environ.get(MAX_BYTES_ENV))
        # (limit, where it comes from); a default one is worked out when first needed (max_bytes)
        self._limit = cache_limit(self.root, options.max_bytes) if self._explicit else None
        self._needed = 0  # what the plan keeps staged at once (require)
        self._ensure_folder()

    @property
    def max_bytes(self) -> int:
        """The limit on all staged shards under the root.  The default one is worked out when
        something is staged, not at open: it may count what the root holds (cachedir.py)."""
        if self._limit is None:
            limit, source = cache_limit(self.root)  # an explicit one was worked out at open
            if 2 * self._needed > limit:
                log.info(
                    "shard cache %s: the plan keeps %d bytes staged at once; the limit grows "
                    "from %d (%s) to twice that",
                    self.root,
                    self._needed,
                    limit,
                    source,
                )
                limit = 2 * self._needed
            self._limit = limit, source
        return self._limit[0]

    def _ensure_folder(self) -> None:
        """The root and this dataset's folder, the user's own (NOTE [a cache of one's own])."""
        remedy = (
            f"point ${DIR_ENV} or CacheOptions(dir=...) at a local folder of your own (a new "
            "folder inside a writable one is made yours)"
        )
        own_dir(self.root, "the shard cache", tighten=self._default_root, remedy=remedy)
        own_dir(self.folder, "the shard cache folder", tighten=True, remedy=remedy)
        try:
            write_marker(os.path.join(self.folder, MARKER), self.source)
        except OSError as err:
            raise StorageError(
                f"cannot use the shard cache at {self.root} ({err.strerror or err}); {remedy}"
            ) from err

    def path_for(self, name: str) -> str:
        return os.path.join(self.folder, cache_name(name))

    def discard(self, name: str, inode: int | None) -> None:
        """Remove the staged copy of ``name`` if it is still the file ``inode`` that was found
        damaged (None: whatever is there) (NOTE [re-staging a damaged copy])."""
        final = self.path_for(name)
        try:
            lock = lock_file(final + LOCK, True)
        except FileNotFoundError:  # `cache clear` removed the folder: nothing to discard
            return
        assert lock is not None  # wait=True
        with lock:
            with contextlib.suppress(FileNotFoundError):
                if inode is None or os.stat(final, follow_symlinks=False).st_ino == inode:
                    os.remove(final)

    def require(self, needed: int) -> None:
        """Fail at start, not with a throughput cliff, when an explicit limit cannot hold what
        the plan keeps staged at once; a default limit grows to twice that instead."""
        if needed <= 0:
            return
        if not self._explicit:
            self._needed = max(self._needed, needed)
            if self._limit is not None and 2 * needed > self._limit[0]:
                self._limit = None  # worked out again, grown
            return
        assert self._limit is not None  # an explicit limit is worked out at once
        limit, source = self._limit
        if needed > limit:
            raise UsageError(
                f"cache limit {limit:,} bytes is below the {needed:,} bytes of "
                f"staged shards this plan keeps in use at once; raise {source} "
                "or lower the shuffle block / read-ahead"
            )

    def get(
        self,
        name: str,
        raw_bytes: int,
        sha256: str,
        where: str,
        open_stored: Callable[[], BinaryIO],
        stage: Callable[[BinaryIO, BinaryIO], int],
        wait: bool = True,
        on_staged: Callable[[], None] | None = None,
    ) -> str | None:
        """Path of the staged copy of shard ``name``, staging it first if needed.

        ``open_stored`` opens the stored shard; ``stage`` copies it uncompressed into a file.
        The stored bytes are hashed on the way and must match ``sha256``; a mismatch is staged
        once more (a flaky read), then raised as :class:`ChecksumError`.  With ``wait=False``
        (read-ahead) a shard that another process is staging right now returns None at once,
        so the caller can fetch a different one meanwhile.
        ``on_staged`` runs once the stored bytes matched, still under the shard's lock and before
        the staged copy appears under its name (what it leaves is there for every process that
        then finds the copy).
        """
        final = self.path_for(name)
        if touch(final):
            return final
        try:
            lock = lock_file(final + LOCK, wait)
        except FileNotFoundError:  # `cache clear` removed the folder since
            self._ensure_folder()
            lock = lock_file(final + LOCK, wait)
        if lock is None:
            return None
        with lock:
            if touch(final):
                return final
            reserved: str | None = self._reserve(raw_bytes, final)
            for attempt in (1, 2):
                try:
                    digest = self._stage_once(
                        final, sha256, open_stored, stage, on_staged, reserved
                    )
                except ObjectChangedError:  # replaced mid-download: the new one may be whole
                    if attempt == 2:
                        raise
                    log.warning("%s: the object changed while read; fetching it again", where)
                    digest = ""
                reserved = None
                if digest == sha256:
                    return final
                log.warning("%s: checksum mismatch on attempt %d", where, attempt)
            raise ChecksumError(
                f"{where}: stored bytes hash to sha256 {digest}, the manifest says {sha256}; "
                "the shard is corrupt or was replaced: re-pack it or restore it from a copy"
            )

    def _stage_once(
        self,
        final: str,
        sha256: str,
        open_stored: Callable[[], BinaryIO],
        stage: Callable[[BinaryIO, BinaryIO], int],
        on_staged: Callable[[], None] | None = None,
        reserved: str | None = None,
    ) -> str:
        tmp = reserved or f"{final}.tmp-{uuid.uuid4().hex}"
        try:
            with open_stored() as src:
                dst = open_private(tmp, os.O_RDWR, "r+b") if reserved else create_private(tmp)
                with dst:
                    try:
                        hashing = HashingReader(src)
                        try:
                            stage(hashing, dst)  # type: ignore[arg-type]
                        except ShardError as err:
                            if not _damaged_on_the_way(err, hashing, sha256):
                                raise
                        hashing.drain()
                        digest = hashing.hexdigest()
                        dst.truncate()  # a reservation longer than what was written
                    except OSError as err:
                        full = _no_space(err)
                        if full is None:
                            raise
                        raise self._full(final, full) from err
            if digest == sha256:
                if on_staged is not None:
                    on_staged()
                os.replace(tmp, final)
            return digest
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def _reserve(self, incoming: int, staging: str) -> str:
        """Make room for ``incoming`` bytes and claim them with a temp file of that size.

        NOTE [reservations]: processes stage shards concurrently; each counts the others' temp
        files.  Making room and creating the (sparse, full-size) temp file happen under one
        root-wide lock, so two stagers never both count the same free space: the limit holds
        with any number of workers and ranks staging at once.  The count itself is noted for
        the next stager (NOTE [room note]), so most reservations list nothing.
        """
        lock = lock_file(os.path.join(self.root, ROOM_LOCK), True)
        assert lock is not None  # wait=True
        with lock:
            note = noted_room(self.root)
            if note is None or note[0] + incoming > self.max_bytes:
                counted = time.time()
                note = self._make_room(incoming, staging), counted
            used, counted = note  # a reservation keeps the time of the last count
            tmp = f"{staging}.tmp-{uuid.uuid4().hex}"
            with create_private(tmp) as f:
                f.truncate(incoming)
            note_room(self.root, used + incoming, counted)
            return tmp

    def _make_room(self, incoming: int, staging: str) -> int:
        """Evict least recently used staged shards of any dataset under the root until
        ``incoming`` more bytes fit the limit (NOTE [eviction and clearing]); the bytes the
        root holds afterwards."""
        entries = []
        for _, folder in dataset_folders(self.root):
            for entry in staged_entries(folder):
                if entry.base != staging:
                    entries.append(entry)
                else:  # temp files a killed stager left: we hold this shard's lock now
                    for path in entry.files:
                        remove_quietly(path)
        used = sum(e.bytes for e in entries)
        if used + incoming <= self.max_bytes:
            return used
        for entry in sorted(entries, key=lambda e: e.last_used):
            freed = remove_entry(entry)
            if freed is None:
                continue  # being staged by another process right now
            used -= entry.bytes
            log.debug("evicted %s (%d bytes)", entry.base, freed)
            if used + incoming <= self.max_bytes:
                break
        return used

    def _full(self, final: str, err: OSError) -> StorageError:
        """One line naming the cache folder when its disk (or quota) is full."""
        out = StorageError(
            f"the shard cache at {self.folder} ran out of disk space ({err.strerror or err}) "
            f"while staging {os.path.basename(final)}: free space there, lower the cache "
            f"limit (CacheOptions(max_bytes=...), ${MAX_BYTES_ENV}), or point ${DIR_ENV} or "
            "CacheOptions(dir=...) at a larger local disk"
        )
        out.errno = err.errno  # a full disk is not one bad sample: readers stop on it
        return out


def _damaged_on_the_way(err: ShardError, hashing: HashingReader, sha256: str) -> bool:
    """Whether the shard that ``stage`` could not read (a zstd frame that does not decompress,
    a tar or token stream cut wrong) only came damaged: the rest of its bytes, hashed, do not
    match the manifest's SHA-256, so it is fetched again like any checksum mismatch (a byte
    flipped in transit, a 206 for the wrong range).  Bytes that match are the stored shard's
    own damage, reported as it is.  A size the store announced wrong is already a
    ChecksumError: the stream is closed then, and nothing is left to hash."""
    if isinstance(err, ChecksumError):
        return False
    try:
        hashing.drain()
    except ShardloaderError:
        raise
    except (OSError, ValueError):  # the source cannot be read to its end: report the first
        return False
    if hashing.hexdigest() == sha256:
        return False
    log.warning("%s; its bytes do not hash to the manifest's: fetching it again", err)
    return True


_FULL = (errno.ENOSPC, errno.EDQUOT)


def _no_space(err: BaseException) -> OSError | None:
    """The no-space error in ``err``'s chain (formats wrap write errors into their own)."""
    for e in chain(err):
        if isinstance(e, OSError) and e.errno in _FULL:
            return e
        if type(e).__module__.startswith("pyarrow") and any(
            os.strerror(code) in str(e) for code in _FULL
        ):  # pyarrow's writer keeps only the text
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def is_cache_full(err: BaseException) -> bool:
    """Whether ``err`` is :meth:`ShardCache._full`'s: the cache's disk is full."""
    return isinstance(err, StorageError) and err.errno in _FULL


RECOUNT_SECONDS = 10.0


def noted_room(root: str) -> tuple[int, float] | None:
    """(bytes, epoch seconds of the last full count) the root holds by its room note, or None:
    no note, an unreadable one, or one whose last full count is older than
    :data:`RECOUNT_SECONDS` (NOTE [room note])."""
    try:
        with open_private(os.path.join(root, ROOM_NOTE), os.O_RDONLY, "rb") as f:
            used, counted = f.read(100).split()
        note = int(used), float(counted)
    except (OSError, StorageError, ValueError):
        return None
    return note if 0 <= time.time() - note[1] < RECOUNT_SECONDS else None


def note_room(root: str, used: int, counted: float) -> None:
    """Note that the root holds ``used`` bytes, counted in full at ``counted`` (epoch
    seconds).  Under the root's lock only."""
    with contextlib.suppress(OSError):  # a note is only a shortcut: without it the next counts
        write_private(os.path.join(root, ROOM_NOTE), f"{used} {counted!r}\n".encode())
