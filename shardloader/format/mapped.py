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
import sys
from typing import BinaryIO

import xxhash

from shardloader.errors import ShardError

__all__ = ["LARGE", "MappedFile", "changed_since"]

LARGE = 16 << 20
_CHUNK = 4 << 20  # bytes hashed per read of a large span
# NOTE [populating the map]: a shard's samples are read in shuffled order, so each first touch
# of a 64 KiB window of the map is a page fault (the kernel maps a window per fault).  For 30 KB
# photos that was 0.54 faults and ~3.8 us of system time a sample; MADV_POPULATE_READ (Linux
# 5.14+) maps the whole file in one call when the reader opens it: 0.18 faults, ~1.9 us, and
# 16 % less CPU a raw photo in one process (medians of 3 interleaved runs; 1.5 KB documents:
# no change).  Only files up to _POPULATE_MOST: the pages it maps count in the process's
# resident size (shared file pages, not its own memory), and a larger file would wait for all
# of them at open.  MADV_WILLNEED (read-ahead into the page cache only) measured no gain.
_POPULATE_MOST = 128 << 20
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def changed_since(path: str, inode: int, size: int) -> str | None:
    """How the file ``path`` (inode ``inode``, ``size`` bytes when it was mapped) changed in a
    way that makes its mapping unsafe, or None.

    NOTE [no SIGBUS]: a page of a mapping past the end of a file that shrank (``cp`` or
    ``rsync --inplace`` over a shard, a node-cache copy truncated) is not an error the process
    can catch: touching it is SIGBUS, the process dies.  So whoever reads a mapping asks this
    before each batch it reads out of it: the same inode at a different size is named here, and
    the reader raises a ShardChangedError "changed while reading" (a staged copy is then staged
    again) instead of touching the map.  A path that now names another file (replaced by
    rename, removed) is fine: the mapped inode lives on unchanged.  A truncation in the
    microseconds between this check and the batch's reads is not covered.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_ino != inode or st.st_size == size:
        return None
    return (
        f"changed while reading: {path} is {st.st_size:,} bytes now, {size:,} when it was "
        "opened (overwritten in place, e.g. by `cp` or `rsync --inplace`, or truncated)"
    )


class MappedFile:
    """``path`` mapped read-only as ``map`` (``b""`` for an empty file) and ``view``."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:  # the mapping keeps its own handle on the file
            st = os.fstat(f.fileno())
            self.size = st.st_size
            self.inode = st.st_ino
            self.map: mmap.mmap | bytes = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
            )
        self.view = memoryview(self.map)
        self._file: BinaryIO | None = None  # opened for the first large span

    def populate(self) -> None:
        """Map every page of a file up to ``_POPULATE_MOST`` bytes now (NOTE [populating the
        map]); a kernel without MADV_POPULATE_READ, or a file cut short since (the call
        fails where touching the page would be SIGBUS), leaves the map as it was."""
        if sys.platform != "linux" or not 0 < self.size <= _POPULATE_MOST:
            return
        try:
            self.map.madvise(_MADV_POPULATE_READ)  # type: ignore[union-attr]
        except (OSError, ValueError):
            pass

    def changed(self) -> str | None:
        """:func:`changed_since` of this mapping (NOTE [no SIGBUS])."""
        return changed_since(self.path, self.inode, self.size)

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
