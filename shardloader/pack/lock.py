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
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import msgspec

from shardloader.errors import OutputLockedError, StorageError, UsageError
from shardloader.storage.protocols import chain, status_and_code
from shardloader.storage.s3client import S3Client
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
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes) -> Holder | None:
        """The record, its fields' types checked; None when it is not one."""
        try:
            return msgspec.json.decode(data, type=cls)
        except msgspec.MsgspecError:
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
        with _remote_lock(out, holder, lease_seconds(lease)) as lock:
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
        with suppress(FileNotFoundError):  # while locked: a taker finds it gone and retries
            os.remove(path)
        os.close(fd)
        if created:  # a run that wrote nothing leaves no empty OUT behind
            with suppress(OSError):
                os.rmdir(folder)


# -- object stores: a conditional PUT with a lease, renewed by a thread ------------------------


_CONFLICT = {"PreconditionFailed", "412", "ConditionalRequestConflict", "409"}


class _Remote:
    """The lock object's requests, each under the store's retry policy: through the store's
    fast S3 client (botocore) when it has one, so a run that writes S3 never imports s3fs
    for its lock, else through s3fs."""

    def __init__(self, out: Store) -> None:
        self.store = out.join(LOCK_NAME)
        client = self.store.client()
        self.client = client if isinstance(client, S3Client) else None
        if self.client is None:
            self.fs, path = self.store.filesystem()
            self.bucket, self.key, _ = self.fs.split_path(path)

    async def _get(self) -> dict[str, Any]:
        found = await self.fs._call_s3("get_object", Bucket=self.bucket, Key=self.key)
        body = found["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        return {"data": data, "ETag": found["ETag"]}

    def _call(self, name: str, **kwargs: Any) -> Any:
        """One S3 call; a failed precondition comes back as None instead of an error, a
        missing object as {}."""
        try:
            if self.client is None and name == "get_object":
                from fsspec.asyn import sync

                return sync(self.fs.loop, self._get)
            if self.client is None:
                return self.fs.call_s3(name, Bucket=self.bucket, Key=self.key, **kwargs)
            found = self.client.call(name, self.store.url, **kwargs)
        except Exception as err:  # botocore's errors carry the S3 code, s3fs's their causes
            codes = {str(c) for seen in chain(err) for c in status_and_code(seen) if c}
            if codes & _CONFLICT:
                return None
            missing = isinstance(err, FileNotFoundError) or codes & {"NoSuchKey", "404"}
            if name in ("get_object", "delete_object") and missing:
                return {}
            raise
        if name == "get_object":
            body = found["Body"]
            try:
                return {"data": body.read(), "ETag": found["ETag"]}
            finally:
                body.close()
        return found

    def call(self, name: str, what: str, **kwargs: Any) -> Any:
        return self.store.call(partial(self._call, name, **kwargs), what)

    def put(self, body: bytes, etag: str | None = None) -> str | None:
        """ETag of the lock object written: created (``etag`` None), or replacing the one
        whose ETag is ``etag``; None when that condition fails."""
        cond = {"IfNoneMatch": "*"} if etag is None else {"IfMatch": etag}
        found = self.call("put_object", "lock", Body=body, **cond)
        return None if found is None else str(found["ETag"])

    def read(self) -> tuple[Holder | None, str] | None:
        """(holder, ETag) of the lock object; None when there is none."""
        found = self.call("get_object", "read the lock")
        if not found:
            return None
        return Holder.from_json(found["data"]), str(found["ETag"])

    def delete(self, etag: str) -> None:
        self.call("delete_object", "unlock", IfMatch=etag)


def _acquire(remote: _Remote, out: Store, holder: Holder, lease: float) -> tuple[Holder, str]:
    for _ in range(5):  # each round ends in a decision unless the object changes under us
        mine = replace(holder, expires=time.time() + lease)
        etag = remote.put(mine.to_json())
        if etag is not None:
            return mine, etag
        found = remote.read()
        if found is None:
            continue  # released meanwhile: try to create it again
        other, other_etag = found
        if other is not None and other.run_id == holder.run_id:
            return other, other_etag  # our own PUT, whose answer was lost and retried
        expired = other is None or other.expires is None or other.expires < time.time()
        gone = other is not None and other.host == socket.gethostname() and not alive(other.pid)
        if not (expired or gone):
            raise refused(out, other)
        etag = remote.put(mine.to_json(), other_etag)
        if etag is not None:
            log.warning(
                "%s: took over the lock of %s",
                out.url,
                other.describe() if other else "an unreadable holder",
            )
            return mine, etag
    raise refused(out, (remote.read() or (None, ""))[0])


class _Renewer(threading.Thread):
    """Renews the lease every third of it until stopped or the lock is lost."""

    def __init__(self, remote: _Remote, lock: OutLock, etag: str, lease: float) -> None:
        super().__init__(name="shardloader-out-lock", daemon=True)
        self.remote, self.lock, self.etag, self.lease = remote, lock, etag, lease
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.lease / 3):
            mine = replace(self.lock.holder, expires=time.time() + self.lease)
            try:
                etag = self.remote.put(mine.to_json(), self.etag)
            except (StorageError, OSError) as err:  # the next round may get through
                log.warning("%s: could not renew the lock (%s)", self.lock.out.url, err)
                continue
            if etag is None:
                found = self.remote.read()
                other = found[0] if found else None
                self.lock._lost = (
                    f"taken over by {other.describe()}" if other else "its lock object was removed"
                )
                return
            self.etag = etag


@contextmanager
def _remote_lock(out: Store, holder: Holder, lease: float) -> Iterator[OutLock]:
    remote = _Remote(out)
    mine, etag = _acquire(remote, out, holder, lease)
    lock = OutLock(out, mine)
    renewer = _Renewer(remote, lock, etag, lease)
    renewer.start()
    try:
        yield lock
    finally:
        renewer.stopped.set()
        renewer.join()
        # Listings of OUT this process made through s3fs while it held the lock predate the
        # run's uploads (which go through the fast client): s3fs must not answer from them.
        if "s3fs" in sys.modules:
            fs, path = out.filesystem()
            fs.invalidate_cache(path.rstrip("/"))
        if lock._lost is None:
            try:
                remote.delete(renewer.etag)
            except (StorageError, OSError) as err:
                log.warning(
                    "%s: could not remove the lock object (%s); its lease ends in %.0f s",
                    out.url,
                    err,
                    lease,
                )
