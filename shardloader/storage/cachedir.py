"""The node-local shard cache's root: where it lives, how its files are named, marked and
locked, what it holds, how big it may grow, and how copies leave it (eviction, ``shardloader
cache clear``); staging is cache.py.

Where: :func:`cache_root`.  Each dataset gets a folder ``<root>/<manifest fingerprint>/``
marked by a ``.shardloader-cache`` file.  The cache is one user's (NOTE [a cache of one's own]
in private.py).  A shard's file is named by :func:`cache_name`, which no two shard paths share.
How big: one limit for the whole root, over every dataset and run (:func:`cache_limit`), never
below twice what the current plan keeps staged at once; staging a shard first evicts the least
recently used staged shards, of any dataset, until the newcomer fits.  Counting what the root
holds takes a ``stat`` per file (about 0.3 s for 10,000 small shards), so it is done rarely
(NOTE [room note] in cache.py).

NOTE [eviction and clearing]: whoever removes ``X.raw`` (eviction by any process, ``cache
clear``) first takes ``X.raw.lock`` *without waiting*; a shard whose lock is held (being staged
right now) is skipped, never deleted under the stager.  Under the lock it removes ``X.raw``,
its stale temp files and then the lock file itself; so a process that locks a lock file must
check that the path still names the file it locked (same inode), and retry if not.  Only
``*.raw`` copies, their temp files and lock files inside marked folders are ever removed:
nothing the cache did not create.  A copy removed while another process reads it stays readable
through that process's open file (POSIX unlink semantics); its space returns when it closes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import quote

from shardloader.errors import StorageError, UsageError
from shardloader.storage.private import create_private, open_private, owner_problem
from shardloader.units import parse_size

__all__ = [
    "ClearReport",
    "DatasetUsage",
    "cache_limit",
    "cache_name",
    "cache_root",
    "clear",
    "legacy_root",
    "lock_file",
    "root_problem",
    "usage",
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
DIR_SOURCE = "dir"  # a root given by the caller (CacheOptions(dir=...), --cache-dir)
DEFAULT_SOURCES = ("$XDG_CACHE_HOME/shardloader", "default")  # shardloader's own folder

log = logging.getLogger(__name__)


def cache_root(dir: str | None = None) -> tuple[str, str]:
    """(the cache root, where it comes from): ``dir``, else ``$SHARDLOADER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/shardloader``, else ``~/.cache/shardloader`` (the last two are
    shardloader's own folder: :data:`DEFAULT_SOURCES`)."""
    if dir:
        return os.path.abspath(os.path.expanduser(dir)), DIR_SOURCE
    env = os.environ.get(DIR_ENV)
    if env:
        return os.path.abspath(os.path.expanduser(env)), f"${DIR_ENV}"
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "shardloader"), DEFAULT_SOURCES[0]
    return os.path.join(os.path.expanduser("~"), ".cache", "shardloader"), DEFAULT_SOURCES[1]


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
        # FileExistsError: another process made it meanwhile
        with contextlib.suppress(FileExistsError), create_private(marker) as f:
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


def touch(path: str) -> bool:
    """Mark a staged copy as used now (eviction goes by last use); False: there is none."""
    try:
        os.utime(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return os.path.exists(path)  # a dangling link is no copy


def remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


@dataclass(frozen=True)
class Entry:
    """One staged shard and its leftovers: ``X.raw`` and any stale temp files."""

    base: str  # path of X.raw (which may not exist: only temp files left)
    files: tuple[str, ...]
    bytes: int
    last_used: float


@dataclass(frozen=True)
class DatasetUsage:
    """What one dataset's folder holds: staged shards, bytes, last use (epoch seconds)."""

    fingerprint: str
    folder: str
    shards: int  # staged shards (sample indexes and lengths are counted apart, in other_files)
    bytes: int
    last_used: float | None
    other_files: int = 0  # staged sample indexes (sidecars) and the lengths file
    sources: tuple[str, ...] = ()  # the dataset URLs read through this folder


@dataclass(frozen=True)
class ClearReport:
    """What ``clear`` removed, and what it left because another process was staging it."""

    files: int
    bytes: int
    busy: tuple[str, ...]
    folders: int


def dataset_folders(root: str) -> Iterator[tuple[str, str]]:
    """(fingerprint, folder) of each dataset folder under ``root`` (those with the marker)."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        folder = os.path.join(root, name)
        try:  # not through links: a cache folder is a real folder holding a real marker
            if stat.S_ISDIR(os.lstat(folder).st_mode) and stat.S_ISREG(
                os.lstat(os.path.join(folder, MARKER)).st_mode
            ):
                yield name, folder
        except OSError:
            continue


def staged_entries(folder: str) -> list[Entry]:
    """Staged shards in ``folder``, grouped with their temp files; lock files are not listed."""
    groups: dict[str, list[tuple[str, os.stat_result]]] = {}
    try:
        scan = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for item in scan:
        name = item.name
        if name.endswith(STAGED):
            base = name
        else:  # a temp file's suffix comes last, whatever the shard's own name holds
            cut = max(name.rfind(STAGED + m) for m in TEMP_MARKS)
            if cut < 0:
                continue  # the marker, lock files, anything not ours
            base = name[: cut + len(STAGED)]
        try:
            st = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        groups.setdefault(base, []).append((item.path, st))
    return [
        Entry(
            os.path.join(folder, base),
            tuple(p for p, _ in files),
            sum(st.st_size for _, st in files),
            max(st.st_mtime for _, st in files),
        )
        for base, files in groups.items()
    ]


def usage(root: str) -> list[DatasetUsage]:
    """Per dataset folder under ``root``: staged shards, bytes (temp files included), last use."""
    out = []
    for fingerprint, folder in dataset_folders(root):
        entries = staged_entries(folder)
        staged = [e for e in entries if e.base in e.files]
        other = sum(_not_a_shard(e.base) for e in staged)
        out.append(
            DatasetUsage(
                fingerprint,
                folder,
                len(staged) - other,
                sum(e.bytes for e in entries),
                max((e.last_used for e in entries), default=None),
                other,
                marker_sources(os.path.join(folder, MARKER)),
            )
        )
    return out


def _not_a_shard(path: str) -> bool:
    """A staged sample index (``*.idx.arrow``, carried or fetched) or the lengths file."""
    name = os.path.basename(path)[: -len(STAGED)]
    return ".idx.arrow" in name or name == "lengths.npy"


def remove_entry(entry: Entry) -> int | None:
    """Remove a staged shard and its temp files if nobody holds its lock: bytes freed, or None
    when it is busy (being staged) right now."""
    lock_path = entry.base + LOCK
    try:
        lock = lock_file(lock_path, wait=False)
    except FileNotFoundError:  # its folder went away
        return 0
    except StorageError as err:  # a link or a FIFO where its lock goes: not ours to touch
        log.warning("%s: left in place (%s)", entry.base, err)
        return None
    if lock is None:
        return None
    freed = 0
    with lock:
        for path in [*entry.files, entry.base]:
            with contextlib.suppress(FileNotFoundError):
                size = os.stat(path, follow_symlinks=False).st_size
                os.remove(path)
                freed += size
        remove_quietly(lock_path)  # still ours: nobody else can hold it now (NOTE above)
    return freed


def clear(root: str, fingerprint: str | None = None) -> ClearReport:
    """Remove the staged shards under ``root`` (of one dataset, or all), skipping any being
    staged right now; empty dataset folders go too.  Safe while training runs use the cache:
    open copies stay readable, and a run that needs a cleared shard stages it again.  A root
    that is not the user's own is refused (:func:`root_problem`)."""
    problem = root_problem(root)
    if problem is not None:
        raise StorageError(
            f"refusing to clear the shard cache at {root}: it {problem}; clear it as its owner"
        )
    files = freed = folders = 0
    busy: list[str] = []
    for name, folder in dataset_folders(root):
        if fingerprint is not None and name != fingerprint:
            continue
        for entry in staged_entries(folder):
            got = remove_entry(entry)
            if got is None:
                busy.append(entry.base)
            else:
                files += 1
                freed += got
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for stale in names:  # lock files of shards that were never staged
            if stale.endswith(STAGED + LOCK):
                entry = Entry(os.path.join(folder, stale[: -len(LOCK)]), (), 0, 0.0)
                if remove_entry(entry) is None:
                    busy.append(entry.base)
        folders += _remove_folder_if_empty(folder)
    if fingerprint is None:
        _remove_room_lock(os.path.join(root, ROOM_LOCK))
    return ClearReport(files, freed, tuple(busy), folders)


def _remove_room_lock(path: str) -> None:
    """Remove the root's lock file and room note unless a stager holds the lock (a waiter
    retries on the new one)."""
    if not os.path.exists(path):
        return
    lock = lock_file(path, False)
    if lock is not None:
        with lock:
            remove_quietly(os.path.join(os.path.dirname(path), ROOM_NOTE))
            remove_quietly(path)


def _remove_folder_if_empty(folder: str) -> int:
    marker = os.path.join(folder, MARKER)
    try:
        os.remove(marker)
        os.rmdir(folder)
        return 1
    except FileNotFoundError:
        return 0
    except OSError:  # a process started staging here meanwhile: keep the folder marked
        write_marker(marker)
        return 0


def cache_limit(root: str, explicit: int | None = None) -> tuple[int, str]:
    """(limit in bytes, where it comes from) for the cache at ``root``:
    ``CacheOptions(max_bytes=...)``, else ``$SHARDLOADER_CACHE_MAX_BYTES`` (``"50GiB"``), else
    the smaller of 32 GiB and half of what the root's disk could hold (its free space plus the
    cache itself).  The root is not counted when half of the free space alone reaches
    :data:`DEFAULT_MAX_BYTES` (the count could only raise the figure, which is then capped)."""
    if explicit is not None:
        return explicit, "CacheOptions(max_bytes=...)"
    env = os.environ.get(MAX_BYTES_ENV)
    if env:
        try:
            return parse_size(env), f"${MAX_BYTES_ENV}"
        except UsageError as err:
            raise UsageError(f"${MAX_BYTES_ENV}={env!r}: {err}") from err
    # the root's disk: the nearest folder that exists (the root may not yet)
    disk = next((p for p in (Path(root), *Path(root).parents) if p.exists()), root)
    try:
        free = shutil.disk_usage(disk).free
    except OSError:
        return DEFAULT_MAX_BYTES, "default"
    capped = (DEFAULT_MAX_BYTES, f"default: {DEFAULT_MAX_BYTES >> 30} GiB")
    if DEFAULT_DISK_FRACTION * free >= DEFAULT_MAX_BYTES:
        return capped  # what the cache holds could only add to the figure: no need to count
    held = sum(d.bytes for d in usage(root))
    by_disk = int(DEFAULT_DISK_FRACTION * (free + held))
    if by_disk < DEFAULT_MAX_BYTES:
        return by_disk, f"default: half of the {(free + held) / 1e9:.1f} GB its disk could hold"
    return capped
