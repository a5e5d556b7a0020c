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

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["Uploads"]


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
            with self._lock:
                if self._failed is not None:
                    return  # another upload failed: start nothing new
            upload()
        except BaseException as err:
            with self._lock:
                if self._failed is None:
                    self._failed = err
            raise
        finally:
            self._room.release()

    def _raise_failure(self) -> None:
        with self._lock:
            failed = self._failed
        if failed is not None:
            raise failed

    def wait(self) -> None:
        """Every upload submitted so far is done; the first failure is raised."""
        for future in self._futures:
            future.exception()  # waits; the failure itself is kept in _failed
        self._futures.clear()
        self._raise_failure()

    def close(self) -> None:
        """Drop uploads not yet started, wait for running ones, stop the threads."""
        self._pool.shutdown(wait=True, cancel_futures=True)
