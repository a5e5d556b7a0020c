"""The HTTP(S) client (:class:`HttpClient`): GETs over the standard library's ``http.client``,
one attempt each, with a small pool of kept-alive connections per host.

Which redirects it follows and what it carries along is :mod:`~shardloader.storage.redirects`;
the interface it implements and the per-process cache it is kept in are
:mod:`~shardloader.storage.clients`.  A ``deadline`` given to :meth:`HttpClient.get` covers the
response and its body: past it the request's socket is shut down and its reads raise
:func:`~shardloader.storage.deadline.too_slow`.  Reads this client cannot make go through
fsspec's HTTP filesystem, with the timeouts :func:`fill_http_options` gives it.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from shardloader.errors import StorageError, TruncatedBodyError
from shardloader.storage.clients import parse_content_range, request_headers
from shardloader.storage.deadline import Deadline, Guard, arm, too_slow
from shardloader.storage.redirects import REDIRECT_STATUSES, chain_text, next_hop, request_target

if TYPE_CHECKING:
    from shardloader.storage.retry import RetryPolicy

__all__ = ["HttpClient", "fill_http_options", "http_client"]


class _HttpStatusError(OSError):
    """An HTTP response that is not the object: the status decides whether it is retried
    (private: :func:`~shardloader.storage.retry.call_with_retries` turns it into a
    :class:`~shardloader.errors.StorageError`)."""

    def __init__(self, status: int, reason: str, shown: str) -> None:
        super().__init__(f"HTTP {status} {reason} for {shown}")
        self.status = status


class _HopError(OSError):
    """A request that failed after a redirect: names the chain; its cause (a reset, a refused
    connection, a bad host name) still decides whether it is retried."""


_IDLE_PER_HOST = 16
_HTTP_OPTION_KEYS = frozenset({"headers"})


class _HttpBody:
    """The body of one response; the connection goes back to the pool when read to the end
    (unless its deadline fired: that connection is shut down)."""

    def __init__(
        self,
        client: HttpClient,
        origin: tuple[str, str],
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        url: str,
        guard: Guard | None,
    ) -> None:
        self._client = client
        self._origin = origin
        self._conn: http.client.HTTPConnection | None = conn
        self._resp = resp
        length = resp.getheader("Content-Length")
        self.length = int(length) if length and length.isdigit() else None
        self.ranged = resp.status == 206
        self.total = (
            parse_content_range(resp.getheader("Content-Range")) if self.ranged else self.length
        )
        self._left = self.length
        self._url = url
        self._guard = guard
        self._got = 0
        self.status = resp.status  # not 200/206 only where get() was called with any_status
        self.headers = resp.headers
        self.etag: str | None = resp.getheader("ETag")
        self.content_type: str | None = resp.getheader("Content-Type")

    def read(self, n: int) -> bytes:
        if self._conn is None:
            self._end()
            return b""
        if self._left is not None:
            n = min(n, self._left)
            if n == 0:
                self._finish(reuse=True)
                return b""
        try:
            data = self._resp.read(n)
        except BaseException as err:
            self._end(err)
            raise
        if not data:
            self._end()  # a shut-down socket reads as the end of the body
            if self._left is not None:
                raise TruncatedBodyError(
                    f"{self._url}: the body ended {self._left} bytes short of its Content-Length"
                )
            return data  # read to EOF without a length: the server closes the connection
        self._got += len(data)
        if self._left is not None:
            self._left -= len(data)
            if self._left == 0:
                self._finish(reuse=True)
        return data

    def _end(self, err: BaseException | None = None) -> None:
        """The body ended (``err``: by an error): drop the connection, and raise the deadline's
        error where the watchdog cut it off."""
        self._finish()
        if self._guard is not None and self._guard.fired:
            raise too_slow(self._url, self._guard.deadline, self._got) from err

    def readinto(self, buf: memoryview) -> int:
        """Bytes into ``buf``, with no copy past the socket's where the body has no length
        (a chunked stream: the service's frames); 0 at its end."""
        if self._conn is None or self._left is not None:  # read()'s checks
            data = self.read(len(buf))
            buf[: len(data)] = data
            return len(data)
        try:
            got = self._resp.readinto(buf)
        except BaseException as err:
            self._end(err)
            raise
        if not got:
            self._end()
        self._got += got
        return got

    def abort(self) -> None:
        """From another thread: shut the socket down, so a read blocked on it returns."""
        conn = self._conn
        sock = conn.sock if conn is not None else None  # read once: the reader may close it
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)

    def _finish(self, reuse: bool = False) -> None:
        """Done with the connection: back to the pool when ``reuse`` (the body was read to its
        end), else closed (unread bytes, an error, or shut down by the deadline)."""
        conn, self._conn = self._conn, None
        if self._guard is not None:
            self._guard.cancel()
            reuse = reuse and not self._guard.fired
        if conn is not None and reuse:
            self._client._put(self._origin, conn)
        elif conn is not None:
            _close(conn, self._resp)

    def close(self) -> None:
        self._finish(reuse=self._left == 0)


class HttpClient:
    """GETs over the standard library's ``http.client``, with a small pool of kept-alive
    connections per host (shared by threads), redirects followed as
    :mod:`~shardloader.storage.redirects` says, no proxies (like fsspec's HTTP filesystem,
    which does not trust the environment either)."""

    def __init__(self, connect_timeout: float, read_timeout: float, headers: Mapping[str, str]):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.headers = dict(headers)
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None

    def _connect(self, origin: tuple[str, str]) -> http.client.HTTPConnection:
        scheme, netloc = origin
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            return http.client.HTTPSConnection(
                netloc, timeout=self.connect_timeout, context=self._ssl
            )
        return http.client.HTTPConnection(netloc, timeout=self.connect_timeout)

    def _take(self, origin: tuple[str, str]) -> http.client.HTTPConnection | None:
        with self._lock:
            idle = self._idle.get(origin)
            return idle.pop() if idle else None

    def close(self) -> None:
        """Close the kept-alive connections (ones lent out close when their body does)."""
        with self._lock:
            idle, self._idle = self._idle, {}
        for conn in (c for conns in idle.values() for c in conns):
            conn.close()

    def _put(self, origin: tuple[str, str], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < _IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.close()

    def get(
        self,
        url: str,
        start: int = 0,
        stop: int | None = None,
        deadline: Deadline | None = None,
        if_match: str | None = None,
        any_status: bool = False,
    ) -> _HttpBody:
        """One attempt; ``any_status``: a body whatever the (non-redirect) status, for a
        caller that reads its own error answers (the service client)."""
        headers = {**self.headers, **request_headers(start, stop, if_match)}
        chain = [url]
        while True:
            parts = urlsplit(url)  # http(s): the store's protocol, and next_hop's rule
            origin = (parts.scheme.lower(), parts.netloc)
            shown = url if len(chain) == 1 else f"{url} (redirects: {chain_text(chain)})"
            try:
                conn, resp, guard = self._request(origin, request_target(url), headers, deadline)
            except (OSError, http.client.HTTPException) as err:
                if deadline is not None and deadline.left() <= 0:
                    raise too_slow(url, deadline) from err
                if len(chain) > 1:
                    raise _HopError(f"{type(err).__name__}: {err} at {shown}") from err
                raise
            status = resp.status
            location = resp.getheader("Location")
            encoding = resp.getheader("Content-Encoding", "identity")
            if status in REDIRECT_STATUSES and location:
                _close(conn, resp, guard)
                url, headers = next_hop(chain, location, headers)
                continue
            if status not in (200, 206) and not any_status:
                _close(conn, resp, guard)
                raise _HttpStatusError(status, resp.reason, shown)
            if encoding not in ("identity", ""):
                _close(conn, resp, guard)
                raise StorageError(
                    f"{shown}: the server sent the object with Content-Encoding {encoding!r}; "
                    "serve shards as they are stored"
                )
            return _HttpBody(self, origin, conn, resp, shown, guard)

    def _request(
        self,
        origin: tuple[str, str],
        target: str,
        headers: Mapping[str, str],
        deadline: Deadline | None,
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, Guard | None]:
        """Send the request; a kept-alive connection the server closed meanwhile is replaced
        once, at no cost to the retry budget (nothing was received on it).  The deadline's
        guard is armed once the request is sent, so it covers the wait for the response."""
        conn = self._take(origin)
        reused = conn is not None
        while True:
            if conn is None:
                conn = self._connect(origin)
            guard = None
            try:
                conn.request("GET", target, headers=headers)
                if conn.sock is not None:
                    conn.sock.settimeout(self.read_timeout)
                    # shutdown wakes a thread blocked in recv on the socket (close() would not)
                    guard = arm(deadline, partial(conn.sock.shutdown, socket.SHUT_RDWR))
                return conn, conn.getresponse(), guard
            except BaseException as err:
                _close(conn, None, guard)
                retry = isinstance(
                    err, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                )
                if not retry or not reused or (guard is not None and guard.fired):
                    raise
                reused, conn = False, None


def _close(
    conn: http.client.HTTPConnection,
    resp: http.client.HTTPResponse | None,
    guard: Guard | None = None,
) -> None:
    """Close a connection and its response (whose file keeps the socket open otherwise), and
    cancel its deadline's guard."""
    if resp is not None:
        resp.close()
    conn.close()
    if guard is not None:
        guard.cancel()


def http_client(options: Mapping[str, Any], policy: RetryPolicy) -> HttpClient | None:
    """The HTTP(S) client for these fsspec options, or None (fsspec) when they ask for more
    than plain GETs with extra headers (auth objects, client settings, ...)."""
    if set(options) - _HTTP_OPTION_KEYS:
        return None
    headers = options.get("headers") or {}
    if not isinstance(headers, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in headers.items()
    ):
        return None
    return HttpClient(policy.connect_timeout, policy.read_timeout, headers)


def fill_http_options(opts: dict[str, Any], connect: float, read: float) -> None:
    """An aiohttp ``ClientTimeout(sock_connect=..., sock_read=...)`` with no total limit (a large
    shard may take long; a stalled one may not).  fsspec's HTTP filesystem does not retry."""
    import aiohttp

    client = dict(opts.get("client_kwargs") or {})
    client.setdefault(
        "timeout", aiohttp.ClientTimeout(total=None, sock_connect=connect, sock_read=read)
    )
    opts["client_kwargs"] = client
