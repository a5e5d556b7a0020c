"""What a node cache root holds (datasets, their staged copies, how much each uses) and how
copies leave it: eviction's removal of one entry and ``shardloader cache clear``.

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

import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from shardloader.errors import StorageError
from shardloader.storage.cachedir import (
    LOCK,
    MARKER,
    ROOM_LOCK,
    ROOM_NOTE,
    STAGED,
    TEMP_MARKS,
    lock_file,
    marker_sources,
    remove_quietly,
    root_problem,
    write_marker,
)

__all__ = [
    "ClearReport",
    "DatasetUsage",
    "Entry",
    "clear",
    "dataset_folders",
    "remove_entry",
    "staged_entries",
    "usage",
]

log = logging.getLogger(__name__)


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
    shards: int  # staged shards (sample indexes and lengths are counted apart, in other)
    bytes: int
    last_used: float | None
    other: int = 0  # staged sample indexes (sidecars) and the lengths file
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
    try:
        for path in [*entry.files, entry.base]:
            try:
                size = os.stat(path, follow_symlinks=False).st_size
                os.remove(path)
                freed += size
            except FileNotFoundError:
                pass
        os.remove(lock_path)  # still ours: nobody else can hold it now (NOTE above)
    except FileNotFoundError:
        pass
    finally:
        lock.close()
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
