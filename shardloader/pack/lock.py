"""One writer at a time: the exclusive lock ``pack``, ``index`` and ``merge`` hold on OUT.

NOTE [the OUT lock]: two runs writing one OUT at once delete each other's temporary files and
mix their shards under one manifest, so every run that writes OUT holds this lock from before
it lists OUT until after its last write; a second run stops at once with
:class:`~shardloader.errors.OutputLockedError` (exit 2) naming the holder.

- **Local OUT**: ``fcntl.flock`` on ``OUT/.shardloader-lock``.  The kernel drops the lock when
  the holding process dies, however it dies, so a crashed run never leaves a stale lock.  The
  file records the holder (host, pid, start time, run id) for the loser's message and is
  removed on release (a taker checks it locked the file still at that path).
- **Object stores** (``s3://``): the object ``OUT/.shardloader-lock`` is created with a
  conditional PUT (``If-None-Match: *``: exactly one of several creators succeeds), holding the
  same record and a lease expiry.  A thread renews the lease (``If-Match`` on the ETag it
  wrote) every third of the lease; a run killed outright stops renewing, and once its lease
  has expired the next run (``--resume`` included) takes the lock over with a conditional PUT
  on the ETag it read, so of two successors only one wins.  A holder on this host whose
  process is gone is taken over at once.  A run whose renewal finds the lock taken stops
  before it writes its manifest (:meth:`OutLock.check`).
- **Other protocols** (``gs://``, ``memory://``, ...): no lock (fsspec has no conditional
  create for them); a warning says so.

The lease is :data:`DEFAULT_LEASE` seconds, else ``$SHARDLOADER_LOCK_LEASE``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from shardloader.errors import OutputLockedError, StorageError, UsageError
from shardloader.storage.store import Store

__all__ = ["DEFAULT_LEASE", "LEASE_ENV", "LOCK_NAME", "Holder", "OutLock", "alive", "out_lock"]

log = logging.getLogger(__name__)

LOCK_NAME = ".shardloader-lock"
DEFAULT_LEASE = 60.0
LEASE_ENV = "SHARDLOADER_LOCK_LEASE"


@dataclass(frozen=True)
class Holder:
    """Who holds the lock: the record the lock file or object carries."""

    command: str
    host: str
    pid: int
    started: float  # wall clock, seconds since the epoch
    run_id: str
    expires: float | None = None  # object stores only: the lease's end (wall clock)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.started))
        lease = ""
        if self.expires is not None:
            left = self.expires - time.time()
            lease = (
                f", lease expires in {left:.0f} s"
                if left > 0
                else f", lease expired {-left:.0f} s ago"
            )
        return (
            f"`{self.command}` on host {self.host}, pid {self.pid}, started {when} "
            f"(run {self.run_id}{lease})"
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        try:
            d = json.loads(data)
            return cls(
                str(d["command"]),
                str(d["host"]),
                int(d["pid"]),
                float(d["started"]),
                str(d["run_id"]),
                None if d.get("expires") is None else float(d["expires"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def lease_seconds(lease: float | None = None) -> float:
    """The lease: ``lease``, else ``$SHARDLOADER_LOCK_LEASE``, else :data:`DEFAULT_LEASE`."""
    if lease is None:
        raw = os.environ.get(LEASE_ENV)
        try:
            lease = float(raw) if raw else DEFAULT_LEASE
        except ValueError as err:
            raise UsageError(f"${LEASE_ENV}={raw!r}: give the lease in seconds") from err
    if not lease > 0:
        raise UsageError(f"lock lease {lease!r} must be > 0 seconds")
    return lease


def refused(out: Store, holder: Holder | None) -> OutputLockedError:
    who = holder.describe() if holder is not None else "another run (not yet recorded)"
    return OutputLockedError(
        f"output {out.url!r} is locked by {who}; two runs must not write one OUT at once: wait "
        "for it to finish, or pick another OUT"
    )


class OutLock:
    """The lock a run holds; ``run_id`` names the run (multipart uploads record it)."""

    def __init__(self, out: Store, holder: Holder) -> None:
        self.out = out
        self.holder = holder
        self.run_id = holder.run_id
        self._lost: str | None = None

    def check(self) -> None:
        """Raise if the lock was lost (an object store's lease taken over): call before the
        manifest is written."""
        if self._lost is not None:
            raise OutputLockedError(
                f"output {self.out.url!r}: this run lost its lock ({self._lost}); its manifest "
                "is not written. Make sure one run at a time writes OUT, then re-run with --resume"
            )


def alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed but not yet reaped,
    does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:  # no procfs (macOS): the kill() probe has to do
        return True


@contextmanager
def out_lock(out: Store, command: str, *, lease: float | None = None) -> Iterator[OutLock]:
    """Hold the exclusive lock on ``out`` for the ``with`` block (NOTE [the OUT lock])."""
    holder = Holder(command, socket.gethostname(), os.getpid(), time.time(), uuid.uuid4().hex)
    if out.is_local:
        with _local_lock(out, holder) as lock:
            yield lock
    elif out.protocol in ("s3", "s3a"):
        from shardloader.pack.remotelock import remote_lock

        with remote_lock(out, holder, lease_seconds(lease)) as lock:
            yield lock
    else:  # no conditional create through fsspec's generic interface
        log.warning(
            "%s: OUT is not locked on %s:// (local folders and s3:// are); make sure one run "
            "at a time writes it",
            out.url,
            out.protocol,
        )
        yield OutLock(out, holder)


# -- local: flock -----------------------------------------------------------------------------


@contextmanager
def _local_lock(out: Store, holder: Holder) -> Iterator[OutLock]:
    folder = out.local_path
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"output {out.url!r} exists and is not a folder")
    created = not os.path.exists(folder)
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as err:
        raise StorageError(f"cannot create OUT {out.url!r} ({err}); pick a writable OUT") from err
    path = os.path.join(folder, LOCK_NAME)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as err:
            raise StorageError(f"cannot open the lock file {path!r} of OUT ({err})") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            data = os.pread(fd, 4096, 0)
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise refused(out, Holder.from_json(data)) from None
            raise StorageError(
                f"cannot lock {path!r} ({err}): the file system of OUT does not take flock "
                "locks; pack into a local folder, or one on a file system that does"
            ) from err
        # The previous holder removes the file on release: lock the file at the path now.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.to_json(), 0)
        yield OutLock(out, holder)
    finally:
        try:
            os.remove(path)  # while locked: a taker that opened it finds it gone and retries
        except FileNotFoundError:
            pass
        os.close(fd)
        if created:  # a run that wrote nothing leaves no empty OUT behind
            try:
                os.rmdir(folder)
            except OSError:
                pass
