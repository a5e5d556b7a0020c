"""Uploads that run in the background, a few at a time, while the caller keeps producing.

NOTE [background uploads]: a writer (``pack``) hands each finished shard's upload to
:class:`Uploads` and goes on writing the next shards; uploads overlap the writing instead of
stopping it.  The commit protocol is unchanged: the caller calls :meth:`Uploads.wait` before it
writes its manifest, ``wait`` raises the first failed upload (each one retried under the store's
:class:`~shardloader.storage.retry.RetryPolicy` first), and after a failure nothing new starts.
So a manifest is written only once every shard it lists is whole in the store; on any error the
caller calls :meth:`Uploads.close`, which drops what has not started and waits for what has,
before it removes its local files.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from shardloader.storage.protocols import S3
from shardloader.storage.s3client import s3_abort_upload, s3_multipart_uploads
from shardloader.storage.store import Store, join

__all__ = [
    "JOURNAL",
    "Incomplete",
    "Uploads",
    "abort_recorded",
    "incomplete_uploads",
    "put_file_recorded",
]

log = logging.getLogger(__name__)


class Uploads:
    """At most ``concurrency`` uploads at once and ``backlog`` waiting (``submit`` blocks past
    that, which bounds the local disk the finished-but-not-uploaded files take)."""

    def __init__(self, concurrency: int = 4, backlog: int = 4) -> None:
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="shardloader-upload")
        self._room = threading.BoundedSemaphore(concurrency + backlog)
        self._futures: list[Future[None]] = []
        self._failed: BaseException | None = None
        self._lock = threading.Lock()

    def submit(self, upload: Callable[[], None]) -> None:
        """Run ``upload()`` in the background; raises at once if an earlier one failed."""
        self._raise_failure()
        self._room.acquire()
        try:
            future = self._pool.submit(self._run, upload)
        except BaseException:
            self._room.release()
            raise
        self._futures.append(future)

    def _run(self, upload: Callable[[], None]) -> None:
        try:
            if self._failed is None:  # else another upload failed: start nothing new
                upload()
        except BaseException as err:
            with self._lock:
                if self._failed is None:
                    self._failed = err
            raise
        finally:
            self._room.release()

    def _raise_failure(self) -> None:
        if self._failed is not None:  # set once, under the lock; reading it needs none
            raise self._failed

    def wait(self) -> None:
        """Every upload submitted so far is done; the first failure is raised."""
        for future in self._futures:
            future.exception()  # waits; the failure itself is kept in _failed
        self._futures.clear()
        self._raise_failure()

    def close(self) -> None:
        """Drop uploads not yet started, wait for running ones, stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)


# -- multipart uploads a killed run leaves ------------------------------------------------------
#
# NOTE [multipart journal]: an upload past one PUT goes to S3 in parts, and a run killed
# outright (``kill -9``, a lost node) leaves its incomplete multipart upload holding those parts
# (billed, invisible to listings of objects).  S3 lists incomplete uploads by key but not their
# metadata, so before such an upload starts the writer records it under OUT, at
# ``.shardloader-uploads/<run id>/<key>``, and removes the record once the upload is whole.  The
# next run that writes OUT (it holds the OUT lock, pack/lock.py) aborts the incomplete uploads
# of every recorded key and drops the records; uploads of keys no record names, another
# writer's, are never touched.

JOURNAL = ".shardloader-uploads"


def put_file_recorded(
    out: Store, name: str, local: str, run_id: str, sha256: str | None = None
) -> None:
    """``out.join(name).put_file(local, sha256)``, recorded while it runs when it goes in
    parts (NOTE [multipart journal])."""
    record = out.join(JOURNAL, run_id, name)
    note = json.dumps({"key": name, "run": run_id}).encode()
    if out.join(name).put_file(local, sha256, partial(record.write_bytes_atomic, note)):
        record.remove()  # on failure the record stays: the next run sweeps the key again


@dataclass(frozen=True)
class Incomplete:
    """An incomplete multipart upload under OUT; ``run``: the shardloader run that recorded
    it, None when no record names its key (another writer's)."""

    key: str  # relative to OUT
    upload_id: str
    initiated: str
    run: str | None


def _records(existing: Iterable[str]) -> dict[str, str]:
    """{key relative to OUT: run id} of the journal's records among ``existing`` paths."""
    found = {}
    for rel in existing:
        parts = rel.split("/", 2)
        if len(parts) == 3 and parts[0] == JOURNAL and parts[1] and parts[2]:
            found[parts[2]] = parts[1]
    return found


def incomplete_uploads(out: Store, existing: Iterable[str] | None = None) -> list[Incomplete]:
    """Every incomplete multipart upload under ``out`` (S3), each named ours or not."""
    if out.protocol not in S3.names:
        return []
    if existing is None:
        existing = out.list_files()
    records = _records(existing)
    fs, path = out.filesystem()
    path = path.rstrip("/") + "/"
    prefix = fs.split_path(path)[1]
    found = []
    for u in out.call(partial(s3_multipart_uploads, fs, path), "list"):
        rel = str(u["Key"])[len(prefix) :]
        found.append(Incomplete(rel, u["UploadId"], str(u.get("Initiated")), records.get(rel)))
    return found


def abort_recorded(out: Store, existing: Iterable[str]) -> list[Incomplete]:
    """Abort the incomplete uploads of every key the journal names, then drop the records
    (NOTE [multipart journal]); the aborted uploads come back.  Call holding the OUT lock."""
    existing = list(existing)
    records = [rel for rel in existing if rel.startswith(JOURNAL + "/")]
    if not records:
        return []
    aborted = [u for u in incomplete_uploads(out, existing) if u.run is not None]
    if aborted:
        fs, path = out.filesystem()
        for u in aborted:
            abort = partial(s3_abort_upload, fs, join(path, u.key), u.upload_id)
            out.call(abort, "abort an incomplete upload")
        log.info(
            "%s: aborted %d incomplete multipart uploads of killed runs", out.url, len(aborted)
        )
    for rel in records:
        out.join(rel).remove()
    return aborted
