"""A node-local cache of *staged* shards: uncompressed, random-access copies.

Where: ``CacheOptions(dir=...)``, else ``$SHARDLOADER_CACHE_DIR``, else
``$XDG_CACHE_HOME/shardloader`` (``~/.cache/shardloader`` when unset).  Each dataset gets a
folder ``<root>/<manifest fingerprint>/`` marked by a ``.shardloader-cache`` file.

How big: one limit for the whole root, over every dataset and run: ``CacheOptions(max_bytes=...)``,
else ``$SHARDLOADER_CACHE_MAX_BYTES`` (``"50GiB"``), else the smaller of 32 GiB and half of
what the root's disk could hold (its free space plus the cache itself), never below twice what
the current plan keeps staged at once.  Staging a shard first evicts the least recently used
staged shards, of any dataset, until the newcomer fits.

NOTE [sharing the cache between processes]: every DataLoader worker of every local rank (and
every other run on the node) may need the same shard at once.  Each staged copy ``X.raw`` has a
lock file ``X.raw.lock``; a process takes an exclusive ``fcntl.flock`` on it, checks whether
the copy exists, and if not stages it to a temp name (``X.raw.tmp-*``, ``X.raw.download-*``) and
renames it.  Others block on the lock and then find the copy, so a shard is fetched and
decompressed once per node.  ``flock`` locks die with their process, so a killed run leaves
nothing that blocks the next one; its temp files are stale and go with the next eviction or
``shardloader cache clear``.

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

import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from shardloader.errors import ChecksumError, StorageError, UsageError
from shardloader.units import parse_size

__all__ = [
    "CacheOptions",
    "ClearReport",
    "DatasetUsage",
    "ShardCache",
    "cache_limit",
    "cache_root",
    "clear",
    "legacy_root",
    "usage",
]

log = logging.getLogger(__name__)

MARKER = ".shardloader-cache"
DIR_ENV = "SHARDLOADER_CACHE_DIR"
MAX_BYTES_ENV = "SHARDLOADER_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 32 << 30
DEFAULT_DISK_FRACTION = 0.5
_STAGED = ".raw"
_LOCK = ".lock"
_TEMP_MARKS = (".tmp-", ".download-")


@dataclass(frozen=True)
class CacheOptions:
    """``dir``: the cache root (default :func:`cache_root`).  ``max_bytes``: the limit on all
    staged shards under the root, every dataset together (default :func:`cache_limit`)."""

    dir: str | None = None
    max_bytes: int | None = None


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


def legacy_root() -> str:
    """Where shardloader 0.1 staged shards (the system temp dir), unbounded across datasets;
    ``shardloader cache clear`` empties it too."""
    return os.path.join(tempfile.gettempdir(), "shardloader-cache")


def cache_limit(root: str, explicit: int | None = None) -> tuple[int, str]:
    """(limit in bytes, where it comes from) for the cache at ``root``."""
    if explicit is not None:
        return explicit, "CacheOptions(max_bytes=...)"
    env = os.environ.get(MAX_BYTES_ENV)
    if env:
        try:
            return parse_size(env), f"${MAX_BYTES_ENV}"
        except UsageError as err:
            raise UsageError(f"${MAX_BYTES_ENV}={env!r}: {err}") from err
    disk = _existing_parent(root)
    try:
        free = shutil.disk_usage(disk).free
    except OSError:
        return DEFAULT_MAX_BYTES, "default"
    held = sum(d.bytes for d in usage(root))
    by_disk = int(DEFAULT_DISK_FRACTION * (free + held))
    if by_disk < DEFAULT_MAX_BYTES:
        return by_disk, f"default: half of the {_gb(free + held)} its disk could hold"
    return DEFAULT_MAX_BYTES, f"default: {DEFAULT_MAX_BYTES >> 30} GiB"


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _existing_parent(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


@dataclass(frozen=True)
class _Entry:
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
    shards: int
    bytes: int
    last_used: float | None


@dataclass(frozen=True)
class ClearReport:
    """What ``clear`` removed, and what it left because another process was staging it."""

    files: int
    bytes: int
    busy: tuple[str, ...]
    folders: int


def _dataset_folders(root: str) -> Iterator[tuple[str, str]]:
    """(fingerprint, folder) of each dataset folder under ``root`` (those with the marker)."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        folder = os.path.join(root, name)
        if os.path.isfile(os.path.join(folder, MARKER)):
            yield name, folder


def _entries(folder: str) -> list[_Entry]:
    """Staged shards in ``folder``, grouped with their temp files; lock files are not listed."""
    groups: dict[str, list[tuple[str, os.stat_result]]] = {}
    try:
        scan = list(os.scandir(folder))
    except FileNotFoundError:
        return []
    for item in scan:
        name = item.name
        if name.endswith(_STAGED):
            base = name
        else:
            cut = min((name.find(_STAGED + m) for m in _TEMP_MARKS if _STAGED + m in name),
                      default=-1)
            if cut < 0:
                continue  # the marker, lock files, anything not ours
            base = name[: cut + len(_STAGED)]
        try:
            st = item.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        groups.setdefault(base, []).append((item.path, st))
    return [
        _Entry(os.path.join(folder, base), tuple(p for p, _ in files),
               sum(st.st_size for _, st in files), max(st.st_mtime for _, st in files))
        for base, files in groups.items()
    ]


def usage(root: str) -> list[DatasetUsage]:
    """Per dataset folder under ``root``: staged shards, bytes (temp files included), last use."""
    out = []
    for fingerprint, folder in _dataset_folders(root):
        entries = _entries(folder)
        out.append(DatasetUsage(
            fingerprint, folder, sum(e.base in e.files for e in entries),
            sum(e.bytes for e in entries),
            max((e.last_used for e in entries), default=None),
        ))
    return out


def _lock(path: str, wait: bool) -> BinaryIO | None:
    """An open lock file at ``path`` holding an exclusive flock, or None when ``wait`` is False
    and another process holds it.  Retries when the file was removed while we waited for it
    (see NOTE [eviction and clearing])."""
    while True:
        f = open(path, "a+b")
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


def _remove_entry(entry: _Entry) -> int | None:
    """Remove a staged shard and its temp files if nobody holds its lock: bytes freed, or None
    when it is busy (being staged) right now."""
    lock_path = entry.base + _LOCK
    try:
        lock = _lock(lock_path, wait=False)
    except FileNotFoundError:  # its folder went away
        return 0
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
    open copies stay readable, and a run that needs a cleared shard stages it again."""
    files = freed = folders = 0
    busy: list[str] = []
    for name, folder in _dataset_folders(root):
        if fingerprint is not None and name != fingerprint:
            continue
        for entry in _entries(folder):
            got = _remove_entry(entry)
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
            if stale.endswith(_STAGED + _LOCK):
                entry = _Entry(os.path.join(folder, stale[: -len(_LOCK)]), (), 0, 0.0)
                if _remove_entry(entry) is None:
                    busy.append(entry.base)
        folders += _remove_folder_if_empty(folder)
    return ClearReport(files, freed, tuple(busy), folders)


def _remove_folder_if_empty(folder: str) -> int:
    marker = os.path.join(folder, MARKER)
    try:
        os.remove(marker)
        os.rmdir(folder)
        return 1
    except FileNotFoundError:
        return 0
    except OSError:  # a process started staging here meanwhile: keep the folder marked
        _write_marker(marker)
        return 0


def _write_marker(marker: str) -> None:
    if not os.path.exists(marker):
        with open(marker, "w") as f:
            f.write("staged shards of one shardloader dataset; `shardloader cache clear` "
                    "removes them safely\n")


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
    """Stages shards into ``<root>/<dataset fingerprint>/`` once per node, within one limit
    for the whole root."""

    def __init__(self, options: CacheOptions, fingerprint: str) -> None:
        self.root = cache_root(options.dir)
        self.folder = os.path.join(self.root, fingerprint)
        self._explicit = options.max_bytes is not None or bool(os.environ.get(MAX_BYTES_ENV))
        self.max_bytes: int | None
        self.max_bytes, self.limit_source = cache_limit(self.root, options.max_bytes)
        self._ensure_folder()

    def _ensure_folder(self) -> None:
        try:
            os.makedirs(self.folder, exist_ok=True)
            _write_marker(os.path.join(self.folder, MARKER))
        except OSError as err:
            raise StorageError(
                f"cannot use the shard cache at {self.root} ({err.strerror or err}); point "
                f"${DIR_ENV} or CacheOptions(dir=...) at a writable local folder"
            ) from err

    def path_for(self, name: str) -> str:
        return os.path.join(self.folder, name.replace("/", "__") + _STAGED)

    def require(self, needed: int) -> None:
        """Fail at start, not with a throughput cliff, when an explicit limit cannot hold what
        the plan keeps staged at once; a default limit grows to twice that instead."""
        if self.max_bytes is None or needed <= 0:
            return
        if self._explicit:
            if needed > self.max_bytes:
                raise UsageError(
                    f"cache limit {self.max_bytes:,} bytes is below the {needed:,} bytes of "
                    f"staged shards this plan keeps in use at once; raise {self.limit_source} "
                    "or lower the shuffle block / read-ahead"
                )
        elif 2 * needed > self.max_bytes:
            log.info("shard cache %s: the plan keeps %d bytes staged at once; the limit grows "
                     "from %d (%s) to twice that", self.root, needed, self.max_bytes,
                     self.limit_source)
            self.max_bytes = 2 * needed

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
        self._ensure_folder()  # `cache clear` may have removed it since
        try:
            lock = _lock(final + _LOCK, wait)
        except FileNotFoundError:  # cleared between the two lines above
            self._ensure_folder()
            lock = _lock(final + _LOCK, wait)
        if lock is None:
            return None
        with lock:
            if os.path.exists(final):
                _touch(final)
                return final
            self._make_room(raw_bytes, final)
            for attempt in (1, 2):
                digest = self._stage_once(final, sha256, open_stored, stage, verified)
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

    def _make_room(self, incoming: int, staging: str) -> None:
        """Evict least recently used staged shards of any dataset under the root until
        ``incoming`` more bytes fit the limit (NOTE [eviction and clearing])."""
        entries = []
        for _, folder in _dataset_folders(self.root):
            for entry in _entries(folder):
                if entry.base != staging:
                    entries.append(entry)
                else:  # temp files a killed stager left: we hold this shard's lock now
                    for path in entry.files:
                        _remove_quietly(path)
        if self.max_bytes is None:
            return
        used = sum(e.bytes for e in entries)
        if used + incoming <= self.max_bytes:
            return
        for entry in sorted(entries, key=lambda e: e.last_used):
            freed = _remove_entry(entry)
            if freed is None:
                continue  # being staged by another process right now
            used -= entry.bytes
            log.debug("evicted %s (%d bytes)", entry.base, freed)
            if used + incoming <= self.max_bytes:
                return


def _touch(path: str) -> None:
    """Mark a staged copy as used now: eviction goes by last use."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
