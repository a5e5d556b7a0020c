"""A deadline that also covers a response body while it arrives.

A socket timeout bounds the time *between* bytes, so a server that sends one byte every few
seconds never trips it.  :class:`Deadline` is the time one call (all attempts of one request
under a :class:`~shardloader.storage.retry.RetryPolicy`) must end by, and :func:`arm` hands the
fast clients a way to enforce it: at the deadline one watchdog thread per process calls the
request's ``abort`` (which shuts its socket down), so the read blocked on it returns at once and
the client raises :func:`too_slow`.

NOTE [deadline pauses]: a body whose reader is busy is not the server's fault.  An
:class:`~shardloader.storage.objectstream.ObjectStream` part that waits for room in its buffer
(the reader is behind) pauses its deadline while it waits (:meth:`Deadline.pause`,
:meth:`Deadline.resume`, which moves ``at`` later by the pause), so only time spent waiting on
the server counts.  The watchdog re-reads the deadline when one comes due: paused, it looks again
later; moved, it files it under the new time.
"""

from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from collections.abc import Callable

from shardloader.errors import StorageError

__all__ = ["Deadline", "Guard", "arm", "too_slow"]


class Deadline:
    """``at``: the ``time.monotonic()`` by which a call of ``seconds`` must end."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.paused_since: float | None = None

    def left(self) -> float:
        return self.at - time.monotonic()

    def pause(self) -> None:
        """Stop the clock (NOTE [deadline pauses])."""
        if self.paused_since is None:
            self.paused_since = time.monotonic()

    def resume(self) -> None:
        """Start the clock again: the deadline moves later by the pause."""
        since, self.paused_since = self.paused_since, None
        if since is not None:
            self.at += time.monotonic() - since


class Guard:
    """One armed request: ``fired`` once its deadline passed and ``abort`` was called."""

    __slots__ = ("abort", "cancelled", "deadline", "fired")

    def __init__(self, deadline: Deadline, abort: Callable[[], None]) -> None:
        self.deadline = deadline
        self.abort = abort
        self.fired = False
        self.cancelled = False

    def cancel(self) -> None:
        """The request is over (or its connection goes back to the pool): never abort it."""
        self.cancelled = True


class _Watchdog:
    """One daemon thread that aborts the requests whose deadline passed."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.heap: list[tuple[float, int, Guard]] = []
        self.seq = itertools.count()
        self.thread: threading.Thread | None = None

    def arm(self, guard: Guard) -> None:
        with self.cond:
            heapq.heappush(self.heap, (guard.deadline.at, next(self.seq), guard))
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, daemon=True, name="shardloader-deadline"
                )
                self.thread.start()
            self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                guard = self._next_due()
            try:
                guard.abort()
            except Exception:  # noqa: BLE001 - the socket may be closed already
                pass

    def _next_due(self) -> Guard:
        """Wait (holding the condition) until an armed guard is due; mark and return it."""
        while True:
            while self.heap and self.heap[0][2].cancelled:
                heapq.heappop(self.heap)
            if not self.heap:
                self.cond.wait()
                continue
            at, _, guard = self.heap[0]
            deadline = guard.deadline
            if deadline.at > at:  # moved by a pause: file it under its new time
                heapq.heapreplace(self.heap, (deadline.at, next(self.seq), guard))
                continue
            now = time.monotonic()
            if at > now:
                self.cond.wait(at - now)
                continue
            if deadline.paused_since is not None:  # due, but paused: look again later
                again = now + min(deadline.seconds, 1.0)
                heapq.heapreplace(self.heap, (again, next(self.seq), guard))
                continue
            heapq.heappop(self.heap)
            guard.fired = True
            return guard


_WATCHDOG = _Watchdog()


def _after_fork() -> None:  # the thread did not survive the fork; its lock may look held
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def arm(deadline: Deadline | None, abort: Callable[[], None]) -> Guard | None:
    """Call ``abort()`` (from the watchdog thread) once ``deadline`` passes, unless the guard
    is cancelled first; None without a deadline."""
    if deadline is None:
        return None
    guard = Guard(deadline, abort)
    _WATCHDOG.arm(guard)
    return guard


def too_slow(url: str, deadline: Deadline, received: int | None = None) -> StorageError:
    """The error of a request still unanswered, or a body still arriving, at its deadline."""
    got = "" if received is None else f"; {received:,} bytes of its body had arrived"
    return StorageError(
        f"cannot read {url!r}: the server was still sending when RetryPolicy."
        f"max_total_seconds ({deadline.seconds:g} s) ran out{got}: it answers too slowly; "
        "raise max_total_seconds if it is this slow on purpose (one request, at most "
        "ReadOptions.part_size bytes, must finish within it)"
    )
