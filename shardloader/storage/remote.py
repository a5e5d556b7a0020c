"""A remote file of a store read through its fsspec filesystem, every read retried under the
store's policy (what :meth:`~shardloader.storage.store.Store.open_read` returns)."""

from __future__ import annotations

import io
from collections.abc import Callable
from functools import partial
from typing import Any

from shardloader.errors import StorageError, TruncatedBodyError
from shardloader.storage.retry import RetryPolicy, call_with_retries

__all__ = ["RetryingReader"]


class RetryingReader(io.RawIOBase):
    """A remote file whose reads are retried under a policy.

    The position is kept here; after a fault the underlying fsspec file is dropped and the next
    attempt reopens it and seeks back, so a read never returns bytes twice or skips any.
    """

    def __init__(
        self, url: str, opener: Callable[[], Any], policy: RetryPolicy | None = None
    ) -> None:
        super().__init__()
        self.url = url
        self._opener = opener
        self._policy = policy
        self._pos = 0
        self._f: Any = None
        self._f = call_with_retries(opener, url=url, policy=policy, what="open")
        size = getattr(self._f, "size", None)
        self.size: int | None = int(size) if size is not None else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._f is None or bool(self._f.seekable())

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self._pos + offset
        elif whence == io.SEEK_END and self.size is not None:
            pos = self.size + offset
        else:
            raise io.UnsupportedOperation(f"{self.url}: cannot seek with whence={whence}")
        if pos < 0:
            raise ValueError(f"{self.url}: negative seek position {pos}")
        if self._f is not None:
            self._f.seek(pos)
        self._pos = pos
        return pos

    def read(self, size: int | None = -1) -> bytes:
        n = -1 if size is None else size
        data: bytes = call_with_retries(
            partial(self._read_once, n), url=self.url, policy=self._policy, what="read"
        )
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def _read_once(self, n: int) -> bytes:
        if self._f is None:
            f = self._opener()
            if self._pos:
                if not f.seekable():
                    f.close()
                    raise StorageError(
                        f"cannot resume reading {self.url!r} at offset {self._pos}: the server "
                        "does not support ranged reads; fetch the whole object instead"
                    )
                f.seek(self._pos)
            self._f = f
        try:
            data = bytes(self._f.read(n))
            if self.size is not None:
                left = max(0, self.size - self._pos)
                want = left if n < 0 else min(n, left)
                if len(data) < want:
                    raise TruncatedBodyError(
                        f"{self.url}: got {len(data)} of {want} bytes at offset {self._pos}"
                    )
        except BaseException:
            self._drop()
            raise
        return data

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except Exception:  # noqa: BLE001 - the file already failed; its close may too
                pass

    def close(self) -> None:
        self._drop()
        super().close()
