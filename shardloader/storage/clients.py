"""Fast clients for the requests that move shard bytes: one GET of a whole object or of a byte
range, streamed.  fsspec stays for everything else (listings, writes, the long tail of
protocols); a protocol offers a client through its defaults
(:attr:`~shardloader.storage.protocols.ProtocolDefaults.client`), and a store whose options the
client does not understand falls back to fsspec.

This module holds what every client shares: the interface (:class:`ObjectClient`, which
returns a :class:`Body`), the request's headers and the Range answer, and the per-process cache of
clients.  The clients themselves: HTTP(S) in :mod:`shardloader.storage.httpclient`, S3 in
:mod:`shardloader.storage.s3client`.

Each :meth:`ObjectClient.get` is *one attempt* (no retries inside, timeouts from the policy):
:class:`~shardloader.storage.objectstream.ObjectStream` spends the one
:class:`~shardloader.storage.retry.RetryPolicy` budget around it, and the protocol's ``decide``
reads its errors.

Clients are made lazily in each process and cached there (by protocol, options and policy);
a forked child makes its own, as with fsspec's filesystems.

A ``deadline`` (:class:`~shardloader.storage.deadline.Deadline`) given to ``get`` covers the
response and its body: past it the request's socket is shut down and its reads raise
:func:`~shardloader.storage.deadline.too_slow`, however steadily the server drips bytes.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from shardloader.storage.deadline import Deadline

if TYPE_CHECKING:
    from shardloader.storage.retry import RetryPolicy

__all__ = ["Body", "ObjectClient", "client_for", "request_headers"]


class Body(Protocol):
    """One response body.  ``ranged``: the server answered the byte range asked for (206);
    False means the body is the whole object from byte 0.  ``total``: the object's size when
    the response says it.  ``length``: the bytes this body carries, when known.  Optional
    (a client may leave them out): ``etag``, the version of the object it is (what a resumed
    request sends as ``If-Match``), and ``content_type``."""

    ranged: bool
    total: int | None
    length: int | None

    def read(self, n: int) -> bytes: ...

    def close(self) -> None: ...


class ObjectClient(Protocol):
    """GETs of one protocol, one attempt each."""

    def get(
        self,
        url: str,
        start: int = 0,
        stop: int | None = None,
        deadline: Deadline | None = None,
        if_match: str | None = None,
    ) -> Body:
        """Bytes ``[start, stop)`` of ``url`` (``stop`` None: to the end; ``start == 0`` and
        ``stop`` None: a plain GET without a Range header), within ``deadline``; with
        ``if_match``, only of that version of the object (else HTTP 412)."""
        ...


def request_headers(start: int, stop: int | None, if_match: str | None) -> dict[str, str]:
    """The ``Range`` (``bytes=start-(stop-1)``; none for the whole object) and ``If-Match``
    headers of :meth:`ObjectClient.get`'s request."""
    headers = {}
    if start or stop is not None:
        headers["Range"] = f"bytes={start}-" if stop is None else f"bytes={start}-{stop - 1}"
    if if_match is not None:
        headers["If-Match"] = if_match
    return headers


def parse_content_range(value: str | None) -> int | None:
    """The total of ``bytes a-b/total`` (None when absent or ``*``)."""
    if not value or "/" not in value:
        return None
    total = value.rsplit("/", 1)[1].strip()
    return int(total) if total.isdigit() else None


# -- the per-process cache ----------------------------------------------------------------------

_CLIENTS: dict[tuple[Any, ...], Any] = {}
_PID = os.getpid()
_LOCK = threading.Lock()


def client_for(
    protocol: str,
    options: Mapping[str, Any],
    policy: RetryPolicy,
    make: Callable[[Mapping[str, Any], RetryPolicy], Any],
) -> Any:
    """This process's client for (protocol, options, policy), made by ``make`` on first use
    (``make`` may return None: fall back to fsspec; that answer is cached too)."""
    global _PID
    try:
        opts = json.dumps(options, sort_keys=True, default=repr)
    except (TypeError, ValueError):
        opts = repr(sorted(options.items(), key=lambda kv: str(kv[0])))
    # The environment a client reads when it is made (endpoint, credentials, profile) is part
    # of the key: a changed variable makes a new client, as a new process would.
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (protocol, opts, policy, env)
    with _LOCK:  # threads asking at once (read-ahead) wait for one client, not make one each
        if os.getpid() != _PID:  # a forked child: connections belong to the parent
            _CLIENTS.clear()
            _PID = os.getpid()
        if key not in _CLIENTS:
            _CLIENTS[key] = make(options, policy)
        return _CLIENTS[key]


def clear_clients() -> None:
    """Close and forget this process's clients (tests that change the environment call it)."""
    with _LOCK:
        clients = list(_CLIENTS.values())
        _CLIENTS.clear()
    for client in clients:
        getattr(client, "close", lambda: None)()
