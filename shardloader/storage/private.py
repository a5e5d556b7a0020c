"""Folders and files that only their user can reach (what the node cache is made of), and a
dataset's local files opened as untrusted input (:func:`open_regular`): both regular files
only, never waited on.

NOTE [a cache of one's own]: staged copies are decompressed datasets, and the cache's lock files
are opened, created and removed by every run, ``shardloader cache clear`` included, which may
run as root.  So, as ssh treats ``~/.ssh``:

- the cache root is created ``0700``; an existing one must belong to the user and be writable
  by nobody else, or it is refused with a message naming its owner and mode (the default root,
  ``~/.cache/shardloader``, is shardloader's own: an older one made ``0775`` under a group
  umask is tightened instead);
- dataset folders are ``0700`` (older ones are tightened), files ``0600`` (no more readable than
  any source: a private dataset stays private once staged);
- every file is opened with ``O_NOFOLLOW`` and new ones with ``O_EXCL``, so a symbolic link
  planted where a lock or a staged copy goes is refused, never followed to a file elsewhere.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import uuid
from collections.abc import Callable
from typing import BinaryIO, cast

from shardloader.errors import ObjectNotFoundError, StorageError

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "create_private",
    "open_private",
    "open_regular",
    "own_dir",
    "owner_problem",
    "regular_file",
    "write_private",
]

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def owner_problem(st: os.stat_result) -> str | None:
    """Why a folder with this ``stat`` is not the user's own to keep a cache in, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.geteuid():
        return f"belongs to {_who(st.st_uid)}, not to you, {_who(os.geteuid())}"
    if st.st_mode & 0o022:
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def own_dir(path: str, what: str, *, tighten: bool, remedy: str) -> None:
    """Make sure ``path`` is a folder of the user's own: created ``0700`` if missing, else
    checked (``tighten``: a folder of the user's that others may write or read is set to
    ``0700`` instead of refused).  A :class:`StorageError` naming ``what``, the problem and
    ``remedy`` otherwise."""
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        st = os.stat(path)
    except OSError as err:
        reason = err.strerror or err
        raise StorageError(f"cannot use {what} at {path} ({reason}); {remedy}") from err
    problem = owner_problem(st)
    if tighten and st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode):
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.chmod(path, DIR_MODE)
            log.info("%s %s: mode %o -> 700", what, path, stat.S_IMODE(st.st_mode))
        return
    if problem is not None:
        raise StorageError(
            f"refusing {what} at {path}: it {problem}, so another user could read or replace "
            f"what is staged there; {remedy}"
        )


def open_private(path: str, flags: int, mode: str) -> BinaryIO:
    """``path`` opened with ``flags`` (``os.O_*``), never through a symbolic link, created
    ``0600``; ``mode`` is the file object's (``"rb"``, ``"r+b"``, ``"wb"``).  A link or anything
    but a regular file is a :class:`StorageError` (NOTE [a cache of one's own])."""
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise StorageError(
                f"{path} is a symbolic link where the shard cache keeps its own files; the "
                "cache never makes one, so someone else can write to this folder: refused"
            ) from err
        raise
    return regular_file(
        fd, mode, lambda kind: StorageError(f"{path} is {kind}; the shard cache never makes one")
    )


def create_private(path: str, mode: str = "wb") -> BinaryIO:
    """A new file at ``path`` (it must not exist: ``O_EXCL``), ``0600``, for writing."""
    flags = os.O_CREAT | os.O_EXCL | (os.O_RDWR if "+" in mode else os.O_WRONLY)
    return open_private(path, flags, mode)


def write_private(path: str, data: bytes) -> None:
    """Replace ``path`` with a private file holding ``data`` (a temp file, then a rename):
    another process reads the old file or the new one, never half of one.  The temp file is
    removed if anything fails; the OSError is the caller's (a note it may do without)."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"  # a temp name the cache's eviction recognises
    try:
        with create_private(tmp) as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def open_regular(path: str, url: str) -> BinaryIO:
    """``path`` (the file of ``url``) opened for reading, if it is a regular file (after
    symlinks).

    A dataset is untrusted, and an extracted archive can hold a FIFO (whose ``open`` waits for
    a writer forever) or a link to ``/dev/zero`` (endless): the file is opened without
    blocking and checked with ``fstat`` (no window between check and open) before any read.
    """
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
