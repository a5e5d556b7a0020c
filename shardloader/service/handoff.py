"""What one stream's producer thread and the event loop share: the frames the producer has ready,
the ``max_inflight`` permits that bound them, and how far the client has been sent.

The producer (:class:`shardloader.service.stream.Stream`) puts frames as permits allow;
the response (:mod:`shardloader.service.response`) takes them, writes them and gives the
permits back.  Neither reads the other's state: this object is all they share.

NOTE [frame hand-off]: the producer appends frames; the response drains them all at once.
Waking the event loop costs a write to its self-pipe and a task switch, more than a forwarded
token bundle's frame, so the producer wakes it only when ``waiting`` says it sleeps (the
response checks ``pending`` again after setting the flag, so a frame appended in between is
not missed).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from dataclasses import dataclass
from typing import Any

from shardloader.service.frames import frame_size
from shardloader.service.metrics import Metrics

__all__ = ["Frame", "Handoff"]


@dataclass(frozen=True)
class Frame:
    """One frame's chunks and its ``count`` batches (0: a control frame); it holds as many of
    the ``max_inflight`` permits (a control frame one) until it is written; after a ``last``
    one the response ends."""

    chunks: list[Any]
    last: bool
    count: int

    @property
    def permits(self) -> int:
        return max(self.count, 1)


class Handoff:
    """The frames of one stream between its producer thread and the event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        metrics: Metrics,
        max_inflight: int,
        ping_interval: float,
        start: int,
    ) -> None:
        self.loop, self.metrics, self.ping_interval = loop, metrics, ping_interval
        self.pending: collections.deque[Frame] = collections.deque()
        self.waiting = False  # the response sleeps until woken (NOTE [frame hand-off])
        self.wake: asyncio.Event | None = None
        self.slots = threading.Semaphore(max_inflight)
        self.produced = 0  # batch frames handed to the event loop (producer thread writes)
        self.sent = 0  # batch frames written to the client (event loop writes)
        self.next_step = start  # the first step the client has not been sent

    @property
    def lag(self) -> int:
        """Batches ready here that the client has not taken."""
        return max(self.produced - self.sent, 0)

    # -- producer thread ------------------------------------------------------------------
    def put(self, frame: Frame, stop: threading.Event) -> bool:
        """Queue ``frame`` once its permits are free, and wake the response if it sleeps
        (False: ``stop`` was set while waiting, or the event loop is gone: the server is
        shutting down)."""
        for _ in range(frame.permits):
            while not self.slots.acquire(timeout=0.2):
                if stop.is_set():
                    return False
        if stop.is_set():
            return False
        self.pending.append(frame)
        if self.waiting:  # NOTE [frame hand-off]: wake the response only when it sleeps
            try:
                self.loop.call_soon_threadsafe(self._nudge)
            except RuntimeError:
                return False
        self.produced += frame.count
        return True

    def _nudge(self) -> None:
        if self.wake is not None:
            self.wake.set()

    # -- event loop -----------------------------------------------------------------------
    def written(self, frame: Frame) -> None:
        """``frame`` went out: its permits come back and its batches count as sent."""
        self.slots.release(frame.permits)
        if not frame.last:
            self.sent += frame.count
            self.next_step += frame.count
            with self.metrics.lock:
                self.metrics.batches += frame.count
                self.metrics.bytes += frame_size(frame.chunks)
