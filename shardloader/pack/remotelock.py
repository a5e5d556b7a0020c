"""The OUT lock on an object store (``s3://``): a conditional PUT with a lease, renewed by a
thread (NOTE [the OUT lock] in :mod:`shardloader.pack.lock`, whose ``out_lock`` calls
:func:`remote_lock`)."""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from typing import Any

from fsspec.asyn import sync

from shardloader.errors import StorageError
from shardloader.pack.lock import LOCK_NAME, Holder, OutLock, alive, refused
from shardloader.storage.classify import chain, status_and_code
from shardloader.storage.s3client import S3Client
from shardloader.storage.store import Store

__all__ = ["remote_lock"]

log = logging.getLogger(__name__)


def _code(err: BaseException) -> str | None:
    """The S3 error code behind an s3fs-translated error (``PreconditionFailed``, ...)."""
    codes = (status_and_code(seen)[1] for seen in chain(err))
    return next((code for code in codes if code), None)


_CONFLICT = ("PreconditionFailed", "412", "ConditionalRequestConflict", "409")


class _Remote:
    """The lock object's requests, each under the store's retry policy: through the store's
    fast S3 client (botocore) when it has one, so a run that writes S3 never imports s3fs
    for its lock, else through s3fs."""

    def __init__(self, out: Store) -> None:
        self.store = out.join(LOCK_NAME)
        client = self.store.client()
        self.client = client if isinstance(client, S3Client) else None
        if self.client is None:
            fs, path = self.store.filesystem()
            self.fs = fs
            self.bucket, self.key, _ = fs.split_path(path)

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
        if self.client is not None:
            return self._call_client(self.client, name, **kwargs)
        try:
            if name == "get_object":
                return sync(self.fs.loop, self._get)
            return self.fs.call_s3(name, Bucket=self.bucket, Key=self.key, **kwargs)
        except OSError as err:
            if _code(err) in _CONFLICT:
                return None
            if name in ("get_object", "delete_object") and isinstance(err, FileNotFoundError):
                return {}
            raise

    def _call_client(self, client: S3Client, name: str, **kwargs: Any) -> Any:
        """:meth:`_call` through botocore, whose errors carry the S3 code themselves."""
        try:
            found = client.call(name, self.store.url, **kwargs)
        except Exception as err:
            status, code = status_and_code(err)
            if code in _CONFLICT or str(status) in _CONFLICT:
                return None
            if name in ("get_object", "delete_object") and (
                code in ("NoSuchKey", "404") or status == 404
            ):
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
        mine = Holder(**{**asdict(holder), "expires": time.time() + lease})
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
            mine = Holder(**{**asdict(self.lock.holder), "expires": time.time() + self.lease})
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
def remote_lock(out: Store, holder: Holder, lease: float) -> Iterator[OutLock]:
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
