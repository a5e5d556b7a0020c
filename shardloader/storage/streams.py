"""Read-through wrappers for untrusted stored bytes: one that refuses to read past a declared
size, one that hashes what passes through it, one that keeps the last bytes it passed."""

from __future__ import annotations

import hashlib
import os
import stat
from collections import deque
from typing import Any, Self

from shardloader.errors import ChecksumError

__all__ = ["CHUNK", "BoundedReader", "HashingReader", "Passthrough", "TailReader", "too_large"]

CHUNK = 8 << 20  # the most ``BoundedReader.read()`` asks for at once


def _regular_size(f: Any) -> int | None:
    """The size of ``f`` when it is a local regular file (None: unknown, or a stream)."""
    try:
        st = os.fstat(f.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def too_large(where: str, limit: int) -> ChecksumError:
    """The error of stored bytes past what the manifest declares for them."""
    return ChecksumError(
        f"{where}: the stored file is larger than the {limit:,} bytes the manifest declares; "
        "it is corrupt or was replaced"
    )


class Passthrough:
    """A file-like object for one pass over ``f``: what every reader here shares (``read``
    passes through, ``readinto`` copies what ``read`` returns, closing closes ``f``)."""

    _f: Any

    def __init__(self, f: Any) -> None:
        self._f = f

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        return data

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def readable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return bool(self._f.closed)

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BoundedReader(Passthrough):
    """A stored shard or sidecar read no further than the size its manifest declares.

    The bound is the manifest's claim, not a size to allocate: ``read()`` reads in chunks of
    at most :data:`CHUNK` (a manifest claiming a petabyte costs what the file holds), and a
    local regular file already larger than the bound is refused before any of it is read.
    """

    def __init__(self, f: Any, limit: int, where: str) -> None:
        super().__init__(f)
        self.limit = limit
        self.where = where
        self.count = 0
        size = _regular_size(f)
        if size is not None and size > limit:
            f.close()
            self._counted(size)  # raises: the file is larger than declared

    def _counted(self, n: int) -> int:
        self.count += n
        if self.count > self.limit:  # a ChecksumError: the bytes are not the manifest's
            raise too_large(self.where, self.limit)
        return n

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            parts: list[bytes] = []
            while True:  # one byte more than allowed tells an oversize file
                part: bytes = self._f.read(min(self.limit - self.count + 1, CHUNK))
                if not part:
                    return b"".join(parts)
                self._counted(len(part))
                parts.append(part)
        data: bytes = self._f.read(n)
        self._counted(len(data))
        return data

    def readinto(self, buf: Any) -> int:
        return self._counted(self._f.readinto(buf))


class HashingReader(Passthrough):
    """Reads through ``f``, counting (``pos``) and SHA-256-ing (``sha``) every byte it hands
    out; ``drain`` reads the rest, so the digest covers the whole file."""

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        self.sha = hashlib.sha256()
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        self.sha.update(data)
        self.pos += len(data)
        return data

    def readinto(self, buf: bytearray | memoryview) -> int:
        n: int = self._f.readinto(buf)
        self.sha.update(memoryview(buf)[:n])
        self.pos += n
        return n

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """Nothing: the source stays open for :meth:`drain` (its opener closes it)."""

    def drain(self) -> None:
        while self.read(4 << 20):
            pass

    def hexdigest(self) -> str:
        return self.sha.hexdigest()


class TailReader(Passthrough):
    """Reads through ``f`` and keeps references to the last chunks read, at least ``keep``
    bytes of them when there were that many (:meth:`tail`): what a stored shard carries after
    its data (its embedded sample index) is at hand once the stream has passed, without a
    second read."""

    def __init__(self, f: Any, keep: int) -> None:
        super().__init__(f)
        self.keep = keep
        self._chunks: deque[bytes] = deque()
        self._held = 0

    def read(self, n: int = -1) -> bytes:
        data: bytes = self._f.read(n)
        if data:
            self._chunks.append(data)
            self._held += len(data)
            while self._chunks and self._held - len(self._chunks[0]) >= self.keep:
                self._held -= len(self._chunks.popleft())
        return data

    def tail(self, n: int) -> bytes:
        """The last ``n`` bytes read (fewer if fewer were kept); joins only the chunks needed."""
        parts: list[bytes] = []
        need = n
        for chunk in reversed(self._chunks):
            if need <= 0:
                break
            parts.append(chunk if len(chunk) <= need else chunk[len(chunk) - need :])
            need -= len(parts[-1])
        return b"".join(reversed(parts))
