"""A deadline that also covers a response body while it arrives.

A socket timeout bounds the time *between* bytes, so a server that sends one byte every few
seconds never trips it.  :class:`Deadline` is the time one call (all attempts of one request
under a :class:`~shardloader.storage.retry.RetryPolicy`) must end by, and :func:`arm` hands the
fast clients a way to enforce it: at the deadline a timer thread of the request calls its
``abort`` (which shuts its socket down), so the read blocked on it returns at once and
the client raises :func:`too_slow`.

NOTE [deadline pauses]: a body whose reader is busy is not the server's fault.  An
:class:`~shardloader.storage.objectstream.ObjectStream` part that waits for room in its buffer
(the reader is behind) pauses its deadline while it waits (:meth:`Deadline.pause`,
:meth:`Deadline.resume`, which moves ``at`` later by the pause), so only time spent waiting on
the server counts.  The timer re-reads the deadline when it comes due: paused, it looks again
later; moved, it waits for the new time.
"""

from __future__ import annotations

import contextlib
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
    """One armed request: a timer thread calls ``abort`` once its deadline passed (``fired``),
    unless the guard is cancelled first."""

    def __init__(self, deadline: Deadline, abort: Callable[[], None]) -> None:
        self.deadline = deadline
        self.abort = abort
        self.fired = False
        self.cancelled = False
        self._wait(deadline.left())

    def _wait(self, seconds: float) -> None:
        self._timer = threading.Timer(max(0.0, seconds), self._due)
        self._timer.daemon = True
        self._timer.name = "shardloader-deadline"
        self._timer.start()

    def _due(self) -> None:
        """The deadline came due: abort, or look again when it was paused or moved."""
        deadline = self.deadline
        if self.cancelled:
            return
        if deadline.paused_since is not None:  # paused: look again later
            self._wait(min(deadline.seconds, 1.0))
        elif deadline.left() > 0:  # moved later by a pause
            self._wait(deadline.left())
        else:
            self.fired = True
            with contextlib.suppress(Exception):  # the socket may be closed already
                self.abort()

    def cancel(self) -> None:
        """The request is over (or its connection goes back to the pool): never abort it."""
        self.cancelled = True
        self._timer.cancel()


def arm(deadline: Deadline | None, abort: Callable[[], None]) -> Guard | None:
    """Call ``abort()`` (from a timer thread) once ``deadline`` passes, unless the guard
    is cancelled first; None without a deadline."""
    if deadline is None:
        return None
    return Guard(deadline, abort)


def too_slow(url: str, deadline: Deadline, received: int | None = None) -> StorageError:
    """The error of a request still unanswered, or a body still arriving, at its deadline."""
    got = "" if received is None else f"; {received:,} bytes of its body had arrived"
    return StorageError(
        f"cannot read {url!r}: the server was still sending when RetryPolicy."
        f"max_total_seconds ({deadline.seconds:g} s) ran out{got}: it answers too slowly; "
        "raise max_total_seconds if it is this slow on purpose (one request, at most "
        "ReadOptions.part_size bytes, must finish within it)"
    )
