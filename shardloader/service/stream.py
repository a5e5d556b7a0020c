"""One batch stream: the pass a client asked for, run by a producer thread, its frames handed
to the event loop through at most ``max_inflight`` slots.

NOTE [what a stream is]: ``GET /v1/batches?epoch=E&rank=R&world_size=W&position=P&start=J``
streams rank R's steps J, J+1, ... of the pass of epoch E that begins after P global batches
(P is the loader state's ``position``: 0 for a fresh epoch).  That is a pure function of
(manifest, seed, plan, E, P, W, R), so any replica can serve any part of it, and a client that
lost its connection asks again with J = the first step it has not received.  The pass is the
dataset planned from P (exactly what a local loader resumed at P reads); the first J steps of
this rank are cut from the plan, never read.

A slow client blocks its producer (the slots), so memory stays flat.  The pass itself is
planned in :mod:`shardloader.service.passes`, what the producer hands the event loop in
:mod:`shardloader.service.handoff`, and the event loop's side, the HTTP response, is
:mod:`shardloader.service.response`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.dataset import ShardedDataset
from shardloader.deliver.loader import make_loader
from shardloader.deliver.transport import BUNDLE_BYTES, MAX_BUNDLE
from shardloader.errors import IncompleteEpochError, ShardloaderError
from shardloader.read.loading import pipeline_draws
from shardloader.service.frames import encode_control, frame_size
from shardloader.service.handoff import Frame, Handoff
from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions
from shardloader.service.passes import SERIAL_PIPELINE, pass_dataset
from shardloader.service.response import Receive, Scope, Send, stream_response
from shardloader.service.wire import encode_batches

__all__ = ["Request", "Stream"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What a request asks for: rank ``rank``'s steps ``start..steps`` of the pass of ``epoch``
    after ``position`` global batches, in its world's ``partitions``."""

    epoch: int
    rank: int
    world_size: int
    position: int
    ranks_per_node: int | None  # as the client detected them (NOTE [node partitions])
    partitions: int
    start: int = 0
    steps: int = 0


_END = object()  # what ``_next`` returns once the pipeline has no more items


class Stream:
    """One client's batch stream: a producer thread and the frames it hands to the event loop;
    an ASGI response (starlette calls it like any Response) that writes them.  It counts as
    active in ``metrics`` and produces from its creation until it is closed."""

    _ids = itertools.count(1)

    def __init__(
        self,
        dataset: ShardedDataset,
        req: Request,
        options: ServeOptions,
        metrics: Metrics,
        client: str,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.id = next(self._ids)
        self.dataset, self.req, self.options = dataset, req, options
        self.metrics, self.client = metrics, client
        self.handoff = Handoff(  # NOTE [frame hand-off]
            loop, metrics, options.max_inflight, options.ping_interval, req.start
        )
        self.stop = threading.Event()
        # the producer thread's own: the next step to queue, the batches gathered for one frame
        # and how many a frame carries (1 until the first batch's size is known)
        self._step = req.start
        self._group: list[Any] = []
        self._per_frame = 1
        self._busy = self._idle = 0.0
        self._busy_since: float | None = None  # the producer waits on the pipeline
        self._idle_since: float | None = None  # the producer waits on the client
        with metrics.lock:
            metrics.active[self.id] = self
            metrics.streams += 1
        threading.Thread(
            target=self._produce, name=f"shardloader-stream-{self.id}", daemon=True
        ).start()

    def labels(self) -> dict[str, Any]:
        r = self.req
        return {
            "stream": self.id,
            "client": self.client,
            "epoch": r.epoch,
            "rank": r.rank,
            "world_size": r.world_size,
        }

    def times(self) -> tuple[float, float]:
        """(seconds waiting on the pipeline, seconds waiting on the client), ongoing waits in."""
        now = time.monotonic()
        busy_since, idle_since = self._busy_since, self._idle_since
        return (
            self._busy + (now - busy_since if busy_since is not None else 0.0),
            self._idle + (now - idle_since if idle_since is not None else 0.0),
        )

    def close(self) -> None:
        """Stop producing (the client left or the stream ended); the thread exits on its own."""
        self.stop.set()
        with self.metrics.lock:
            if self.metrics.active.pop(self.id, None) is not None:
                self.metrics.busy_seconds += self._busy
                self.metrics.idle_seconds += self._idle

    # -- producer thread ------------------------------------------------------------------
    def _put(self, chunks: list[Any], last: bool, count: int = 0) -> bool:
        """Queue a frame of ``count`` batches (0: a control frame) for the event loop once its
        permits are free (NOTE [frame hand-off]), the wait counted as idle (False: the stream
        stopped)."""
        self._idle_since = t0 = time.monotonic()
        try:
            return self.handoff.put(Frame(chunks, last, count), self.stop)
        finally:
            self._idle_since = None
            self._idle += time.monotonic() - t0

    def _produce(self) -> None:
        """The producer thread: the pass's frames, then its end (or the error that ended it)."""
        r = self.req
        try:
            if r.start < r.steps:
                at = (r.epoch, r.position, r.rank, r.world_size, r.start, r.ranks_per_node)
                if not self._read_pass(pass_dataset(self.dataset, *at)):
                    return
            if not self.stop.is_set():
                if self._step != r.steps:
                    raise ShardloaderError(
                        f"the pipeline ended after step {self._step - 1} but the pass has "
                        f"{r.steps} steps for this rank; the dataset is not deterministic"
                    )
                self._put([encode_control("end", self._step, steps=r.steps)], True)
        except Exception as err:
            self._fail(self._step, err)

    def _read_pass(self, view: ShardedDataset) -> bool:
        """Run the pass's pipeline over ``view`` and queue its frames (False: the stream
        stopped)."""
        extra: dict[str, Any] = {"persistent_workers": False}
        if self.options.workers:
            extra["prefetch_factor"] = self.options.prefetch_factor
        loader = make_loader(view, num_workers=self.options.workers, **extra)
        serial = not self.options.workers and pipeline_draws(
            view.transform, view.decoder, view.collate_fn
        )  # NOTE [serial pipeline]
        items: Iterator[Any] = iter(loader)
        try:
            return self._drain(items, serial)
        finally:
            items.close()  # type: ignore[attr-defined]
            self._group = []
            del items, loader  # shuts the DataLoader's workers down now

    def _drain(self, items: Iterator[Any], serial: bool) -> bool:
        """Queue the pipeline's batches as frames until it ends (False: the stream stopped)."""
        while not self.stop.is_set():
            batch = self._next(items, serial)
            if batch is _END:
                break
            if not self._batches(batch):
                return False
            del batch
        return self.stop.is_set() or self._flush()

    def _batches(self, batch: Any) -> bool:
        """Gather ``batch`` into a frame of ``_per_frame`` (the pass's last may be short) and
        queue the frame once full (False: the stream stopped)."""
        self._group.append(batch)
        if len(self._group) < self._per_frame and self._step + len(self._group) < self.req.steps:
            return True
        return self._flush()

    def _next(self, items: Iterator[Any], serial: bool) -> Any:
        """The pipeline's next item (``_END`` after the last), the wait counted as busy."""
        self._busy_since = t0 = time.monotonic()
        try:
            with SERIAL_PIPELINE if serial else contextlib.nullcontext():
                return next(items, _END)
        finally:
            self._busy_since = None
            self._busy += time.monotonic() - t0

    def _flush(self) -> bool:
        """Queue the batches gathered so far as one frame (False: the stream stopped).

        NOTE [frames of several batches]: a frame carries consecutive batches, as many as
        fill about :data:`~shardloader.deliver.transport.BUNDLE_BYTES` (judged by the stream's first
        batch, which goes alone) and at most ``max_inflight``, which still bounds the batches
        queued here: per frame the header, the event loop and the client's reader cost tens
        of microseconds, more than a token batch takes to make.  The client
        counts every batch of a frame as a step, so resuming works as with one per frame.
        """
        if not self._group:
            return True
        chunks = encode_batches(self._step, self._group)
        if self._step == self.req.start:  # the pass's first batch, alone: it sizes the frames
            one = max(frame_size(chunks), 1)
            self._per_frame = min(BUNDLE_BYTES // one or 1, MAX_BUNDLE, self.options.max_inflight)
        if not self._put(chunks, False, len(self._group)):
            return False
        self._step += len(self._group)
        self._group = []
        return True

    def _fail(self, step: int, err: Exception) -> None:
        """Tell the client the pass failed at ``step``.

        A ShardloaderError of the pipeline (bad data, a transform's bug) is the data's: every
        replica would raise it, so the client raises it.  Anything else (a worker process
        killed, by the OOM killer or by a SIGTERM to the process group; batches lost on the
        way from the workers; memory) is this process's: the frame says ``transient`` and
        the client goes on at ``step`` on another replica, or here once restarted (NOTE
        [faults] in :mod:`shardloader.service.passreader`)."""
        transient = not isinstance(err, ShardloaderError) or isinstance(err, IncompleteEpochError)
        log.warning(
            "stream %d %s failed at step %d%s: %s",
            self.id,
            self.labels(),
            step,
            " (not the data's fault: the client tries again)" if transient else "",
            err,
            exc_info=True,
        )
        with self.metrics.lock:
            self.metrics.pipeline_errors += 1
        kind = type(err).__name__ if isinstance(err, ShardloaderError) else "ShardloaderError"
        message = f"{type(err).__name__}: {err}"[:8000]
        fields: dict[str, Any] = {"error": kind, "message": message}
        if transient:
            fields["transient"] = True
        self._put([encode_control("error", step, **fields)], True)

    # -- event loop -----------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI response: frames as they come, pings while none do, until end or
        disconnect; the stream closes with it."""
        try:
            await stream_response(self.handoff, scope, receive, send)
        finally:
            self.close()
