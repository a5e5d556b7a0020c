"""The service client's failover over its replicas: one server URL, the answers worth another
attempt, the wait before it, a JSON request, a server's pipeline error as the matching
:class:`~shardloader.errors.ShardloaderError`.  The HTTP itself (kept-alive connections,
timeouts, streamed bodies) is the storage layer's :class:`~shardloader.storage.httpclient.
HttpClient`: the library has one HTTP client.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar
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
from shardloader.storage.httpclient import HttpClient
from shardloader.storage.protocols import describe
from shardloader.storage.retry import RetryPolicy, call_with_retries

if TYPE_CHECKING:
    from shardloader.service.client import RemoteLoader

__all__ = ["Failover", "check_status", "get_json", "remote_error", "service_url"]

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


def service_url(url: str) -> str:
    """``url`` checked to be ``http(s)://host:port[/prefix]``, without a trailing slash."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"service URL {url!r} must look like http://host:port")
    if parts.query or parts.fragment:
        raise UsageError(f"service URL {url!r} must not carry a query or fragment")
    return url.rstrip("/")


class Failover:
    """The service client's one retry loop: ``attempt(url)`` on ``loader``'s replicas
    round-robin, from the rank's own, under the loader's
    :class:`~shardloader.storage.retry.RetryPolicy` (through
    :func:`~shardloader.storage.retry.call_with_retries`, the storage calls' loop).

    Each fault moves to the next replica (logged, and counted in ``loader.reconnects``).  A 503
    with Retry-After is not an attempt: once every replica has said busy, it waits what the
    last one asked (a little more, spread so that turned-away clients do not return at once),
    within the policy's time budget.  ``stop`` ends waits and attempts with
    :class:`_LoopStopped`.
    """

    def __init__(self, loader: RemoteLoader, stop: threading.Event | None = None) -> None:
        self.loader, self.endpoints = loader, loader.urls
        self.index = loader.rank % len(self.endpoints)
        self.policy: RetryPolicy = loader.retry
        self.stop = stop or threading.Event()
        self._rng = random.Random()  # spreads waits in time only: never touches the data order

    def advance(self, endpoint: str, err: BaseException) -> None:
        """A fault on ``endpoint``: the next attempt goes to the next replica."""
        self.index = (self.index + 1) % len(self.endpoints)
        log.info("%s: %s: %s; trying the next replica", endpoint, type(err).__name__, err)
        self.loader.reconnects += 1

    def call(self, attempt: Callable[[str], T], what: str) -> T:
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
                        raise _ServerUnavailable(f"{endpoint}: {describe(err)}") from err
                    busy += 1  # busy: Retry-After spends no attempt, only time
                    if busy % len(self.endpoints):
                        continue  # another replica may have room
                    left = self.policy.max_total_seconds - (time.monotonic() - began)
                    if left <= 0:
                        raise _ServerUnavailable(
                            f"{endpoint} is still busy after {busy} tries in "
                            f"{time.monotonic() - began:.1f} s: {err}"
                        ) from err
                    self.stop.wait(min(after * self._rng.uniform(1.0, 1.25), left))

        return call_with_retries(once, url=", ".join(self.endpoints), policy=self.policy, what=what)


def check_status(url: str, body: Any, pipeline: dict[str, Any] | None = None) -> None:
    """Nothing for 200; else the error the status of ``body`` (an
    :class:`~shardloader.storage.httpclient.HttpClient` body) means (``pipeline``: the
    description of the pipeline the client pinned, to say what a replica's differs in)."""
    if body.status == 200:
        return
    raw = body.read(1 << 20)
    body.close()
    try:
        answer = json.loads(raw)
        message = str(answer.get("error", raw[:300]))
    except (ValueError, AttributeError):
        answer, message = {}, raw[:300].decode("utf-8", "replace")
    where = f"{url} answered {body.status}"
    if body.status in (429, 500, 502, 503, 504):
        try:
            after = float(body.headers.get("retry-after") or 0)
        except ValueError:
            after = 0.0
        raise _ServerUnavailable(f"{where}: {message}", after if body.status in (429, 503) else 0.0)
    if body.status == 401:
        raise StorageError(
            f"{where}: {message}; pass RemoteLoader(token=...) with the server's token"
        )
    if body.status == 409:
        if "pipeline_spec" in answer and pipeline is not None:
            differ = "; ".join(differences(pipeline, answer["pipeline_spec"]))
            message += f"; what differs (here = the pipeline this client pinned, there = {url}): "
            message += differ or "nothing that can be named"
        raise ResumeError(f"{where}: {message}")
    raise UsageError(f"{where}: {message}")


def get_json(
    client: HttpClient,
    url: str,
    params: dict[str, Any],
    pipeline: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One GET of a JSON object at ``url`` (``pipeline``: as :func:`check_status` takes it)."""
    body = client.get(f"{url}?{urlencode(params)}", any_status=True)
    try:
        check_status(url, body, pipeline)
        answer = json.loads(b"".join(iter(functools.partial(body.read, 1 << 20), b"")))
    except ValueError as err:
        if isinstance(err, ShardloaderError):
            raise
        raise _ServerUnavailable(f"{url} sent a body that is not JSON: {err}") from err
    finally:
        body.close()
    if not isinstance(answer, dict):
        raise _ServerUnavailable(f"{url} sent {type(answer).__name__}, not a JSON object")
    return answer


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
