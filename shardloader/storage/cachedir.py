"""Where the node-local shard cache lives, how its files are named, marked and locked; what a
root holds, how big it may grow and how copies leave it is cacheentries.py, staging cache.py.

Where: ``CacheOptions(dir=...)``, else ``$SHARDLOADER_CACHE_DIR``, else
``$XDG_CACHE_HOME/shardloader`` (``~/.cache/shardloader`` when unset).  Each dataset gets a
folder ``<root>/<manifest fingerprint>/`` marked by a ``.shardloader-cache`` file.  The cache
is one user's (NOTE [a cache of one's own] in private.py): a root of another user's, or one
others may write to, is refused; folders are ``0700``, files ``0600``, never opened through a
symbolic link.  A shard's file is named by :func:`cache_name`, which no two shard paths share.

How big: one limit for the whole root, over every dataset and run: ``CacheOptions(max_bytes=...)``,
else ``$SHARDLOADER_CACHE_MAX_BYTES`` (``"50GiB"``), else the smaller of 32 GiB and half of
what the root's disk could hold (its free space plus the cache itself), never below twice what
the current plan keeps staged at once.  Staging a shard first evicts the least recently used
staged shards, of any dataset, until the newcomer fits.

The limit and what the root holds, counted without listing it at every turn, live in
cacheroom.py; the removal of copies (NOTE [eviction and clearing]) in cacheentries.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from typing import BinaryIO
from urllib.parse import quote

from shardloader.errors import StorageError
from shardloader.storage.private import open_private, owner_problem

__all__ = [
    "DEFAULT_DISK_FRACTION",
    "DEFAULT_MAX_BYTES",
    "DIR_ENV",
    "LOCK",
    "MARKER",
    "MAX_BYTES_ENV",
    "ROOM_NOTE",
    "STAGED",
    "cache_name",
    "cache_root",
    "is_default_root",
    "root_problem",
    "legacy_root",
    "lock_file",
    "marker_sources",
    "remove_quietly",
    "touch",
    "write_marker",
]

MARKER = ".shardloader-cache"
DIR_ENV = "SHARDLOADER_CACHE_DIR"
MAX_BYTES_ENV = "SHARDLOADER_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 32 << 30
DEFAULT_DISK_FRACTION = 0.5
STAGED = ".raw"
LOCK = ".lock"
TEMP_MARKS = (".tmp-", ".download-")
ROOM_NOTE = ".room"  # at the root: what it holds, as last counted (NOTE [room note])
ROOM_LOCK = ".room.lock"  # at the root: held while a stager makes room (NOTE [reservations])

log = logging.getLogger(__name__)


def cache_root(dir: str | None = None) -> str:
    """The cache root: ``dir``, else ``$SHARDLOADER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/shardloader``, else ``~/.cache/shardloader``."""
    if dir:
        return os.path.abspath(os.path.expanduser(dir))
    env = os.environ.get(DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "shardloader")


def is_default_root(dir: str | None = None) -> bool:
    """Whether :func:`cache_root` (of ``dir``) is the default one, shardloader's own folder."""
    return not dir and not os.environ.get(DIR_ENV)


def cache_name(name: str) -> str:
    """The file name of shard (or sidecar) path ``name`` in its dataset's cache folder.

    Percent-encoding with nothing kept but letters, digits and ``_.-~`` is one-to-one (``/``
    and ``%`` are encoded too), so ``a/b.tar`` and ``a__b.tar`` never share a file; a name too
    long for a file system is its SHA-256 instead, after ``=``, which the encoding never
    starts with.
    """
    encoded = quote(name, safe="", errors="surrogatepass")
    if len(encoded) > 200:
        encoded = "=" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return encoded + STAGED


def root_problem(root: str) -> str | None:
    """Why ``root`` (which exists) is no cache of this user's, or None; a symbolic link at
    the root itself is followed (``~/.cache`` may be one), but must lead to the user's own."""
    try:
        return owner_problem(os.stat(root))
    except FileNotFoundError:
        return None


def legacy_root() -> str:
    """Where shardloader 0.1 staged shards (the system temp dir), unbounded across datasets;
    ``shardloader cache clear`` empties it too, if it is the user's own (the temp dir is
    everyone's: another user may have made it, or a link there)."""
    return os.path.join(tempfile.gettempdir(), "shardloader-cache")


def lock_file(path: str, wait: bool) -> BinaryIO | None:
    """An open lock file at ``path`` holding an exclusive flock, or None when ``wait`` is False
    and another process holds it.  Retries when the file was removed while we waited for it
    (see NOTE [eviction and clearing]).  Never through a symbolic link (a StorageError)."""
    while True:
        f = open_private(path, os.O_RDWR | os.O_CREAT, "r+b")
        try:
            fcntl.flock(f, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f
        f.close()  # closing releases the lock on the removed file


_SOURCE = "source "  # a marker line naming a URL the dataset was read from


def write_marker(marker: str, source: str = "") -> None:
    """Mark a dataset folder (never through a link: NOTE [a cache of one's own]); ``source``
    (the dataset's URL) is added once, for ``cache info``."""
    if not os.path.lexists(marker):
        try:
            f = open_private(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "wb")
        except FileExistsError:  # another process wrote it meanwhile
            pass
        else:
            with f:
                f.write(
                    b"staged shards of one shardloader dataset; `shardloader cache clear` "
                    b"removes them safely\n"
                )
    if source and source not in marker_sources(marker):
        with open_private(marker, os.O_WRONLY | os.O_APPEND, "ab") as f:  # one line, whole
            f.write(f"{_SOURCE}{source}\n".encode())


def marker_sources(marker: str) -> tuple[str, ...]:
    """The dataset URLs a folder's marker names (none for folders of earlier versions)."""
    try:
        with open_private(marker, os.O_RDONLY, "rb") as f:
            lines = f.read().decode("utf-8", "replace").splitlines()
    except (OSError, StorageError):
        return ()
    return tuple(dict.fromkeys(x[len(_SOURCE) :] for x in lines if x.startswith(_SOURCE)))


def touch(path: str) -> None:
    """Mark a staged copy as used now: eviction goes by last use."""
    try:
        os.utime(path, follow_symlinks=False)
    except FileNotFoundError:
        pass


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
