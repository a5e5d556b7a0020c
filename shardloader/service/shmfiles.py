"""The files behind the service's shared memory (a stream's segment, NOTE [shm handover] in
:mod:`shardloader.service.shm`, and its workers' ring, NOTE [forwarded slots] in
:mod:`shardloader.service.ring`): made private and locked, mapped with checks, unlinked, and
those of servers that died removed.

NOTE [stale segments]
    A file is named ``shardloader-<pid>-<random>`` in the shared-memory folder and keeps its
    name only until the client maps it (or its stream ends).  A server killed with SIGKILL in
    between leaves the name, and the memory, for good.  So the server holds a shared
    ``flock`` on each file from the moment it creates it until it unlinks it; the kernel drops
    the lock with the last process that holds it (the server and its forked DataLoader
    workers, which exit soon after it: NOTE [orphaned workers] in
    :mod:`shardloader.deliver.workerinit`).  When a server starts it removes every such file of its
    user whose lock it can take at once: no live process holds it, whatever pid namespace that
    process runs in (containers sharing ``/dev/shm``).  A file younger than
    :data:`STALE_SECONDS` is left alone: its creator may not have locked it yet.  (A server of
    a version that takes no lock loses the names of segments its clients have not mapped yet;
    those streams stay on TCP.)
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
import re
import secrets
import stat
import time

__all__ = [
    "NAME",
    "PREFIX",
    "STALE_SECONDS",
    "ServerFile",
    "create_server_file",
    "default_reserve",
    "leftover_segments",
    "map_server_file",
    "remove_stale",
    "unlink_quietly",
]

PREFIX = "shardloader-"
NAME = re.compile(r"^shardloader-[0-9]+-[0-9a-f]{32}$")
STALE_SECONDS = 2.0
_MAX_RESERVE = 1 << 30


class ServerFile:
    """The name of a file this server made, locked until :meth:`unlink` (NOTE [stale
    segments])."""

    def __init__(self, name: str, path: str, lock: int) -> None:
        self.name, self.path = name, path
        self._lock: int | None = lock

    def unlink(self) -> None:
        """Remove the name (if still there) and let go of its lock; idempotent."""
        lock, self._lock = self._lock, None
        if lock is not None:
            unlink_quietly(self.path)
            os.close(lock)


def create_server_file(folder: str, size: int) -> tuple[ServerFile, mmap.mmap]:
    """A new file of ``size`` bytes in ``folder`` that only this user can open, locked and its
    space reserved (a full /dev/shm is an OSError here, and the stream stays on TCP, never a
    SIGBUS on a write later), and its mapping.  The server's side of :func:`map_server_file`."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
    path = os.path.join(folder, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # NOTE [stale segments]: held until the name goes
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
        return ServerFile(name, path, fd), mmap.mmap(fd, size)
    except BaseException:
        unlink_quietly(path)
        os.close(fd)
        raise


def map_server_file(path: str, size: int, what: str) -> mmap.mmap:
    """Map a file the server announced, refusing anything but a regular file of ``size``
    bytes owned by this user (no symlink followed): the checks every client mapping makes
    before it trusts the server's nonce inside (NOTE [shm handover])."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
            raise FileNotFoundError(f"{path} is not the server's {what}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def unlink_quietly(path: str | None) -> None:
    """Remove ``path`` if it is still there (the other side may have removed it)."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def leftover_segments(folder: str = "/dev/shm") -> list[str]:
    """Names of shardloader files in ``folder`` (for tests and operators: none once every
    stream has attached or ended, and none of a dead server once another has started)."""
    try:
        return sorted(n for n in os.listdir(folder) if NAME.match(n))
    except OSError:
        return []


def remove_stale(folder: str) -> tuple[int, int]:
    """Remove the files of servers that died (NOTE [stale segments]): (files, bytes)."""
    removed = freed = 0
    now = time.time()
    for name in leftover_segments(folder):
        path = os.path.join(folder, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:  # gone meanwhile, a symlink, another user's
            continue
        try:
            st = os.fstat(fd)
            if (
                not stat.S_ISREG(st.st_mode)
                or st.st_uid != os.getuid()
                or now - max(st.st_mtime, st.st_ctime) < STALE_SECONDS
            ):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live server (or its workers) holds it
                continue
            unlink_quietly(path)
            removed, freed = removed + 1, freed + st.st_size
        finally:
            os.close(fd)
    return removed, freed


@functools.lru_cache(maxsize=8)
def default_reserve(folder: str) -> int:
    """How much shared memory unattached clients may hold by default (NOTE [unattached
    reserve] in :mod:`shardloader.service.streamshm`): half the folder's file system, at most
    1 GiB."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return _MAX_RESERVE
    return min(_MAX_RESERVE, st.f_blocks * st.f_frsize // 2)
