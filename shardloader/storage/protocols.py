"""What shardloader knows about each storage protocol, side by side: s3, http(s), local, memory,
and a generic entry for every other fsspec protocol.

A protocol's :class:`ProtocolDefaults` say how to make its filesystem attempt each request
once, with timeouts from the :class:`~shardloader.storage.retry.RetryPolicy` (so the policy owns
the retries), how to read its errors (which are worth another attempt), and anything its
uploads need.  Out of the box s3fs, botocore and aiohttp each retry on their own, nested (up to
125 attempts for one read timeout), and surface exhausted retries as unrelated exception types;
the entries below switch that off (how, beside each fast client: ``s3client.py``,
``httpclient.py``).

Every storage error is read as one kind (:func:`classify`): ``transient`` and ``throttled`` are
worth another attempt; ``not_found``, ``no_bucket``, ``forbidden``, ``credentials`` and
``permanent`` are not.  A protocol's ``decide`` reads its own errors (S3 error codes, HTTP
statuses) first; generic rules read what any fsspec filesystem raises (timeouts, resets,
``FileNotFoundError``).  A protocol without an entry works (fsspec opens it) with these alone,
its own retries and timeouts left as they are (a warning says so once per process);
``register_protocol`` adds an entry.
"""

from __future__ import annotations

import errno
import http.client
import logging
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsspec.exceptions import FSTimeoutError

from shardloader.errors import ShardloaderError, TruncatedBodyError, UsageError
from shardloader.storage.httpclient import _HttpStatusError, fill_http_options, http_client
from shardloader.storage.s3client import fill_s3_options, prepare_s3fs, s3_client, s3_put_once

if TYPE_CHECKING:
    from shardloader.storage.retry import RetryPolicy

__all__ = [
    "CREDENTIALS",
    "FORBIDDEN",
    "NOT_FOUND",
    "NO_BUCKET",
    "PERMANENT",
    "THROTTLED",
    "TRANSIENT",
    "ProtocolDefaults",
    "chain",
    "classify",
    "describe",
    "fsspec_options",
    "is_storage_error",
    "is_transient",
    "protocol_defaults",
    "protocol_of",
    "register_protocol",
    "status_and_code",
]

log = logging.getLogger(__name__)


# -- kinds, and the generic rules: what any protocol raises ----------------------------------

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


def _from_status(
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


def _decide_generic(e: BaseException) -> str | None:
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


@dataclass(frozen=True)
class ProtocolDefaults:
    """Everything protocol-specific, for the protocols in ``names``.

    - ``fill_options(options, connect_timeout, read_timeout)``: set what is still unset in the
      fsspec options so the filesystem makes one attempt per request, within the timeouts.
    - ``decide(err)``: the kind (``TRANSIENT``, ``THROTTLED``, ...) of one exception of this
      protocol's stack, or None to leave it to the generic rules.
    - ``error_modules``: top-level packages whose exceptions are storage errors (reported with a
      remedy) rather than bugs (passed through).
    - ``prepare(fs)``: adjust a new filesystem instance.  ``put_file(fs, local, path)``: one
      upload attempt, when ``fs.put_file`` is not enough.
    - ``client(options, policy)``: a fast client for streamed and ranged GETs
      (:class:`~shardloader.storage.clients.ObjectClient`), or None when these options need
      the filesystem; its errors are read by ``decide`` too.  Without one, reads go through
      fsspec.
    """

    names: tuple[str, ...]
    fill_options: Callable[[dict[str, Any], float, float], None] | None = None
    decide: Callable[[BaseException], str | None] | None = None
    error_modules: tuple[str, ...] = ()
    prepare: Callable[[Any], None] | None = None
    put_file: Callable[[Any, str, str], None] | None = None
    client: Callable[[Mapping[str, Any], Any], Any] | None = None


# -- what s3's and http's errors mean ---------------------------------------------------------

# S3's error codes by kind.  An error without a body has its HTTP status as its code (botocore's
# parser): from_status reads that status itself.
_S3_CODES = {
    **dict.fromkeys(
        (
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
        ),
        THROTTLED,
    ),
    **dict.fromkeys(
        (
            "InternalError",
            "ServiceUnavailable",
            "RequestTimeout",
            "RequestTimeoutException",
            "OperationAborted",
            "XAmzContentSHA256Mismatch",
            "PriorRequestNotComplete",
            "IncompleteBody",
        ),
        TRANSIENT,
    ),
    **dict.fromkeys(
        (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "ExpiredToken",
            "ExpiredTokenException",
            "InvalidToken",
            "TokenRefreshRequired",
            "InvalidClientTokenId",
            "UnrecognizedClientException",
            "AuthorizationHeaderMalformed",
        ),
        CREDENTIALS,
    ),
    **dict.fromkeys(("NoSuchKey", "NotFound", "NoSuchVersion"), NOT_FOUND),
    "NoSuchBucket": NO_BUCKET,
    "AccessDenied": FORBIDDEN,
}


def _types(module: str, *names: str) -> tuple[type[BaseException], ...]:
    """Exception classes of an optional extra, looked up when an error is classified.

    Only from modules already imported: an exception of a package exists only once that
    package is loaded, and importing botocore and aiohttp here would cost every process that
    never touches s3 or http (pack workers, local datasets) about a second of start-up.
    """
    mod = sys.modules.get(module)
    if mod is None:
        return ()
    return tuple(t for n in names if isinstance(t := getattr(mod, n, None), type))


def _http_decide(e: BaseException) -> str | None:
    if isinstance(e, (_HttpStatusError, *_types("aiohttp", "ClientResponseError"))):
        return _from_status(getattr(e, "status", None))
    if isinstance(e, http.client.HTTPException):  # a garbled or cut response (fast client)
        return TRANSIENT
    if isinstance(e, _types("aiohttp", "ClientPayloadError", "ClientConnectionError")):
        return TRANSIENT
    return None


_BOTOCORE = "botocore.exceptions"


def _s3_decide(e: BaseException) -> str | None:
    client_errors = _types(_BOTOCORE, "ClientError")
    if isinstance(e, client_errors):
        return _from_status(*status_and_code(e), _S3_CODES)
    if isinstance(e, FileNotFoundError | PermissionError) and isinstance(
        e.__cause__, client_errors
    ):  # s3fs's translation of a ClientError: its code tells NoSuchBucket or bad credentials
        return _s3_decide(e.__cause__)
    credentials = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
    if isinstance(e, _types(_BOTOCORE, *credentials)):
        return CREDENTIALS
    transient = (
        "HTTPClientError",
        "ConnectionError",
        "IncompleteReadError",
        "ResponseStreamingError",
    )
    if isinstance(
        e, _types(_BOTOCORE, *transient) + _types("botocore.parsers", "ResponseParserError")
    ):
        return TRANSIENT  # a parser error: throttles may carry bad XML (s3fs #484)
    return _http_decide(e)  # aiobotocore speaks aiohttp


# -- the table --------------------------------------------------------------------------------


def _s3_client(options: Mapping[str, Any], policy: RetryPolicy) -> Any:
    return s3_client(options, fsspec_options("s3://", options, policy))


S3 = ProtocolDefaults(
    ("s3", "s3a"),
    fill_s3_options,
    _s3_decide,
    ("botocore", "aiobotocore", "aiohttp", "s3fs"),
    prepare_s3fs,
    s3_put_once,
    _s3_client,
)
HTTP = ProtocolDefaults(
    ("http", "https"), fill_http_options, _http_decide, ("aiohttp",), client=http_client
)
LOCAL = ProtocolDefaults(("file", "local"))  # plain OS calls: nothing to time out or retry
MEMORY = ProtocolDefaults(("memory",))  # fsspec's in-process store (tests, examples)
GENERIC = ProtocolDefaults(("*",))

_PROTOCOLS: dict[str, ProtocolDefaults] = {}
_WARNED: set[str] = set()


def register_protocol(defaults: ProtocolDefaults, *, replace: bool = False) -> ProtocolDefaults:
    """Make ``defaults`` the entry of each of its protocol names; return it."""
    for name in defaults.names:
        old = _PROTOCOLS.get(name)
        if old is not None and old is not defaults and not replace:
            raise UsageError(f"storage protocol {name!r} has defaults already; pass replace=True")
    for name in defaults.names:
        _PROTOCOLS[name] = defaults
    return defaults


for _entry in (S3, HTTP, LOCAL, MEMORY):
    register_protocol(_entry)


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def protocol_defaults(protocol: str) -> ProtocolDefaults:
    """The entry for ``protocol``, or the generic one (and a warning, once per process)."""
    found = _PROTOCOLS.get(protocol)
    if found is not None:
        return found
    if protocol not in _WARNED:
        _WARNED.add(protocol)
        log.warning(
            "storage protocol %r has no shardloader defaults: its filesystem's own retries and "
            "timeouts stay as they are, and only generic errors (timeouts, resets, missing "
            "files) are classified; shardloader.storage.protocols.register_protocol adds them",
            protocol,
        )
    return GENERIC


def fsspec_options(
    url: str, storage_options: Mapping[str, Any] | None, policy: RetryPolicy
) -> dict[str, Any]:
    """Options to create ``url``'s fsspec filesystem with, so the stack makes one attempt per
    request within ``policy``'s timeouts.

    Starts from fsspec's config for the protocol, then the caller's ``storage_options`` (which
    win, nested ``config_kwargs``/``client_kwargs`` merged key by key), then the protocol's
    ``fill_options`` fill in what is still unset.
    """
    from fsspec.config import conf

    protocol = protocol_of(url)
    opts: dict[str, Any] = dict(conf.get(protocol, {}))
    for key, value in (storage_options or {}).items():
        if key in ("config_kwargs", "client_kwargs") and isinstance(value, Mapping):
            opts[key] = {**dict(opts.get(key) or {}), **value}
        else:
            opts[key] = value
    fill = protocol_defaults(protocol).fill_options
    if fill is not None:
        fill(opts, policy.connect_timeout, policy.read_timeout)
    return opts


# -- classification ---------------------------------------------------------------------------


def classify(err: BaseException, protocol: str) -> str:
    """What kind of failure ``err`` is (one of the kinds above).

    The stack wraps its errors (s3fs turns a botocore ``ClientError`` into an ``OSError`` whose
    cause it is; botocore wraps aiohttp's), so the cause chain is read outermost first and the
    first exception that says something decides.
    """
    decide = protocol_defaults(protocol).decide
    rules = [_decide_generic] if decide is None else [decide, _decide_generic]
    for e in chain(err):
        for rule in rules:
            if (kind := rule(e)) is not None:
                return kind
    return PERMANENT


def is_transient(err: BaseException, protocol: str) -> bool:
    """True when another attempt may succeed (5xx, 429/SlowDown, reset, truncation, timeout)."""
    if isinstance(err, TruncatedBodyError):
        return True
    if isinstance(err, ShardloaderError) or not isinstance(err, Exception):
        return False
    return classify(err, protocol) in (TRANSIENT, THROTTLED)


def is_storage_error(err: BaseException, protocol: str) -> bool:
    """A failure of the store (reported with a remedy), not a bug (passed through as it is)."""
    if isinstance(err, OSError):
        return True
    entry = protocol_defaults(protocol)
    if type(err).__module__.split(".")[0] in entry.error_modules:
        return True
    return entry.decide is not None and entry.decide(err) is not None
