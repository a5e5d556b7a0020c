"""One retry policy for every remote call, and the settings that stop the stack below retrying.

Out of the box s3fs, botocore and aiohttp each retry on their own, nested (up to 125 attempts for
one read timeout, over half an hour for a hung server), and surface exhausted retries as
unrelated exception types.  Here the layers below make a single attempt
(:func:`fsspec_options`), and :func:`call_with_retries` owns the budget: transient faults are
retried with exponential backoff and full jitter, bounded in attempts and in total time; when the
budget is spent the caller gets one :class:`~shardloader.errors.StorageError` naming the URL, the
attempts and the last cause.  Permanent errors (404, 403, bad credentials) fail at once with a
remedy in the message.

Jitter comes from a local, unseeded ``random.Random``: it only spreads requests in time and never
touches the data order.
"""

from __future__ import annotations

import errno
import http.client
import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from shardloader.errors import (
    ObjectNotFoundError,
    ShardloaderError,
    StorageError,
    TruncatedBodyError,
    UsageError,
)

__all__ = [
    "RetryPolicy",
    "DEFAULT_POLICY",
    "TruncatedBodyError",
    "classify",
    "is_transient",
    "call_with_retries",
    "fsspec_options",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How hard to try a remote call before giving up (picklable; crosses into workers).

    A call makes at most ``max_attempts`` attempts; no new attempt starts once
    ``max_total_seconds`` have passed since the first, so a call ends within
    ``max_total_seconds`` plus one attempt (itself bounded by the timeouts while no byte
    arrives).  Before attempt ``n + 1`` it sleeps ``uniform(0, min(max_backoff,
    initial_backoff * 2**(n-1)))`` ("full jitter"), the upper half of that window when the server
    asked to slow down (429, SlowDown).  ``connect_timeout`` and ``read_timeout`` (seconds
    without a byte) are handed to botocore / aiohttp.
    """

    max_attempts: int = 6
    initial_backoff: float = 0.2
    max_backoff: float = 10.0
    max_total_seconds: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise UsageError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise UsageError(
                "RetryPolicy needs 0 <= initial_backoff <= max_backoff, got "
                f"{self.initial_backoff} and {self.max_backoff}"
            )
        for name in ("max_total_seconds", "connect_timeout", "read_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise UsageError(f"RetryPolicy.{name} must be > 0 seconds, got {value}")

    def backoff(self, attempt: int, rng: random.Random, *, throttled: bool = False) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        window = min(self.max_backoff, self.initial_backoff * 2.0 ** (attempt - 1))
        return rng.uniform(window / 2 if throttled else 0.0, window)


DEFAULT_POLICY = RetryPolicy()


# -- classification --------------------------------------------------------------------------

TRANSIENT = "transient"
THROTTLED = "throttled"
NOT_FOUND = "not_found"
NO_BUCKET = "no_bucket"
FORBIDDEN = "forbidden"
CREDENTIALS = "credentials"
PERMANENT = "permanent"

_THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestThrottledException",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "429",
    }
)
_TRANSIENT_CODES = frozenset(
    {
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "RequestTimeoutException",
        "OperationAborted",
        "XAmzContentSHA256Mismatch",
        "PriorRequestNotComplete",
        "IncompleteBody",
    }
)
_CREDENTIAL_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "AuthorizationHeaderMalformed",
        "401",
    }
)
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404", "NoSuchVersion"})


def _optional_types() -> tuple[tuple[type[BaseException], ...], ...]:
    """(transient, credential, client-error, response-error) exception types of installed extras."""
    transient: list[type[BaseException]] = [
        TimeoutError,
        ConnectionError,
        http.client.IncompleteRead,
    ]
    credential: list[type[BaseException]] = []
    client: list[type[BaseException]] = []
    response: list[type[BaseException]] = []
    try:
        from fsspec.exceptions import FSTimeoutError

        transient.append(FSTimeoutError)
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        pass
    try:
        import botocore.exceptions as bx
        from botocore.parsers import ResponseParserError

        transient += [
            bx.HTTPClientError,  # ReadTimeout, ConnectTimeout, ConnectionClosed, ...
            bx.ConnectionError,  # EndpointConnectionError
            bx.IncompleteReadError,
            bx.ResponseStreamingError,
            ResponseParserError,  # throttling replies sometimes carry invalid XML (s3fs #484)
        ]
        credential += [
            bx.NoCredentialsError,
            bx.PartialCredentialsError,
            bx.CredentialRetrievalError,
        ]
        client.append(bx.ClientError)
    except ImportError:
        pass
    try:
        import aiohttp

        transient += [aiohttp.ClientPayloadError, aiohttp.ClientConnectionError]
        response.append(aiohttp.ClientResponseError)
    except ImportError:
        pass
    return tuple(transient), tuple(credential), tuple(client), tuple(response)


_TRANSIENT_TYPES, _CREDENTIAL_TYPES, _CLIENT_ERRORS, _RESPONSE_ERRORS = _optional_types()


def _chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and its causes/contexts, outermost first, each once."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen and len(seen) < 32:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _from_status(status: int | None, code: str = "") -> str | None:
    if code in _THROTTLE_CODES or status == 429:
        return THROTTLED
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status == 408)):
        return TRANSIENT
    if code == "NoSuchBucket":
        return NO_BUCKET
    if code in _NOT_FOUND_CODES or status == 404:
        return NOT_FOUND
    if code in _CREDENTIAL_CODES or status == 401:
        return CREDENTIALS
    if code == "AccessDenied" or status == 403:
        return FORBIDDEN
    if status is not None or code:
        return PERMANENT
    return None


def classify(err: BaseException) -> str:
    """What kind of failure ``err`` is: ``transient``, ``throttled``, ``not_found``,
    ``no_bucket``, ``forbidden``, ``credentials`` or ``permanent``.

    The stack wraps its errors (s3fs turns a botocore ``ClientError`` into an ``OSError`` whose
    cause it is; botocore wraps aiohttp's), so the cause chain is read outermost first and the
    first exception that says something decides.
    """
    for e in _chain(err):
        kind = _decide(e)
        if kind is not None:
            return kind
    return PERMANENT


def _decide(e: BaseException) -> str | None:
    if _CLIENT_ERRORS and isinstance(e, _CLIENT_ERRORS):
        resp: Mapping[str, Any] = getattr(e, "response", None) or {}
        code = str(resp.get("Error", {}).get("Code", ""))
        return _from_status(resp.get("ResponseMetadata", {}).get("HTTPStatusCode"), code)
    if _RESPONSE_ERRORS and isinstance(e, _RESPONSE_ERRORS):
        return _from_status(getattr(e, "status", None))
    if _CREDENTIAL_TYPES and isinstance(e, _CREDENTIAL_TYPES):
        return CREDENTIALS
    if isinstance(e, FileNotFoundError | PermissionError):
        # s3fs's translation of a ClientError: its code tells NoSuchBucket or bad credentials
        if _CLIENT_ERRORS and isinstance(e.__cause__, _CLIENT_ERRORS):
            refined = _decide(e.__cause__)
            if refined is not None:
                return refined
        return NOT_FOUND if isinstance(e, FileNotFoundError) else FORBIDDEN
    if isinstance(e, _TRANSIENT_TYPES):
        return TRANSIENT
    if isinstance(e, OSError) and e.errno in (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE):
        return TRANSIENT
    return None


def is_transient(err: BaseException) -> bool:
    """True when another attempt may succeed (5xx, 429/SlowDown, reset, truncation, timeout)."""
    if isinstance(err, TruncatedBodyError):
        return True
    if isinstance(err, ShardloaderError) or not isinstance(err, Exception):
        return False
    return classify(err) in (TRANSIENT, THROTTLED)


# -- the retry loop ---------------------------------------------------------------------------


class _Backoff:
    """tenacity wait: full jitter from a local RNG, never past the total budget."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.rng = random.Random()  # unseeded on purpose: spreads requests, never orders data

    def __call__(self, state: tenacity.RetryCallState) -> float:
        err = state.outcome.exception() if state.outcome is not None else None
        throttled = err is not None and classify(err) == THROTTLED
        wait = self.policy.backoff(state.attempt_number, self.rng, throttled=throttled)
        left = self.policy.max_total_seconds - (state.seconds_since_start or 0.0)
        return max(0.0, min(wait, left))


def call_with_retries(
    fn: Callable[[], T],
    *,
    url: str,
    policy: RetryPolicy | None = None,
    what: str = "read",
) -> T:
    """Call ``fn()`` under ``policy``; retry transient faults, fail fast on permanent ones.

    ``fn`` makes one attempt with the stack's own retries off (see :func:`fsspec_options`).
    Raises one :class:`StorageError` naming ``url``, the attempts and the last cause when the
    budget is spent; :class:`ObjectNotFoundError` or :class:`StorageError` with a remedy at
    once for permanent errors.  Shardloader's own errors and non-storage exceptions (bugs)
    pass through unchanged.
    """
    policy = policy or DEFAULT_POLICY
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.max_attempts)
        | tenacity.stop_after_delay(policy.max_total_seconds),
        wait=_Backoff(policy),
        retry=tenacity.retry_if_exception(is_transient),
        before_sleep=_log_retry(url, what, policy),
        reraise=False,
    )
    start = time.monotonic()
    try:
        return retrying(fn)
    except tenacity.RetryError as gave_up:
        last = gave_up.last_attempt.exception()
        attempts = gave_up.last_attempt.attempt_number
        elapsed = time.monotonic() - start
        raise StorageError(
            f"cannot {what} {url!r}: gave up after {attempts} attempt"
            f"{'s' if attempts != 1 else ''} in {elapsed:.1f} s (RetryPolicy(max_attempts="
            f"{policy.max_attempts}, max_total_seconds={policy.max_total_seconds})); last "
            f"cause: {_describe(last)}; if the store is overloaded or slow, raise the policy's "
            "limits or timeouts"
        ) from last
    except ShardloaderError:
        raise
    except Exception as err:
        if not _is_storage_error(err):
            raise
        raise _permanent_error(err, url=url, what=what) from err


def _log_retry(
    url: str, what: str, policy: RetryPolicy
) -> Callable[[tenacity.RetryCallState], None]:
    def log(state: tenacity.RetryCallState) -> None:
        err = state.outcome.exception() if state.outcome is not None else None
        sleep = state.next_action.sleep if state.next_action is not None else 0.0
        logger.info(
            "%s %s: attempt %d/%d failed (%s); retrying in %.2f s",
            what,
            url,
            state.attempt_number,
            policy.max_attempts,
            _describe(err) if err is not None else "?",
            sleep,
        )

    return log


def _is_storage_error(err: BaseException) -> bool:
    known: tuple[type[BaseException], ...] = (
        OSError,
        *_CLIENT_ERRORS,
        *_RESPONSE_ERRORS,
        *_CREDENTIAL_TYPES,
    )
    return isinstance(err, known) or (
        type(err).__module__.split(".")[0] in ("botocore", "aiobotocore", "aiohttp", "s3fs")
    )


def _permanent_error(err: BaseException, *, url: str, what: str = "read") -> StorageError:
    """The error to raise, with a remedy, for a failure that another attempt will not fix."""
    kind = classify(err)
    cause = _describe(err)
    if kind == NO_BUCKET:
        bucket = url.split("://", 1)[-1].split("/", 1)[0]
        return ObjectNotFoundError(
            f"cannot {what} {url!r}: bucket {bucket!r} does not exist at this endpoint ({cause}); "
            "check the bucket name, and the endpoint (storage_options endpoint_url or "
            "AWS_ENDPOINT_URL) and region"
        )
    if kind == NOT_FOUND:
        return ObjectNotFoundError(
            f"cannot {what} {url!r}: the object does not exist (HTTP 404: {cause}); check the URL, "
            "and that the data was packed or uploaded there completely"
        )
    if kind == CREDENTIALS:
        return StorageError(
            f"cannot {what} {url!r}: the credentials are missing or were rejected ({cause}); set "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass "
            "storage_options={'key': ..., 'secret': ...}; for a public bucket pass "
            "storage_options={'anon': True}"
        )
    if kind == FORBIDDEN:
        return StorageError(
            f"cannot {what} {url!r}: access denied (HTTP 403: {cause}); check which credentials "
            "are in use (AWS_PROFILE, AWS_ACCESS_KEY_ID or storage_options key/secret) and that "
            "the bucket policy grants them this operation on this key"
        )
    return StorageError(f"cannot {what} {url!r}: {cause} (a permanent error; not retried)")


def _describe(err: BaseException | None) -> str:
    """``Type: message`` of ``err``, plus its innermost cause when that says more."""
    if err is None:
        return "unknown error"
    chain = list(_chain(err))
    out = f"{type(err).__name__}: {_short(err)}"
    root = chain[-1]
    if root is not err:
        out += f" (from {type(root).__name__}: {_short(root)})"
    return out


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 240 else text[:237] + "..."


# -- the layers below: one attempt each ---------------------------------------------------------


def fsspec_options(
    url: str, storage_options: Mapping[str, Any] | None = None, policy: RetryPolicy | None = None
) -> dict[str, Any]:
    """Options to create ``url``'s fsspec filesystem with, so the stack makes one attempt.

    Starts from fsspec's config for the protocol, then the caller's ``storage_options`` (which
    win, nested ``config_kwargs``/``client_kwargs`` merged key by key), then fills in what is
    still unset:

    - ``s3://``: botocore ``config_kwargs={"retries": {"total_max_attempts": 1, "mode":
      "standard"}, "connect_timeout": ..., "read_timeout": ...}`` (``{"max_attempts": 1}`` would
      still allow one retry: botocore counts it without the first attempt).  s3fs's own retry
      loop is switched off on the instance by :func:`shardloader.storage.fs.filesystem`; the
      endpoint and credentials are left to botocore, which already reads ``AWS_ENDPOINT_URL``,
      ``AWS_ENDPOINT_URL_S3``, profiles and the usual variables.
    - ``http(s)://``: an aiohttp ``ClientTimeout(sock_connect=..., sock_read=...)`` with no total
      limit (a large shard may take long; a stalled one may not).
    """
    policy = policy or DEFAULT_POLICY
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        from fsspec.config import conf
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        conf = {}
    opts: dict[str, Any] = dict(conf.get(protocol, {}))
    for key, value in (storage_options or {}).items():
        if key in ("config_kwargs", "client_kwargs") and isinstance(value, Mapping):
            opts[key] = {**dict(opts.get(key) or {}), **value}
        else:
            opts[key] = value
    if protocol in ("s3", "s3a"):
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", policy.connect_timeout)
        config.setdefault("read_timeout", policy.read_timeout)
        opts["config_kwargs"] = config
    elif protocol in ("http", "https"):
        import aiohttp

        client = dict(opts.get("client_kwargs") or {})
        client.setdefault(
            "timeout",
            aiohttp.ClientTimeout(
                total=None, sock_connect=policy.connect_timeout, sock_read=policy.read_timeout
            ),
        )
        opts["client_kwargs"] = client
    return opts
