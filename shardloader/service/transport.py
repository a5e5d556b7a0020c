"""HTTP plumbing of :class:`~shardloader.service.client.RemoteLoader`: one server URL, the
status codes worth another attempt, the wait before it, JSON requests, a server's pipeline error
as the matching :class:`~shardloader.errors.ShardloaderError`.  Plain ``http.client``: the client
side of the service needs no HTTP library.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlencode, urlsplit

from shardloader import errors
from shardloader.errors import (
    ResumeError,
    ShardloaderError,
    StorageError,
    TruncatedBodyError,
    UsageError,
)
from shardloader.service.fingerprint import differences
from shardloader.storage.classify import describe
from shardloader.storage.retry import RetryPolicy, call_with_retries

__all__ = [
    "Endpoint",
    "Failover",
    "check_status",
    "get_json",
    "remote_error",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


class _ServerUnavailable(ConnectionError):
    """A server fault that another attempt, here or on another replica, may fix: a refused or
    reset connection, a cut stream, 5xx, 503 busy (``retry_after``: the seconds its
    Retry-After asks for), a pipeline that lost its workers (NOTE [faults] in
    :mod:`shardloader.service.passreader`).  A ``ConnectionError``: transient to
    :func:`~shardloader.storage.retry.call_with_retries`."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _LoopStopped(Exception):
    """The loop stopped reading (not a storage error: it passes the retry loop unchanged)."""


class Endpoint:
    """One server URL: ``http(s)://host:port[/prefix]``."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"service URL {url!r} must look like http://host:port")
        if parts.query or parts.fragment:
            raise UsageError(f"service URL {url!r} must not carry a query or fragment")
        self.url = url.rstrip("/")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")

    def connect(self, policy: RetryPolicy) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=policy.connect_timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(policy.read_timeout)  # seconds without a byte, not per stream
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


class Failover:
    """The service client's one retry loop: ``attempt(endpoint)`` on the replicas round-robin,
    from ``first``, under a :class:`~shardloader.storage.retry.RetryPolicy` (through
    :func:`~shardloader.storage.retry.call_with_retries`, the storage calls' loop).

    Each fault moves to the next replica.  A 503 with Retry-After is not an attempt: once
    every replica has said busy, it waits what the last one asked (a little more, spread so
    that turned-away clients do not return at once), within the policy's time budget.
    ``stop`` ends waits and attempts with :class:`_LoopStopped`; ``on_fault(endpoint, err)`` is
    told of each fault.
    """

    def __init__(
        self,
        endpoints: list[Endpoint],
        first: int,
        policy: RetryPolicy,
        stop: threading.Event | None = None,
        on_fault: Callable[[Endpoint, BaseException], None] | None = None,
    ) -> None:
        self.endpoints, self.index, self.policy = endpoints, first, policy
        self.stop = stop or threading.Event()
        self.on_fault = on_fault
        self._rng = random.Random()  # spreads waits in time only: never touches the data order

    def advance(self, endpoint: Endpoint, err: BaseException) -> None:
        """A fault on ``endpoint``: the next attempt goes to the next replica."""
        self.index = (self.index + 1) % len(self.endpoints)
        if self.on_fault is not None:
            self.on_fault(endpoint, err)

    def call(self, attempt: Callable[[Endpoint], T], what: str) -> T:
        """``attempt``'s result; :class:`StorageError` once the policy's attempts or seconds
        are spent, naming every replica, the attempts and the last cause; a ShardloaderError
        ``attempt`` raises (409, 401, a pipeline's own error) at once."""
        began = time.monotonic()
        busy = 0

        def once() -> T:
            nonlocal busy
            while True:
                if self.stop.is_set():
                    raise _LoopStopped()
                endpoint = self.endpoints[self.index]
                try:
                    return attempt(endpoint)
                except (OSError, http.client.HTTPException) as err:
                    if isinstance(err, ShardloaderError) and not isinstance(
                        err, TruncatedBodyError
                    ):
                        raise
                    if self.stop.is_set():
                        raise _LoopStopped() from err
                    self.advance(endpoint, err)
                    after = err.retry_after if isinstance(err, _ServerUnavailable) else 0.0
                    if not after > 0:
                        raise _ServerUnavailable(f"{endpoint.url}: {describe(err)}") from err
                    busy += 1  # busy: Retry-After spends no attempt, only time
                    if busy % len(self.endpoints):
                        continue  # another replica may have room
                    left = self.policy.max_total_seconds - (time.monotonic() - began)
                    if left <= 0:
                        raise _ServerUnavailable(
                            f"{endpoint.url} is still busy after {busy} tries in "
                            f"{time.monotonic() - began:.1f} s: {err}"
                        ) from err
                    self.stop.wait(min(after * self._rng.uniform(1.0, 1.25), left))

        urls = ", ".join(e.url for e in self.endpoints)
        return call_with_retries(once, url=urls, policy=self.policy, what=what)


def check_status(
    endpoint: Endpoint, resp: http.client.HTTPResponse, pipeline: dict[str, Any] | None = None
) -> None:
    """Nothing for 200; else the error the status means (``pipeline``: the description of the
    pipeline the client pinned, to say what a replica's differs in)."""
    if resp.status == 200:
        return
    raw = resp.read(1 << 20)
    try:
        body = json.loads(raw)
        message = str(body.get("error", raw[:300]))
    except (ValueError, AttributeError):
        body, message = {}, raw[:300].decode("utf-8", "replace")
    where = f"{endpoint.url} answered {resp.status}"
    if resp.status in (429, 500, 502, 503, 504):
        try:
            after = float(resp.getheader("retry-after") or 0)
        except ValueError:
            after = 0.0
        raise _ServerUnavailable(f"{where}: {message}", after if resp.status in (429, 503) else 0.0)
    if resp.status == 401:
        raise StorageError(
            f"{where}: {message}; pass RemoteLoader(token=...) with the server's token"
        )
    if resp.status == 409 and "pipeline_spec" in body and pipeline is not None:
        differ = differences(pipeline, body["pipeline_spec"])
        raise ResumeError(
            f"{where}: {message}; what differs (here = the pipeline this client pinned, there = "
            f"{endpoint.url}): {'; '.join(differ) or 'nothing that can be named'}"
        )
    if resp.status == 409:
        raise ResumeError(f"{where}: {message}")
    raise UsageError(f"{where}: {message}")


def get_json(
    endpoint: Endpoint,
    path: str,
    params: dict[str, Any],
    headers: dict[str, str],
    policy: RetryPolicy,
    pipeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One GET of a JSON object (``pipeline``: as :func:`check_status` takes it)."""
    conn = endpoint.connect(policy)
    try:
        conn.request("GET", f"{endpoint.prefix}{path}?{urlencode(params)}", headers=headers)
        resp = conn.getresponse()
        check_status(endpoint, resp, pipeline)
        body = json.loads(resp.read())
    except ValueError as err:
        if isinstance(err, ShardloaderError):
            raise
        where = f"{endpoint.url}{path}"
        raise _ServerUnavailable(f"{where} sent a body that is not JSON: {err}") from err
    finally:
        conn.close()
    if not isinstance(body, dict):
        kind = type(body).__name__
        raise _ServerUnavailable(f"{endpoint.url}{path} sent {kind}, not a JSON object")
    return body


def remote_error(
    url: str, header: dict[str, Any], epoch: int, place: str
) -> ShardloaderError | _ServerUnavailable:
    """The error a server's pipeline raised, as the same ShardloaderError class when known;
    :class:`_ServerUnavailable` where the server marked it transient (its workers died, it is
    shutting down: NOTE [faults] in :mod:`shardloader.service.passreader`)."""
    if header.get("transient"):
        return _ServerUnavailable(
            f"the pipeline on {url} broke at step {header.get('step')} of epoch {epoch} "
            f"({place}), not for the data's sake: {header.get('message', 'no message')}"
        )
    name = str(header.get("error", ""))
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, ShardloaderError)):
        cls = ShardloaderError
    return cls(
        f"the pipeline on {url} failed at step {header.get('step')} of epoch {epoch} "
        f"({place}): {header.get('message', 'no message')}"
    )
