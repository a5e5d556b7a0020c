"""Thin helpers over fsspec: one place that knows local paths from remote URLs.

Local paths go straight to the OS.  Remote URLs go through one :class:`RetryPolicy`
(:mod:`shardloader.storage.retry`): the filesystem below makes a single attempt per request, and
:func:`call_with_retries` owns the budget and turns failures into one ``StorageError``.
Filesystems are created lazily in the calling process (fsspec's own instance cache keeps one per
process and options); nothing here holds one in a global.
"""

from __future__ import annotations

import io
import logging
import os
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, BinaryIO, cast

import fsspec
from fsspec.core import url_to_fs

from shardloader.errors import ObjectNotFoundError, StorageError
from shardloader.storage.retry import (
    RetryPolicy,
    TruncatedBodyError,
    call_with_retries,
    fsspec_options,
)

Options = Mapping[str, Any] | None
logger = logging.getLogger(__name__)

_S3_PROTOCOLS = ("s3", "s3a")
_MIN_PART = 5 * 2**20  # S3's smallest multipart part
_MAX_PARTS = 10_000


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


def filesystem(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return (filesystem, path) for a URL, created in the calling process.

    The filesystem makes one attempt per request (botocore and s3fs retries off, timeouts from
    ``policy``): wrap calls on it in :func:`call_with_retries`, as this module does.
    """
    try:
        fs, path = url_to_fs(url, **fsspec_options(url, storage_options, policy))
    except (ImportError, ValueError) as err:
        raise StorageError(
            f"cannot open {url!r}: {err}; for s3:// install shardloader[s3], "
            "for http(s):// install shardloader[http]"
        ) from err
    if _protocol(url) in _S3_PROTOCOLS and getattr(fs, "retries", 1) != 1:
        # s3fs wraps every call in its own retry loop (5 tries, and again around reads); its
        # constructor does not take the count, so set it on the instance.  fsspec caches
        # instances by options, and ours carry single-attempt botocore settings, so an instance
        # shared this way wants the same.
        fs.retries = 1  # type: ignore[attr-defined]
    return fs, path


def open_read(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> BinaryIO:
    """Open a URL for streaming reads.

    Remote files come back wrapped: each ``read`` is retried under ``policy`` (reopening at the
    same offset after a fault), and a read that ends short of the object's size counts as a
    transient fault.
    """
    if is_local(url):
        try:
            return open(local_path(url), "rb")  # noqa: SIM115 - caller closes
        except FileNotFoundError as err:
            raise ObjectNotFoundError(f"cannot read {url!r}: no such file") from err
        except OSError as err:
            raise StorageError(f"cannot read {url!r}: {err.strerror}") from err
    fs, path = filesystem(url, storage_options, policy=policy)
    return cast(BinaryIO, _RetryingReader(url, partial(fs.open, path, "rb"), policy))


def read_bytes(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> bytes:
    """The whole object at ``url``."""
    if is_local(url):
        with open_read(url) as f:
            return f.read()
    fs, path = filesystem(url, storage_options, policy=policy)
    return call_with_retries(partial(fs.cat_file, path), url=url, policy=policy, what="read")


def exists(url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None) -> bool:
    """Whether an object (or a non-empty prefix) exists; transient faults are retried, not
    mistaken for absence."""
    if is_local(url):
        return os.path.exists(local_path(url))
    fs, path = filesystem(url, storage_options, policy=policy)
    return call_with_retries(partial(_exists, fs, path), url=url, policy=policy, what="stat")


def _exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    fs.invalidate_cache(path)  # answer from the store, not from an earlier listing
    try:
        fs.info(path)
    except FileNotFoundError:
        return False
    return True


def list_files(
    url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> list[str]:
    """All files below ``url``, as paths relative to it, sorted (deterministic traversal)."""
    if is_local(url):
        root = local_path(url)
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in filenames:
                out.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
        return sorted(out)
    fs, path = filesystem(url, storage_options, policy=policy)
    path = path.rstrip("/")
    found = call_with_retries(partial(_find, fs, path), url=url, policy=policy, what="list")
    return sorted(p[len(path) + 1 :] for p in found if len(p) > len(path) + 1)


def _find(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    fs.invalidate_cache(path)  # a listing is rare and must be current, not this process's memory
    return list(fs.find(path))


def write_bytes_atomic(
    url: str, data: bytes, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> None:
    """Write a whole object so readers see either nothing or all of it.

    Local: temp file in the same folder, fsync, rename.  Object stores: a single PUT is atomic
    (and idempotent, so it is retried as a whole).
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
    fs, path = filesystem(url, storage_options, policy=policy)
    call_with_retries(partial(fs.pipe_file, path, data), url=url, policy=policy, what="write")


def put_file(
    local: str, url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None
) -> None:
    """Copy a finished local file to ``url`` (atomic rename locally, one upload remotely).

    Each attempt is a whole upload.  On S3, a file of at least two blocks (``default_block_size``
    storage option, 50 MiB by default) goes up in parts; s3fs aborts an attempt's multipart
    upload when a part fails, so a failed upload leaves no object and no stored parts.
    """
    if is_local(url):
        dst = local_path(url)
        os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
        os.replace(local, dst)
        return
    fs, path = filesystem(url, storage_options, policy=policy)
    if _protocol(url) in _S3_PROTOCOLS:
        upload: Callable[[], None] = partial(_s3_put_once, fs, local, path)
    else:
        upload = partial(fs.put_file, local, path)
    call_with_retries(upload, url=url, policy=policy, what="upload")


def _s3_put_once(fs: Any, local: str, path: str) -> None:
    """One upload attempt; on any failure, leave no multipart upload behind for this key.

    s3fs aborts its multipart upload when a part fails, but parts still in flight may land after
    the abort (S3 documents that an abort may need repeating), and the abort itself can fail or
    be skipped by an interrupt.  So sweep: abort every incomplete upload of exactly this key.
    Shard keys have one writer (the pack run), so nothing else's upload is cut short.
    """
    size = os.path.getsize(local)
    block = int(getattr(fs, "default_block_size", 0) or 0)
    chunksize = max(_MIN_PART, block, -(-size // _MAX_PARTS))
    try:
        fs.put_file(local, path, chunksize=chunksize)
    except BaseException:
        if size >= 2 * chunksize:
            _abort_uploads(fs, path)
        raise


def _abort_uploads(fs: Any, path: str) -> None:
    bucket, key, _ = fs.split_path(path)
    try:
        listing = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
        for upload in listing.get("Uploads", []):
            if upload.get("Key") == key:
                fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload["UploadId"]
                )
    except Exception as err:  # noqa: BLE001 - best effort; the upload's own error matters more
        logger.warning(
            "could not abort incomplete multipart uploads of s3://%s/%s (%s); a bucket lifecycle "
            "rule AbortIncompleteMultipartUpload removes them",
            bucket,
            key,
            err,
        )


def remove(url: str, storage_options: Options = None, *, policy: RetryPolicy | None = None) -> None:
    """Delete an object; a missing one is fine."""
    if is_local(url):
        try:
            os.remove(local_path(url))
        except FileNotFoundError:
            pass
        return
    fs, path = filesystem(url, storage_options, policy=policy)
    call_with_retries(partial(_remove, fs, path), url=url, policy=policy, what="delete")


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    try:
        fs.rm_file(path)
    except FileNotFoundError:
        pass


def _protocol(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


class _RetryingReader(io.RawIOBase):
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
