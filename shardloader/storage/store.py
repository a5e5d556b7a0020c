"""A URL with the options and the retry policy to reach it: the one handle storage calls take.

``Store("s3://bucket/ds", {"endpoint_url": ...}, RetryPolicy(...))`` is small, frozen and
pickles cheaply (fsspec's "URL + options" idea): it crosses into DataLoader workers and pack
processes as it is, and each process makes its filesystem lazily on first use
(:meth:`Store.filesystem`).  ``store.join("shard-00000.tar")`` is the store of a file
below it, with the same options and policy.

Local paths (and ``file://`` URLs) go straight to the OS.  Remote URLs make one attempt per
request and every call is retried as a whole under the policy (their protocol's defaults in
:mod:`shardloader.storage.protocols` say which errors are worth it); a remote file opened for
reading through fsspec is a :class:`RetryingReader`.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, BinaryIO, TypeVar, cast

import fsspec
from fsspec.core import url_to_fs

from shardloader.errors import StorageError, TruncatedBodyError, UsageError
from shardloader.storage.clients import ObjectClient, client_for
from shardloader.storage.objectstream import PART_SIZE, PARTS_IN_FLIGHT, ObjectStream
from shardloader.storage.private import open_regular
from shardloader.storage.protocols import S3, fsspec_options, protocol_defaults, protocol_of
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy, call_with_retries
from shardloader.storage.streams import BoundedReader

__all__ = ["SINGLE_PUT", "Store", "as_store", "join"]

T = TypeVar("T")

SINGLE_PUT = 50 * 2**20  # files up to this go up in one PUT (s3fs's default block size)


def join(base: str, *parts: str) -> str:
    """Join URL/path parts with ``/`` (fsspec URLs always use forward slashes)."""
    out = base.rstrip("/")
    for p in parts:
        out = f"{out}/{p.lstrip('/')}"
    return out


@dataclass(frozen=True)
class Store:
    """``url``: a local path or fsspec URL.  ``options``: fsspec storage options (explicit
    values win over the environment).  ``retry``: the budget of every remote call."""

    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    retry: RetryPolicy = DEFAULT_POLICY

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", dict(self.options or {}))

    def __repr__(self) -> str:  # options may hold credentials: names only
        return f"Store({self.url!r}, options={sorted(self.options)}, retry={self.retry!r})"

    # -- where ----------------------------------------------------------------------------
    @property
    def protocol(self) -> str:
        return protocol_of(self.url)

    @property
    def is_local(self) -> bool:
        """True for plain paths and ``file://`` URLs."""
        return "://" not in self.url or self.url.startswith("file://")

    @property
    def local_path(self) -> str:
        """The filesystem path of a local URL."""
        return self.url[len("file://") :] if self.url.startswith("file://") else self.url

    def join(self, *parts: str) -> Store:
        """The store of ``parts`` below this one (same options and policy)."""
        return Store(join(self.url, *parts), self.options, self.retry)

    def filesystem(self) -> tuple[fsspec.AbstractFileSystem, str]:
        """(filesystem, path), made in the calling process (fsspec's own instance cache keeps
        one per process and options, and clears it in a forked child; nothing holds one in a
        global or pickles one).  It makes one attempt per request (its protocol's defaults
        switch its own retries off and set timeouts from the policy): wrap calls on it in
        :meth:`call`."""
        try:
            fs, path = url_to_fs(self.url, **fsspec_options(self.url, self.options, self.retry))
        except (ImportError, ValueError) as err:
            raise StorageError(
                f"cannot open {self.url!r}: {err}; for s3:// install shardloader[s3], "
                "for http(s):// install shardloader[http]"
            ) from err
        prepare = protocol_defaults(self.protocol).prepare
        if prepare is not None:
            prepare(fs)
        return fs, path

    def call(self, fn: Callable[[], T], what: str = "read") -> T:
        """``fn()`` under this store's policy, its errors read as this protocol's."""
        return call_with_retries(fn, url=self.url, policy=self.retry, what=what)

    # -- reading --------------------------------------------------------------------------
    def open_read(self) -> BinaryIO:
        """Open for streaming reads.

        Remote files come back wrapped: each ``read`` is retried under the policy (reopening at
        the same offset after a fault), and a read that ends short of the object's size counts
        as a transient fault.  Local ones must be regular files (:func:`open_regular`).
        """
        if self.is_local:
            return open_regular(self.local_path, self.url)
        fs, path = self.filesystem()
        return cast(BinaryIO, RetryingReader(self.url, partial(fs.open, path, "rb"), self.retry))

    def client(self) -> ObjectClient | None:
        """This process's fast client for the store's protocol and options (None: fsspec)."""
        make = None if self.is_local else protocol_defaults(self.protocol).client
        return None if make is None else client_for(self.protocol, self.options, self.retry, make)

    def open_stream(
        self,
        size: int | None = None,
        *,
        limit: int | None = None,
        part_size: int = PART_SIZE,
        parts_in_flight: int = PARTS_IN_FLIGHT,
    ) -> BinaryIO:
        """Open for one front-to-back pass, the way shard bytes should travel: one GET per
        object (concurrent byte ranges past ``part_size``), no HEAD first, every byte handed
        out once even across faults (:mod:`shardloader.storage.objectstream`).

        ``size``: what the object must measure (a different size is a ChecksumError before its
        body is read); else ``limit``: the most bytes accepted.  Protocols without a fast
        client (and options it does not understand) stream through fsspec instead.
        """
        bound = size if size is not None else limit
        client = self.client()
        if client is None:
            f = self.open_read()
            return cast(BinaryIO, BoundedReader(f, bound, self.url)) if bound is not None else f
        stream = ObjectStream(
            client,
            self.url,
            self.retry,
            size,
            limit=limit,
            part_size=part_size,
            parts_in_flight=parts_in_flight,
        )
        return cast(BinaryIO, stream)

    def read_bytes(self, limit: int | None = None) -> bytes:
        """The whole object (one GET); past ``limit`` bytes, a ChecksumError."""
        if self.is_local or limit is not None or self.client() is not None:
            with self.open_stream(limit=limit) as f:
                return f.read()
        fs, path = self.filesystem()
        return self.call(partial(fs.cat_file, path), "read")

    def exists(self) -> bool:
        """Whether an object (or a non-empty prefix) exists; transient faults are retried, not
        mistaken for absence."""
        if self.is_local:
            return os.path.exists(self.local_path)
        fs, path = self.filesystem()
        return self.call(partial(_exists, fs, path), "stat")

    def list_files(self) -> list[str]:
        """All files below, as paths relative to this store, sorted (deterministic traversal)."""
        if self.is_local:
            root = self.local_path
            return sorted(
                os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
                for folder, _, names in os.walk(root)
                for name in names
            )
        client = self.client()
        if client is not None and hasattr(client, "list"):  # S3: no s3fs import for a listing
            listed: list[str] = self.call(partial(client.list, self.url), "list")
            return listed
        fs, path = self.filesystem()
        path = path.rstrip("/")
        found = self.call(partial(_find, fs, path), "list")
        return sorted(p[len(path) + 1 :] for p in found if len(p) > len(path) + 1)

    # -- writing --------------------------------------------------------------------------
    def write_bytes_atomic(self, data: bytes) -> None:
        """Write a whole object so readers see either nothing or all of it.

        Local: temp file in the same folder, fsync, rename.  Object stores: a single PUT is
        atomic (and idempotent, so it is retried as a whole).
        """
        if self.is_local:
            path = self.local_path
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
        client = self.client()
        if client is not None and hasattr(client, "put"):
            self.call(partial(client.put, self.url, data), "write")
            return
        fs, path = self.filesystem()
        self.call(partial(fs.pipe_file, path, data), "write")

    def put_file(
        self,
        local: str,
        sha256: str | None = None,
        before_parts: Callable[[], None] | None = None,
    ) -> bool:
        """Move a finished local file here (atomic rename locally, one upload remotely) and
        say whether it went in parts (S3 past ``SINGLE_PUT`` bytes, or the
        ``default_block_size`` option); ``before_parts()`` runs first when it does (NOTE
        [multipart journal] in uploads.py).  ``sha256``: the file's checksum (hex) when the
        caller has it, sent with a single S3 PUT so the store checks the bytes it received.

        Each attempt is a whole upload; the protocol may do it its own way (S3: one PUT
        through the fast client, larger files in parts through s3fs, leaving no incomplete
        multipart upload behind when an attempt fails).
        """
        if self.is_local:
            dst = self.local_path
            os.makedirs(os.path.dirname(dst) or ".", exist_ok=True)
            os.replace(local, dst)
            return False
        block = int(self.options.get("default_block_size") or SINGLE_PUT)
        parts = self.protocol in S3.names and os.path.getsize(local) > block
        client = self.client()
        if not parts and client is not None and hasattr(client, "put"):
            self.call(partial(_put_file_once, client, self.url, local, sha256), "upload")
            return False
        if parts and before_parts is not None:
            before_parts()
        fs, path = self.filesystem()
        put = protocol_defaults(self.protocol).put_file
        upload = (
            partial(put, fs, local, path) if put is not None else partial(fs.put_file, local, path)
        )
        self.call(upload, "upload")
        return parts

    def remove(self) -> None:
        """Delete the object; a missing one is fine."""
        if self.is_local:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.local_path)
            return
        fs, path = self.filesystem()
        self.call(partial(_remove, fs, path), "delete")


class RetryingReader(io.RawIOBase):
    """A remote file whose reads are retried under a policy.

    The position is kept here; after a fault the underlying fsspec file is dropped and the next
    attempt reopens it and seeks back, so a read never returns bytes twice or skips any.
    """

    def __init__(self, url: str, opener: Callable[[], Any], policy: RetryPolicy) -> None:
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
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}.get(whence)
        if base is None:  # an unknown whence, or SEEK_END of a file of unknown size
            raise io.UnsupportedOperation(f"{self.url}: cannot seek with whence={whence}")
        pos = base + offset
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


def as_store(
    url: str | Store,
    options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> Store:
    """``url`` as a Store: a Store as it is (it carries its options and policy; passing them
    too is a UsageError), a URL with ``options`` and ``retry`` (default policy when None)."""
    if isinstance(url, Store):
        if options is not None or retry is not None:
            raise UsageError(
                f"{url!r} carries its options and retry policy; pass a URL to give them apart"
            )
        return url
    return Store(url, options or {}, retry or DEFAULT_POLICY)


def _put_file_once(client: Any, url: str, local: str, sha256: str | None) -> None:
    with open(local, "rb") as f:
        client.put(url, f, sha256=sha256)


def _exists(fs: fsspec.AbstractFileSystem, path: str) -> bool:
    fs.invalidate_cache(path)  # answer from the store, not from an earlier listing
    try:
        fs.info(path)
    except FileNotFoundError:
        return False
    return True


def _find(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    fs.invalidate_cache(path)  # a listing is rare and must be current, not this process's memory
    return list(fs.find(path))


def _remove(fs: fsspec.AbstractFileSystem, path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        fs.rm_file(path)
