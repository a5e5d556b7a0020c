"""How long the service keeps a connection it is not being served by: header, idle and write
timeouts, and a cap on connections that have not sent a request.

uvicorn alone keeps a connection open for as long as its client likes while the request head is
incomplete, and for as long as a response cannot be written: anyone who can reach the port
held every file descriptor with half-sent headers (before any token is checked), and two
clients that stopped reading held both ``--max-clients`` streams.  :func:`guarded_protocol`
is uvicorn's h11 protocol with the rules nginx applies (``client_header_timeout``,
``keepalive_timeout``, ``send_timeout``).

NOTE [connection rules]
    1. *Waiting*: from its start, and again after each response, a connection waits for a
       request head.  It must complete one within ``header_timeout`` seconds (a new
       connection) or ``idle_timeout`` seconds (between requests), counted from the start of
       the wait, not from the last byte: dripping a byte at a time does not extend it.
    2. At most ``max_waiting`` connections wait at once (a quarter of the process's file
       descriptor limit): one more closes the one that has waited longest.  A client that
       sends its request at once waits for milliseconds, so half-open connections, however
       many, push out each other, not the clients that ask.
    3. *Writing*: once the socket and the event loop's buffer are full (the client reads
       nothing), the client must take some bytes within ``write_timeout`` seconds, or the
       connection is aborted.  A stream's client then reconnects and asks for the first step
       it lacks (NOTE [faults] in :mod:`shardloader.service.passreader`); its
       ``--max-clients`` slot is free at once.
    4. A request refused for its token is answered with ``connection: close``, so a client
       without the token holds a connection only while it waits (rules 1 and 2).
    Aborting, not closing: ``close()`` would wait for the unread buffer to drain, forever.
"""

from __future__ import annotations

import asyncio
import collections
import resource
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions

__all__ = ["ConnectionRules", "guarded_protocol", "waiting_cap"]


class ConnectionRules:
    """The timeouts and cap of NOTE [connection rules], and the connections waiting now (one
    event loop's)."""

    def __init__(self, options: ServeOptions, metrics: Metrics) -> None:
        self.options, self.metrics = options, metrics
        self.max_waiting = waiting_cap()
        self.waiting: collections.OrderedDict[Any, None] = collections.OrderedDict()

    def wait(self, conn: Any) -> None:
        """``conn`` waits for a request head now (rule 2: the longest waiting one may go)."""
        self.waiting.pop(conn, None)
        while len(self.waiting) >= self.max_waiting:
            oldest, _ = self.waiting.popitem(last=False)
            oldest.drop("evicted")
        self.waiting[conn] = None

    def served(self, conn: Any) -> None:
        self.waiting.pop(conn, None)

    def count(self, reason: str) -> None:
        with self.metrics.lock:
            closed = self.metrics.connections_closed
            closed[reason] = closed.get(reason, 0) + 1


def waiting_cap() -> int:
    """Rule 2's cap: a quarter of the soft file descriptor limit (at least 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, soft // 4)


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol under NOTE [connection rules] (``rules`` set per server)."""

    rules: ConnectionRules

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None
        self._buffered = 0
        self._lost = False
        self._wait(self.rules.options.header_timeout, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self.rules.served(self)
        _cancel(self._timer, self._stalled)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived: it is being served
            self.rules.served(self)
            _cancel(self._timer)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():  # before super(): a pipelined request may follow
            self._wait(self.rules.options.idle_timeout, "idle_timeout")
        super().on_response_complete()

    # -- rule 1 and 2 -------------------------------------------------------------------
    def _wait(self, seconds: float, reason: str) -> None:
        _cancel(self._timer)
        self._timer = self.loop.call_later(seconds, self.drop, reason)
        self.rules.wait(self)

    def drop(self, reason: str) -> None:
        """Abort the connection (``reason`` counted in ``/metrics``)."""
        self.rules.served(self)
        _cancel(self._timer)
        if not self._lost:
            self.rules.count(reason)
            self.transport.abort()

    # -- rule 3 -------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._buffered = self.transport.get_write_buffer_size()
        _cancel(self._stalled)
        self._stalled = self.loop.call_later(self.rules.options.write_timeout, self._check_writes)

    def resume_writing(self) -> None:
        _cancel(self._stalled)
        super().resume_writing()

    def _check_writes(self) -> None:
        now = self.transport.get_write_buffer_size()
        if now >= self._buffered:  # the client took nothing in write_timeout seconds
            self.drop("write_timeout")
            return
        self._buffered = now
        self._stalled = self.loop.call_later(self.rules.options.write_timeout, self._check_writes)


def _cancel(*timers: asyncio.TimerHandle | None) -> None:
    """Cancel the timers that are set (cancelling a spent one does nothing)."""
    for timer in timers:
        if timer is not None:
            timer.cancel()


def guarded_protocol(options: ServeOptions, metrics: Metrics) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)`` for one server."""
    rules = ConnectionRules(options, metrics)
    return type("GuardedH11Protocol", (_Guarded,), {"rules": rules})
