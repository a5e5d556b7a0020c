"""The fast S3 client: botocore's synchronous client with a connection pool sized for
concurrent range GETs, made from the same storage options s3fs takes.

Measured against a local S3 server (tools/bench_s3.py): s3fs's ``cat_file`` moves about 0.6 of
what a plain botocore ``get_object`` loop does, and its per-request overhead (an asyncio loop in
a thread, HEAD before reads) dominates small objects.  obstore (Rust) was measured too: as fast
as this client with a streamed body, but a new compiled dependency with its own credential
chain, where botocore is already installed with s3fs and reads the same profiles, variables
and endpoint settings (``AWS_ENDPOINT_URL``) as s3fs does.

Options s3fs understands and this client does not (``version_aware``, ``s3_additional_kwargs``,
a ``session`` object, ...) make :func:`s3_client` return None: the store then reads through
s3fs as before.  The botocore *session* (credentials, the parsed service model) is kept for
the life of the process and inherited by forked DataLoader workers, so each worker's client
costs tens of milliseconds, not the time a fresh service model takes to load; the *client*
(its connection pool) is made again in each process
(:func:`~shardloader.storage.clients.client_for`).

What still goes through s3fs (options this client does not take, uploads in parts, the listing
of incomplete uploads) is set up here too, for the S3 entry of
:mod:`~shardloader.storage.protocols`: one attempt per request (:func:`fill_s3_options`,
:func:`prepare_s3fs`), and uploads that leave no incomplete multipart upload behind
(:func:`s3_put_once`).
"""

from __future__ import annotations

import base64
import functools
import logging
import os
from collections.abc import Mapping
from typing import Any

from shardloader.storage.clients import parse_content_range, request_headers
from shardloader.storage.deadline import Deadline, Guard, arm, too_slow

__all__ = [
    "POOL_CONNECTIONS",
    "S3Client",
    "fill_s3_options",
    "prepare_s3fs",
    "s3_abort_upload",
    "s3_client",
    "s3_multipart_uploads",
    "s3_put_once",
    "split_s3_url",
]

log = logging.getLogger(__name__)

POOL_CONNECTIONS = 64  # concurrent GETs one process may have open (read-ahead x ranges)

# The s3fs options this client understands: any other makes the store read through s3fs.
_UNDERSTOOD = frozenset(
    {
        # honoured
        "key",
        "secret",
        "token",
        "username",
        "password",
        "anon",
        "endpoint_url",
        "client_kwargs",
        "config_kwargs",
        "profile",
        "requester_pays",
        "use_ssl",
        # s3fs's own, which do not change how a GET is made
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "skip_instance_cache",
        "cache_regions",
        "max_concurrency",
        "fixed_upload_size",
        "local_expiry_check",
    }
)


def split_s3_url(url: str) -> tuple[str, str]:
    """(bucket, key) of ``s3://bucket/key`` (also ``s3a://``)."""
    rest = url.split("://", 1)[1]
    bucket, _, key = rest.partition("/")
    return bucket, key


class _S3Body:
    """A GetObject body, read through botocore's StreamingBody (which turns urllib3's errors
    into botocore's and checks the length at the end).  With a deadline, the watchdog shuts the
    body's socket down when it passes (urllib3's ``HTTPResponse.shutdown``, 2.3 and later; older
    ones are not cut off)."""

    def __init__(self, response: Mapping[str, Any], url: str, deadline: Deadline | None) -> None:
        self._body = response["Body"]
        self._url = url
        length = response.get("ContentLength")
        self.length: int | None = int(length) if length is not None else None
        total = parse_content_range(response.get("ContentRange"))
        self.ranged = total is not None  # no Content-Range: the whole object follows
        self.etag: str | None = response.get("ETag")
        self.content_type: str | None = response.get("ContentType")
        self.total = total if self.ranged else self.length
        self._got = 0
        shutdown = getattr(getattr(self._body, "_raw_stream", None), "shutdown", None)
        self._guard: Guard | None = arm(deadline, shutdown) if callable(shutdown) else None

    def read(self, n: int) -> bytes:
        try:
            data: bytes = self._body.read(n)
        except Exception as err:
            if self._guard is not None and self._guard.fired:
                raise too_slow(self._url, self._guard.deadline, self._got) from err
            raise
        if not data and self._guard is not None and self._guard.fired:
            raise too_slow(self._url, self._guard.deadline, self._got)
        self._got += len(data)
        return data

    def close(self) -> None:
        if self._guard is not None:
            self._guard.cancel()
        self._body.close()


class S3Client:
    """``get`` of whole objects and byte ranges; one attempt each (botocore's own retries off)."""

    def __init__(self, client: Any, extra: Mapping[str, Any]) -> None:
        self._client = client
        self._extra = dict(extra)

    def get(
        self,
        url: str,
        start: int = 0,
        stop: int | None = None,
        deadline: Deadline | None = None,
        if_match: str | None = None,
    ) -> _S3Body:
        # botocore's parameters are the headers' names without the hyphen: Range, IfMatch
        headers = request_headers(start, stop, if_match)
        kwargs = {name.replace("-", ""): value for name, value in headers.items()}
        return _S3Body(self.call("get_object", url, **kwargs), url, deadline)

    def put(self, url: str, body: Any, sha256: str | None = None) -> None:
        """One PUT of ``body`` (bytes or a file opened for reading): S3 makes it visible whole
        or not at all.  ``sha256`` (hex), when the caller knows it (pack: the shard checksum
        its manifest records), goes with the request as its checksum: S3 refuses a body that
        does not match it, and botocore computes no CRC32 of its own over the body."""
        checksum = {}
        if sha256 is not None:
            checksum["ChecksumAlgorithm"] = "SHA256"  # S3 keeps it: HEAD with ChecksumMode shows it
            checksum["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
        self.call("put_object", url, Body=body, **checksum)

    def list(self, url: str) -> list[str]:
        """Every object below the folder ``url``, as paths relative to it, sorted, as s3fs's
        ``find`` lists them (a folder marker ``sub/`` included).  Through this client
        a writer to S3 (``pack``) never imports s3fs and aiobotocore: their import and their
        own client cost about 0.7 CPU seconds a run."""
        bucket, key = split_s3_url(url)
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        found: list[str] = []
        pages = self._client.get_paginator("list_objects_v2")
        for page in pages.paginate(Bucket=bucket, Prefix=prefix, **self._extra):
            found.extend(str(o["Key"])[len(prefix) :] for o in page.get("Contents", ()))
        return sorted(k for k in found if k)

    def call(self, operation: str, url: str, **kwargs: Any) -> Any:
        """One botocore call on the object ``url`` (``put_object``, ``get_object``,
        ``delete_object``, with conditions such as ``IfMatch``): the OUT lock's requests."""
        bucket, key = split_s3_url(url)
        return getattr(self._client, operation)(Bucket=bucket, Key=key, **kwargs, **self._extra)


@functools.cache
def _session(profile: str | None) -> Any:
    """The botocore session of ``profile``, kept for the life of the process."""
    import botocore.session

    return botocore.session.Session(profile=profile)


def s3_client(options: Mapping[str, Any], opts: Mapping[str, Any]) -> S3Client | None:
    """A client for these s3fs-style ``options``, or None when they hold something only s3fs
    understands (the store then uses s3fs).  ``opts``: the same options as the S3 defaults
    filled them in (one attempt per request, the policy's timeouts: protocols.py)."""
    if set(options) - _UNDERSTOOD:
        return None
    try:
        from botocore import UNSIGNED
        from botocore.config import Config
    except ImportError:
        return None
    client_kwargs: dict[str, Any] = dict(opts.get("client_kwargs") or {})
    config_kwargs: dict[str, Any] = dict(opts.get("config_kwargs") or {})
    config_kwargs.setdefault("max_pool_connections", POOL_CONNECTIONS)
    for ours, botos in (
        ("key", "aws_access_key_id"),
        ("username", "aws_access_key_id"),
        ("secret", "aws_secret_access_key"),
        ("password", "aws_secret_access_key"),
        ("token", "aws_session_token"),
        ("endpoint_url", "endpoint_url"),
    ):
        if opts.get(ours) is not None:
            client_kwargs.setdefault(botos, opts[ours])
    if "use_ssl" in opts:
        client_kwargs.setdefault("use_ssl", bool(opts["use_ssl"]))
    if opts.get("anon"):
        for name in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            client_kwargs.pop(name, None)
        config_kwargs["signature_version"] = UNSIGNED
    extra = {"RequestPayer": "requester"} if opts.get("requester_pays") else {}
    session = _session(opts.get("profile"))
    client = session.create_client("s3", config=Config(**config_kwargs), **client_kwargs)
    return S3Client(client, extra)


# -- through s3fs: one attempt per request, uploads that leave nothing behind ------------------


def fill_s3_options(opts: dict[str, Any], connect: float, read: float) -> None:
    """botocore ``total_max_attempts: 1`` (``max_attempts: 1`` would still allow one retry: it
    does not count the first attempt) and its timeouts; the endpoint and credentials are left
    to botocore, which reads ``AWS_ENDPOINT_URL``, profiles and the usual variables."""
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", connect)
    config.setdefault("read_timeout", read)
    opts["config_kwargs"] = config


def prepare_s3fs(fs: Any) -> None:
    """s3fs wraps every call in its own retry loop (5 tries, and again around reads); its
    constructor does not take the count, so set it on the instance.  fsspec caches instances by
    options, and ours carry single-attempt botocore settings, so a shared instance wants it too."""
    if getattr(fs, "retries", 1) != 1:
        fs.retries = 1


_MIN_PART = 5 * 2**20  # S3's smallest multipart part
_MAX_PARTS = 10_000


def s3_put_once(fs: Any, local: str, path: str) -> None:
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
    key = fs.split_path(path)[1]
    try:
        for upload in s3_multipart_uploads(fs, path):
            if upload.get("Key") == key:
                s3_abort_upload(fs, path, upload["UploadId"])
    except Exception as err:  # noqa: BLE001 - best effort; the upload's own error matters more
        log.warning(
            "could not abort incomplete multipart uploads of s3://%s (%s); a bucket lifecycle "
            "rule AbortIncompleteMultipartUpload removes them",
            path,
            err,
        )


def s3_multipart_uploads(fs: Any, path: str) -> list[dict[str, Any]]:
    """The incomplete multipart uploads (S3's ``Uploads`` entries) of every key that starts
    with ``path``'s (s3fs ``fs``), all pages of the listing."""
    bucket, prefix, _ = fs.split_path(path)
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    found: list[dict[str, Any]] = []
    while True:
        page = fs.call_s3("list_multipart_uploads", **kwargs)
        found.extend(page.get("Uploads", []))
        if not page.get("IsTruncated"):
            return found
        kwargs["KeyMarker"] = page.get("NextKeyMarker")
        kwargs["UploadIdMarker"] = page.get("NextUploadIdMarker")


def s3_abort_upload(fs: Any, path: str, upload_id: str) -> None:
    """Abort the incomplete multipart upload ``upload_id`` of the key at ``path``."""
    bucket, key, _ = fs.split_path(path)
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
