"""How big the node cache may grow, and what it holds, without listing it at every turn.

The limit (``cachedir.py`` says where it comes from) is one figure for the whole root; what
the root holds is the sum over every staged file of every dataset, which takes a ``stat`` per
file: about 0.3 s for a root of 10,000 small shards (40,000 files with their locks and sample
indexes).  Paid at every open, that was most of the time to a warm first batch; paid at every
shard staged, an epoch over many small shards cost time quadratic in their number.  So:

- the default limit does not count the root when half of the free space alone reaches
  :data:`DEFAULT_MAX_BYTES` (the count could only raise the figure, which is then capped), and
  a cache works it out only when it stages something (:class:`~shardloader.storage.cache.
  ShardCache`), never to read what is staged already;
- NOTE [room note]: stagers keep a running count in ``<root>/.room`` (bytes the root held at
  the last full count, plus every reservation since, and when that count was made), read and
  written only under the root's lock (NOTE [reservations] in cache.py).  A reservation that
  fits the noted figure is made without listing the root; one that does not, or a note older
  than :data:`RECOUNT_SECONDS`, counts the root again and evicts as before.  Whatever shrinks
  the cache without noting it (eviction, ``cache clear``, a staged copy shorter than its
  reservation) leaves the note too high, which only brings the next count forward; what grows
  it unnoted (sample indexes staged next to their shards, other versions of shardloader)
  is caught by the next count, at most :data:`RECOUNT_SECONDS` later.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid

from shardloader.errors import StorageError, UsageError
from shardloader.storage.cachedir import (
    DEFAULT_DISK_FRACTION,
    DEFAULT_MAX_BYTES,
    MAX_BYTES_ENV,
    ROOM_NOTE,
)
from shardloader.storage.cacheentries import usage
from shardloader.storage.private import create_private, open_private
from shardloader.units import parse_size

__all__ = ["RECOUNT_SECONDS", "cache_limit", "note_room", "noted_room"]

RECOUNT_SECONDS = 10.0


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
    capped = (DEFAULT_MAX_BYTES, f"default: {DEFAULT_MAX_BYTES >> 30} GiB")
    if DEFAULT_DISK_FRACTION * free >= DEFAULT_MAX_BYTES:
        return capped  # what the cache holds could only add to the figure: no need to count
    held = sum(d.bytes for d in usage(root))
    by_disk = int(DEFAULT_DISK_FRACTION * (free + held))
    if by_disk < DEFAULT_MAX_BYTES:
        return by_disk, f"default: half of the {_gb(free + held)} its disk could hold"
    return capped


def noted_room(root: str) -> int | None:
    """The bytes the root holds by its room note, or None: no note, an unreadable one, or one
    whose last full count is older than :data:`RECOUNT_SECONDS` (NOTE [room note])."""
    try:
        with open_private(os.path.join(root, ROOM_NOTE), os.O_RDONLY, "rb") as f:
            used, counted = f.read(100).split()
        age = time.time() - float(counted)
        return int(used) if 0 <= age < RECOUNT_SECONDS else None
    except (OSError, StorageError, ValueError):
        return None


def note_room(root: str, used: int, counted: float | None = None) -> None:
    """Note that the root holds ``used`` bytes, counted in full at ``counted`` (epoch seconds;
    None: the time of the note it replaces).  Under the root's lock only."""
    path = os.path.join(root, ROOM_NOTE)
    if counted is None:
        try:
            with open_private(path, os.O_RDONLY, "rb") as f:
                counted = float(f.read(100).split()[1])
        except (OSError, StorageError, ValueError, IndexError):
            counted = 0.0  # the next reservation counts again
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    try:
        with create_private(tmp) as f:
            f.write(f"{used} {counted!r}\n".encode())
        os.replace(tmp, path)
    except OSError:  # a note is only a shortcut: without it the next stager counts
        try:
            os.remove(tmp)
        except OSError:
            pass


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


def _existing_parent(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path
