"""What kind of failure a storage error is, from what any protocol raises.

Kinds: ``transient`` and ``throttled`` are worth another attempt; ``not_found``, ``no_bucket``,
``forbidden``, ``credentials`` and ``permanent`` are not.  This module knows the exceptions
every fsspec filesystem may raise (timeouts, resets, ``FileNotFoundError``); what a protocol
adds (S3 error codes, HTTP statuses) lives with its defaults in
:mod:`shardloader.storage.protocols`, which asks this module last.
"""

from __future__ import annotations

import errno
import http.client
from collections.abc import Iterator, Mapping

from fsspec.exceptions import FSTimeoutError

__all__ = [
    "CREDENTIALS",
    "FORBIDDEN",
    "NOT_FOUND",
    "NO_BUCKET",
    "PERMANENT",
    "THROTTLED",
    "TRANSIENT",
    "chain",
    "decide_generic",
    "describe",
    "from_status",
    "status_and_code",
]

TRANSIENT = "transient"
THROTTLED = "throttled"
NOT_FOUND = "not_found"
NO_BUCKET = "no_bucket"
FORBIDDEN = "forbidden"
CREDENTIALS = "credentials"
PERMANENT = "permanent"


_TRANSIENT_TYPES = (TimeoutError, ConnectionError, http.client.IncompleteRead, FSTimeoutError)
_TRANSIENT_ERRNOS = (errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE)


def chain(err: BaseException) -> Iterator[BaseException]:
    """``err`` and its causes/contexts, outermost first, each once."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen and len(seen) < 32:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def status_and_code(err: BaseException) -> tuple[int | None, str]:
    """The HTTP status and the service's error code ``err`` carries: botocore's ``response``
    (``ResponseMetadata.HTTPStatusCode``, ``Error.Code``), else an HTTP client's ``status``."""
    response = getattr(err, "response", None)
    if isinstance(response, Mapping):
        code = response.get("Error", {}).get("Code")
        return response.get("ResponseMetadata", {}).get("HTTPStatusCode"), str(code or "")
    return getattr(err, "status", None), ""


def from_status(
    status: int | None, code: str = "", codes: Mapping[str, str] | None = None
) -> str | None:
    """The kind an HTTP status says, refined by a service's error ``code`` (``codes`` maps the
    service's codes to kinds: S3's ``SlowDown`` is ``throttled`` whatever the status)."""
    by_code = (codes or {}).get(code)
    if by_code == THROTTLED or status == 429:
        return THROTTLED
    if by_code == TRANSIENT or (status is not None and (status >= 500 or status == 408)):
        return TRANSIENT
    if by_code == NO_BUCKET:
        return NO_BUCKET
    if by_code == NOT_FOUND or status == 404:
        return NOT_FOUND
    if by_code == CREDENTIALS or status == 401:
        return CREDENTIALS
    if by_code == FORBIDDEN or status == 403:
        return FORBIDDEN
    if status is not None or code:
        return PERMANENT
    return None


def decide_generic(e: BaseException) -> str | None:
    """The kind of one exception any filesystem may raise, or None when it says nothing."""
    if isinstance(e, FileNotFoundError):
        return NOT_FOUND
    if isinstance(e, PermissionError):
        return FORBIDDEN
    if isinstance(e, _TRANSIENT_TYPES):
        return TRANSIENT
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return TRANSIENT
    return None


def describe(err: BaseException | None) -> str:
    """``Type: message`` of ``err``, plus its innermost cause when that says more."""
    if err is None:
        return "unknown error"
    causes = list(chain(err))
    out = f"{type(err).__name__}: {_short(err)}"
    root = causes[-1]
    if root is not err:
        out += f" (from {type(root).__name__}: {_short(root)})"
    return out


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 240 else text[:237] + "..."
