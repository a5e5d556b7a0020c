"""The storage functions of shardloader 0.1, each a thin wrapper over :class:`Store`.

They take a URL plus ``storage_options`` and ``policy=``; new code makes one
:class:`~shardloader.storage.Store` and calls its methods.  Kept because users and the pack
modules that still pass the pair call them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO

import fsspec

from shardloader.storage.remote import filesystem as _filesystem
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy
from shardloader.storage.store import Store, join

__all__ = [
    "exists",
    "filesystem",
    "is_local",
    "join",
    "list_files",
    "local_path",
    "open_read",
    "put_file",
    "read_bytes",
    "remove",
    "write_bytes_atomic",
]

Options = Mapping[str, Any] | None


def _store(url: str, storage_options: Options, policy: RetryPolicy | None) -> Store:
    return Store(url, storage_options or {}, policy or DEFAULT_POLICY)  # = as_store, for a URL


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return Store(url).is_local


def local_path(url: str) -> str:
    """The filesystem path of a local URL."""
    return Store(url).local_path


def filesystem(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for a URL, created in the calling process; one attempt per request."""
    return _filesystem(url, storage_options, policy)


def open_read(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> BinaryIO:
    return _store(url, storage_options, policy).open_read()


def read_bytes(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> bytes:
    return _store(url, storage_options, policy).read_bytes()


def exists(url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None) -> bool:
    return _store(url, storage_options, policy).exists()


def list_files(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> list[str]:
    return _store(url, storage_options, policy).list_files()


def write_bytes_atomic(
    url: str, data: bytes, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> None:
    _store(url, storage_options, policy).write_bytes_atomic(data)


def put_file(
    local: str, url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> None:
    _store(url, storage_options, policy).put_file(local)


def remove(url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None) -> None:
    _store(url, storage_options, policy).remove()
