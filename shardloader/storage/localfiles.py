"""Local files of a dataset, opened as untrusted input: regular files only, never waited on."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import BinaryIO, cast

from shardloader.errors import ObjectNotFoundError, StorageError

__all__ = ["open_regular", "regular_file"]

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def open_regular(path: str, url: str | None = None) -> BinaryIO:
    """``path`` opened for reading, if it is a regular file (after symlinks).

    A dataset is untrusted, and an extracted archive can hold a FIFO (whose ``open`` waits for
    a writer forever) or a link to ``/dev/zero`` (endless): the file is opened without
    blocking and checked with ``fstat`` (no window between check and open) before any read.
    """
    url = url or path
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as err:
        raise ObjectNotFoundError(f"cannot read {url!r}: no such file") from err
    except OSError as err:
        raise StorageError(f"cannot read {url!r}: {err.strerror}") from err
    return regular_file(
        fd,
        "rb",
        lambda kind: StorageError(
            f"cannot read {url!r}: it is {kind}, not a regular file; a dataset holds "
            "only regular files (replace it with the file it should be)"
        ),
    )


def regular_file(fd: int, mode: str, refuse: Callable[[str], StorageError]) -> BinaryIO:
    """The file object of ``fd`` (opened ``O_NONBLOCK``, so a FIFO never waits), made blocking,
    if it is a regular file; else ``fd`` is closed and ``refuse(what it is)`` raised."""
    try:
        st_mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(st_mode):
            raise refuse(next((name for test, name in _KINDS if test(st_mode)), "not a file"))
        os.set_blocking(fd, True)
        return cast(BinaryIO, os.fdopen(fd, mode))
    except BaseException:
        os.close(fd)
        raise
