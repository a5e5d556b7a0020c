"""A staged shard file mapped read-only: what the tar, Arrow and token readers read samples from.

Samples are copied (or viewed) straight out of the mapping, so reading never calls ``read``;
closing has to tolerate views that outlive the reader (a batch still holds one).

A large span (:data:`LARGE` bytes or more: a sample of hundreds of MB) is the exception: its
pages, once touched through the mapping, count in the process's resident memory for as long
as the mapping lives, on top of the copy the sample is handed out as, so a 3 GB sample would
cost 6 GB.  :meth:`MappedFile.copy` and :meth:`MappedFile.digest` read such a span through
the file instead (the page cache, not the process, holds its pages): one copy, and a checksum
that costs no memory at all.
"""

from __future__ import annotations

import mmap
import os
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError

__all__ = ["LARGE", "MappedFile"]

LARGE = 16 << 20
_CHUNK = 4 << 20  # bytes hashed per read of a large span


class MappedFile:
    """``path`` mapped read-only as ``map`` (``b""`` for an empty file) and ``view``."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:  # the mapping keeps its own handle on the file
            self.size = os.fstat(f.fileno()).st_size
            self.map: mmap.mmap | bytes = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
            )
        self.view = memoryview(self.map)
        self._file: BinaryIO | None = None  # opened for the first large span

    def _reader(self) -> BinaryIO:
        if self._file is None:
            self._file = open(self.path, "rb")  # noqa: SIM115  (closed by close())
        return self._file

    def copy(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)``: a slice of the map, or for a large span one read."""
        if stop - start < LARGE:
            return self.map[start:stop]
        f = self._reader()
        f.seek(start)
        data = f.read(stop - start)  # a buffered read fills one bytes object of that size
        if len(data) != stop - start:
            raise ShardError(f"{self.path}: truncated shard: bytes {start}..{stop} are cut short")
        return data

    def get(self, span: slice) -> bytes:
        """:meth:`copy` of a slice (what ``format.base.copy_fields`` takes)."""
        return self.copy(span.start, span.stop)

    def digest(self, start: int, stop: int, seed: int = 0) -> int:
        """XXH3-64 of bytes ``[start, stop)`` (``seed``: as ``xxh3_64_intdigest`` takes it),
        for a large span read through the file a chunk at a time."""
        if stop - start < LARGE:
            return xxhash.xxh3_64_intdigest(self.view[start:stop], seed=seed)
        h = xxhash.xxh3_64(seed=seed)
        fd = self._reader().fileno()
        at = start
        while at < stop:
            chunk = os.pread(fd, min(_CHUNK, stop - at), at)
            if not chunk:
                raise ShardError(f"{self.path}: truncated shard: bytes {at}..{stop} are missing")
            h.update(chunk)
            at += len(chunk)
        return h.intdigest()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            self.view.release()
            close = getattr(self.map, "close", None)  # no module global: this may run at exit
            if close is not None:
                close()
        except BufferError:  # a view is still alive: the map closes when the last one goes
            pass
