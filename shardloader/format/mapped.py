"""A staged shard file mapped read-only: what the tar and Arrow readers read samples from.

Samples are copied (or viewed) straight out of the mapping, so reading never calls ``read``;
closing has to tolerate views that outlive the reader (a batch still holds one).
"""

from __future__ import annotations

import mmap
import os

__all__ = ["MappedFile"]


class MappedFile:
    """``path`` mapped read-only as ``map`` (``b""`` for an empty file) and ``view``."""

    def __init__(self, path: str) -> None:
        with open(path, "rb") as f:  # the mapping keeps its own handle on the file
            self.size = os.fstat(f.fileno()).st_size
            self.map: mmap.mmap | bytes = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
            )
        self.view = memoryview(self.map)

    def close(self) -> None:
        try:
            self.view.release()
            close = getattr(self.map, "close", None)  # no module global: this may run at exit
            if close is not None:
                close()
        except BufferError:  # a view is still alive: the map closes when the last one goes
            pass
