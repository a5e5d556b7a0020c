"""One exception tree for the whole package.

Every error is a :class:`ShardloaderError` *and* the matching built-in (``ValueError``,
``OSError``, ...), so callers can catch either.  Messages name the value, the place (file, shard,
sample key, rank, worker) and the remedy; the CLI maps ``ShardloaderError`` to exit code 1 and
:class:`UsageError` to exit code 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ShardloaderError",
    "UsageError",
    "InputError",
    "OutputExistsError",
    "OutputLockedError",
    "ManifestError",
    "ShardError",
    "ChecksumError",
    "ShardChangedError",
    "DecodeError",
    "MissingFieldError",
    "TransformError",
    "StorageError",
    "ObjectNotFoundError",
    "ObjectChangedError",
    "TruncatedBodyError",
    "ResumeError",
    "IncompleteEpochError",
    "StallError",
]


class ShardloaderError(Exception):
    """Base class of every error shardloader raises on purpose.

    ``where`` (the file, shard or object a failure belongs to) leads the message.  Code deep in
    a reader raises without it; the boundary that knows the place sets it once, with
    :func:`located`, instead of a ``where`` string passed down through every call.
    """

    where: str | None = None

    def __str__(self) -> str:
        text = super().__str__()
        return f"{self.where}: {text}" if self.where else text


@contextmanager
def located(where: str) -> Iterator[None]:
    """Give every :class:`ShardloaderError` raised inside that has no place yet ``where``.

    The innermost boundary wins: it knows the most precise place.  The attribute travels with
    the error across processes (exceptions pickle their ``__dict__``).
    """
    try:
        yield
    except ShardloaderError as err:
        if err.where is None:
            err.where = where
        raise


class UsageError(ShardloaderError, ValueError):
    """The call itself is wrong: bad option values, empty or ambiguous input layout."""


class InputError(ShardloaderError, ValueError):
    """A raw input file cannot be packed: unreadable, invalid UTF-8/JSON, corrupt image."""


class OutputExistsError(ShardloaderError, FileExistsError):
    """The output location already holds data and neither --overwrite nor --resume was given."""


class OutputLockedError(UsageError):
    """Another run (``pack``, ``index``, ``merge``) holds the lock on the output location; the
    message names it (host, pid, start time).  A usage error: the CLI exits 2, as for a call
    that cannot run as given."""


class ManifestError(ShardloaderError, ValueError):
    """The manifest is missing, malformed, of an unknown version, or does not match the shards."""


class ShardError(ShardloaderError, OSError):
    """A shard cannot be read: truncated, malformed tar/arrow, sample index out of range."""


class ChecksumError(ShardError):
    """A shard's bytes do not hash to the checksum recorded in the manifest."""


class ShardChangedError(ShardError):
    """A shard's local file (read in place, or its staged copy) shrank or grew while it was
    mapped for reading: the copy is staged again; read in place, the shard is reported."""


class DecodeError(ShardloaderError, ValueError):
    """A field of a sample cannot be decoded (or must not be: pickled data)."""


class MissingFieldError(DecodeError):
    """A sample lacks a field (absent, or null) where a value is needed: a field the reader
    requires (``Decoder(required=...)``; skipped under ``on_error="skip"``), or a batch whose
    other values of that field stack into a tensor, which has no place for a missing one.

    ``field``, ``missing`` (how many samples of the batch lack it), ``key`` and ``index`` (the
    first such sample's key and global id) say where, when known.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        missing: int = 0,
        key: str | None = None,
        index: int | None = None,
    ) -> None:
        super().__init__(message)
        self.field, self.missing, self.key, self.index = field, missing, key, index


class TransformError(ShardloaderError, RuntimeError):
    """A transform (the user's, or any code that is not shardloader's) failed on a sample.

    The message names shard, sample key, rank and worker; the original exception is the
    ``__cause__``.  ``on_error="skip"`` does not skip it: a bug in a transform should stop the
    run.  A transform that meets bad data can raise :class:`DecodeError`, which is skipped.
    """


class StorageError(ShardloaderError, OSError):
    """Reading or writing a URL failed for good (retries exhausted or a permanent error)."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object or bucket a URL names does not exist (HTTP 404, NoSuchKey, NoSuchBucket)."""


class ObjectChangedError(StorageError):
    """A remote object was replaced while it was read: a resumed or ranged request carried the
    ETag of the first response (``If-Match``) and the store no longer holds that version."""


class TruncatedBodyError(ShardloaderError, ConnectionError):
    """A response ended before the size it announced: transient, worth another attempt.

    Unlike every other error here it is retried, not final: storage calls retry it under their
    :class:`~shardloader.storage.retry.RetryPolicy` (a spent budget ends in one
    :class:`StorageError`), and the service client reconnects.
    """


class ResumeError(ShardloaderError, ValueError):
    """A saved loader state does not fit the dataset it is loaded into."""


class IncompleteEpochError(ShardloaderError, OSError):
    """A pass over the data ended before its planned steps: batches were lost on the way from
    the DataLoader workers (e.g. a batch that could not be pickled or shared)."""


class StallError(ShardloaderError, TimeoutError):
    """A pass produced nothing for ``ReadOptions.stall_timeout`` seconds: the message names
    rank, worker, shard, sample and the stuck stack (shardloader/deliver/watchdog.py)."""
