"""HTTP plumbing of :class:`~shardloader.service.client.RemoteLoader`: one server URL, the
status codes worth another attempt, the wait before it, JSON requests, a server's pipeline error
as the matching :class:`~shardloader.errors.ShardloaderError`.  Plain ``http.client``: the client
side of the service needs no HTTP library.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time
from typing import Any
from urllib.parse import urlencode, urlsplit

from shardloader import errors
from shardloader.errors import ResumeError, ShardloaderError, StorageError, UsageError
from shardloader.storage.retry import RetryPolicy

__all__ = ["Endpoint", "check_status", "get_json", "next_delay", "remote_error"]


class _RetryStatus(ConnectionError):
    """A status another attempt may fix (5xx, 503 busy), with the server's Retry-After."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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


def next_delay(
    policy: RetryPolicy,
    failures: int,
    began: float,
    rng: random.Random,
    err: BaseException,
    url: str,
    what: str,
) -> float:
    """Seconds to wait before the next attempt, or StorageError when the budget is spent."""
    elapsed = time.monotonic() - began
    if failures >= policy.max_attempts or elapsed >= policy.max_total_seconds:
        raise StorageError(
            f"cannot {what} from the service (last {url}): gave up after {failures} "
            f"attempt{'s' if failures != 1 else ''} without progress in {elapsed:.1f} s; last "
            f"cause: {type(err).__name__}: {err}; check that a server runs there, or raise "
            "RemoteLoader(retry=RetryPolicy(...)) limits"
        ) from err
    delay = policy.backoff(failures, rng)
    if isinstance(err, _RetryStatus):
        delay = max(delay, min(err.retry_after, policy.max_backoff))
    return min(delay, max(0.0, policy.max_total_seconds - elapsed))


def check_status(endpoint: Endpoint, resp: http.client.HTTPResponse) -> None:
    if resp.status == 200:
        return
    raw = resp.read(1 << 16)
    try:
        message = str(json.loads(raw).get("error", raw[:300]))
    except (ValueError, AttributeError):
        message = raw[:300].decode("utf-8", "replace")
    where = f"{endpoint.url} answered {resp.status}"
    if resp.status in (429, 500, 502, 503, 504):
        try:
            after = float(resp.getheader("retry-after") or 0)
        except ValueError:
            after = 0.0
        raise _RetryStatus(f"{where}: {message}", after)
    if resp.status == 401:
        raise StorageError(
            f"{where}: {message}; pass RemoteLoader(token=...) with the server's token"
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
) -> dict[str, Any]:
    conn = endpoint.connect(policy)
    try:
        conn.request("GET", f"{endpoint.prefix}{path}?{urlencode(params)}", headers=headers)
        resp = conn.getresponse()
        check_status(endpoint, resp)
        body = json.loads(resp.read())
    except ValueError as err:
        if isinstance(err, ShardloaderError):
            raise
        raise _RetryStatus(f"{endpoint.url}{path} sent a body that is not JSON: {err}") from err
    finally:
        conn.close()
    if not isinstance(body, dict):
        raise _RetryStatus(f"{endpoint.url}{path} sent {type(body).__name__}, not a JSON object")
    return body


def remote_error(url: str, header: dict[str, Any], epoch: int, place: str) -> ShardloaderError:
    """The error a server's pipeline raised, as the same ShardloaderError class when known."""
    name = str(header.get("error", ""))
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, ShardloaderError)):
        cls = ShardloaderError
    return cls(
        f"the pipeline on {url} failed at step {header.get('step')} of epoch {epoch} "
        f"({place}): {header.get('message', 'no message')}"
    )
