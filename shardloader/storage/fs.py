"""Thin helpers over fsspec: one place that knows local paths from remote URLs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from shardloader.errors import StorageError

Options = Mapping[str, Any] | None


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    """The filesystem path of a local URL."""
    return url[len("file://") :] if url.startswith("file://") else url


def join(base: str, *parts: str) -> str:
    """Join URL/path parts with ``/`` (fsspec URLs always use forward slashes)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.lstrip('/')}"
    return out


def filesystem(url: str, storage_options: Options = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path) for a URL, created in the calling process."""
    try:
        return url_to_fs(url, **dict(storage_options or {}))
    except (ImportError, ValueError) as err:
        raise StorageError(
            f"cannot open {url!r}: {err}; for s3:// install shardloader[s3], "
            "for http(s):// install shardloader[http]"
        ) from err


def open_read(url: str, storage_options: Options = None) -> BinaryIO:
    """Open a URL for streaming reads."""
    if is_local(url):
        try:
            return open(local_path(url), "rb")  # noqa: SIM115 - caller closes
        except OSError as err:
            raise StorageError(f"cannot read {url!r}: {err.strerror}") from err
    fs, path = filesystem(url, storage_options)
    try:
        return fs.open(path, "rb")  # type: ignore[no-any-return]
    except (OSError, FileNotFoundError) as err:
        raise StorageError(f"cannot read {url!r}: {err}") from err


def read_bytes(url: str, storage_options: Options = None) -> bytes:
    with open_read(url, storage_options) as f:
        return f.read()


def exists(url: str, storage_options: Options = None) -> bool:
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options)
    return bool(fs.exists(path))


def list_files(url: str, storage_options: Options = None) -> list[str]:
    """All files below ``url``, as paths relative to it, sorted (deterministic traversal)."""
    if is_local(url):
        root = local_path(url)
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
        return sorted(out)
    fs, path = filesystem(url, storage_options)
    path = path.rstrip("/")
    found = fs.find(path)
    return sorted(p[len(path) + 1 :] for p in found)


def write_bytes_atomic(url: str, data: bytes, storage_options: Options = None) -> None:
    """Write a whole object so readers see either nothing or all of it.

    Local: temp file in the same folder, fsync, rename.  Object stores: a single PUT is atomic.
    """
    if is_local(url):
        path = local_path(url)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        return
    fs, path = filesystem(url, storage_options)
    try:
        fs.pipe_file(path, data)
    except OSError as err:
        raise StorageError(f"cannot write {url!r}: {err}") from err


def put_file(local: str, url: str, storage_options: Options = None) -> None:
    """Copy a finished local file to ``url`` (atomic rename locally, one upload remotely)."""
    if is_local(url):
        dst = local_path(url)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        os.replace(local, dst)
        return
    fs, path = filesystem(url, storage_options)
    try:
        fs.put_file(local, path)
    except OSError as err:
        raise StorageError(f"cannot upload {local!r} to {url!r}: {err}") from err


def remove(url: str, storage_options: Options = None) -> None:
    if is_local(url):
        try:
            os.remove(local_path(url))
        except FileNotFoundError:
            pass
        return
    fs, path = filesystem(url, storage_options)
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass
