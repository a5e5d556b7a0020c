"""One batch stream: the pass a client asked for, run by a producer thread, its frames handed
to the event loop through at most ``max_inflight`` slots.

NOTE [what a stream is]: ``GET /v1/batches?epoch=E&rank=R&world_size=W&position=P&start=J``
streams rank R's steps J, J+1, ... of the pass of epoch E that begins after P global batches
(P is the loader state's ``position``: 0 for a fresh epoch).  That is a pure function of
(manifest, seed, plan, E, P, W, R), so any replica can serve any part of it, and a client that
lost its connection asks again with J = the first step it has not received.  The pass is the
dataset planned from P (exactly what a local loader resumed at P reads); the first J steps of
this rank are cut from the plan, never read.

A slow client blocks its producer (the slots), so memory stays flat.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.dataset import ShardedDataset
from shardloader.errors import ShardloaderError
from shardloader.loader import make_loader
from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions
from shardloader.service.wire import PROTOCOL, encode_batch, encode_control, frame_size

__all__ = ["Request", "Stream", "needs_serial_pipeline", "pass_dataset", "steps_of_pass", "warm_up"]

log = logging.getLogger(__name__)

# NOTE [serial pipeline]: ShardedDataset seeds torch's, numpy's and random's *global* generators
# from (seed, epoch, global batch) before each batch, for transforms that draw from them
# (DESIGN.md, "Order and split" 6).  With --workers 0 every stream's pipeline runs in a producer
# thread of this one process: a stream that reseeds between another stream's seeding and its
# draws changes that stream's batch, which then differs from a local loader's.  Such pipelines
# take one batch at a time (seed, load, transform, collate under this lock; the loader's first
# step, which draws its base seed from torch's global generator, included).  Pipelines whose
# code draws nothing from the global generators (needs_serial_pipeline) run streams in
# parallel; with workers > 0 each stream's pipeline runs in its own worker processes, and
# nothing is shared.  tests/test_service_serial.py runs concurrent streams both ways.
_SERIAL_PIPELINE = threading.Lock()

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- the pass a stream reads (pure planning over the dataset) ---------------------------------


def pass_dataset(
    dataset: ShardedDataset, epoch: int, position: int, rank: int, world_size: int, skip: int = 0
) -> ShardedDataset:
    """A copy of ``dataset`` reading rank ``rank``'s steps ``skip..`` of the pass from ``position``.

    Batch for batch what a local loader at (epoch, position) yields from its ``skip``-th step,
    padding repeats included: rank ``r``'s step ``j`` of that pass is global slot
    ``position + j * world_size + r``, and padding depends only on the slot.
    """
    view = dataset.for_rank(rank, world_size)
    view.seek(epoch, position + skip * world_size)
    return view


def warm_up(dataset: ShardedDataset) -> None:
    """Read one batch here, before any stream forks workers.

    Lazy imports of the read path (arrow, codecs, image libraries) then happen once in this
    process instead of in every worker of every stream, the first shards are staged, and a
    broken pipeline fails at start, not in a client's epoch.
    """
    if steps_of_pass(dataset, 0, 0, 1) == 0:
        return
    batches = iter(make_loader(pass_dataset(dataset, 0, 0, 0, 1), num_workers=0))
    try:  # no lock: no stream runs yet
        next(batches)
    finally:
        batches.close()  # type: ignore[attr-defined]


def needs_serial_pipeline(dataset: ShardedDataset) -> bool:
    """Whether ``dataset`` runs code that may draw from the global RNGs, so that its streams
    must take turns when they share a process (NOTE [serial pipeline]): a transform, custom
    decoders, or a collate that is not shardloader's own.

    Shardloader's collates and the default decoding draw nothing, and the transforms of
    :mod:`shardloader.vision` draw only from the per-batch generator the dataset hands them
    (NOTE [transform generators]), so a pipeline made of those alone needs no lock.
    """
    if dataset.transform is not None and not _own_transform(dataset.transform):
        return True
    if dataset.decoder is not None and dataset.decoder.custom:
        return True
    collate = dataset.collate_fn
    if collate is None:
        return False
    fn = collate.func if isinstance(collate, functools.partial) else collate
    module = getattr(fn, "__module__", None) or type(fn).__module__
    return not module.startswith("shardloader.")


def _own_transform(t: Any) -> bool:
    """``t`` is one of shardloader's transforms, and so is all it wraps (``Compose.transforms``,
    ``ApplyTo.transform``): they draw only from the generator they are handed, never from the
    global RNGs (NOTE [transform generators])."""
    if not getattr(type(t), "__module__", "").startswith("shardloader."):
        return False
    inner = list(getattr(t, "transforms", ()))
    if getattr(t, "transform", None) is not None:
        inner.append(t.transform)
    return all(_own_transform(x) for x in inner)


def steps_of_pass(dataset: ShardedDataset, epoch: int, position: int, world_size: int) -> int:
    """Steps per rank of the pass of ``epoch`` that begins after ``position`` global batches."""
    view = dataset.for_rank(0, world_size)
    view.seek(epoch, position)
    return len(view)


# -- one stream: producer thread → bounded slots → event loop ---------------------------------


@dataclass(frozen=True)
class Request:
    epoch: int
    rank: int
    world_size: int
    position: int
    start: int
    steps: int


class Stream:
    """One client's batch stream: a producer thread and the frames it has ready."""

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
        self.metrics, self.client, self.loop = metrics, client, loop
        self.ready: asyncio.Queue[tuple[list[Any], bool]] = asyncio.Queue()
        self.slots = threading.Semaphore(options.max_inflight)
        self.stop = threading.Event()
        self.produced = 0  # batch frames handed to the event loop (producer thread writes)
        self.sent = 0  # batch frames written to the client (event loop writes)
        self.next_step = req.start
        self._busy = self._idle = 0.0
        self._busy_since: float | None = None  # the producer waits on the pipeline
        self._idle_since: float | None = None  # the producer waits on the client
        self._thread = threading.Thread(
            target=self._produce, name=f"shardloader-stream-{self.id}", daemon=True
        )

    def labels(self) -> dict[str, Any]:
        r = self.req
        return {
            "stream": self.id,
            "client": self.client,
            "epoch": r.epoch,
            "rank": r.rank,
            "world_size": r.world_size,
        }

    @property
    def lag(self) -> int:
        """Batches ready here that the client has not taken (at most ``max_inflight``)."""
        return max(self.produced - self.sent, 0)

    def times(self) -> tuple[float, float]:
        """(seconds waiting on the pipeline, seconds waiting on the client), ongoing waits in."""
        now = time.monotonic()
        busy_since, idle_since = self._busy_since, self._idle_since
        return (
            self._busy + (now - busy_since if busy_since is not None else 0.0),
            self._idle + (now - idle_since if idle_since is not None else 0.0),
        )

    def busy_share(self) -> float:
        busy, idle = self.times()
        return busy / (busy + idle) if busy + idle > 0 else 0.0

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop producing (the client left or the stream ended); the thread exits on its own."""
        self.stop.set()
        with self.metrics.lock:
            if self.metrics.active.pop(self.id, None) is not None:
                self.metrics.busy_seconds += self._busy
                self.metrics.idle_seconds += self._idle
                self.metrics.streams_done += 1

    # -- producer thread ------------------------------------------------------------------
    def _put(self, chunks: list[Any], last: bool) -> bool:
        self._idle_since = t0 = time.monotonic()
        try:
            while not self.slots.acquire(timeout=0.2):
                if self.stop.is_set():
                    return False
        finally:
            self._idle_since = None
            self._idle += time.monotonic() - t0
        if self.stop.is_set():
            return False
        try:
            self.loop.call_soon_threadsafe(self.ready.put_nowait, (chunks, last))
        except RuntimeError:  # the event loop is gone: the server is shutting down
            return False
        return True

    def _produce(self) -> None:
        r = self.req
        step = r.start
        try:
            if r.start < r.steps:
                view = pass_dataset(
                    self.dataset, r.epoch, r.position, r.rank, r.world_size, r.start
                )
                extra: dict[str, Any] = {"persistent_workers": False}
                if self.options.workers:
                    extra["prefetch_factor"] = self.options.prefetch_factor
                loader = make_loader(view, num_workers=self.options.workers, **extra)
                serial = not self.options.workers and needs_serial_pipeline(view)
                batches = iter(loader)
                try:
                    while not self.stop.is_set():
                        self._busy_since = t0 = time.monotonic()
                        try:
                            if serial:
                                with _SERIAL_PIPELINE:
                                    batch = next(batches)
                            else:
                                batch = next(batches)
                        except StopIteration:
                            break
                        finally:
                            self._busy_since = None
                            self._busy += time.monotonic() - t0
                        if not self._put(encode_batch(step, batch), False):
                            return
                        self.produced += 1
                        step += 1
                finally:
                    batches.close()  # type: ignore[attr-defined]
                    del batches, loader  # shuts the DataLoader's workers down now
            if not self.stop.is_set():
                if step != r.steps:
                    raise ShardloaderError(
                        f"the pipeline ended after step {step - 1} but the pass has {r.steps} "
                        "steps for this rank; the dataset is not deterministic"
                    )
                self._put([encode_control("end", step, steps=r.steps)], True)
        except Exception as err:
            log.warning(
                "stream %d (%s, epoch %d, rank %d/%d) failed at step %d: %s",
                self.id,
                self.client,
                r.epoch,
                r.rank,
                r.world_size,
                step,
                err,
                exc_info=True,
            )
            with self.metrics.lock:
                self.metrics.pipeline_errors += 1
            kind = type(err).__name__ if isinstance(err, ShardloaderError) else "ShardloaderError"
            message = f"{type(err).__name__}: {err}"[:8000]
            self._put([encode_control("error", step, error=kind, message=message)], True)

    # -- event loop -----------------------------------------------------------------------
    async def respond(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI response: frames as they come, pings while none do, until end or disconnect."""
        left = asyncio.ensure_future(_disconnected(receive))
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"application/x-shardloader-frames"),
                        (b"cache-control", b"no-store"),
                        (b"x-shardloader-protocol", str(PROTOCOL).encode()),
                    ],
                }
            )
            while True:
                get = asyncio.ensure_future(self.ready.get())
                done, _ = await asyncio.wait(
                    {get, left},
                    timeout=self.options.ping_interval,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if left in done or not done:
                    get.cancel()
                    if left in done:
                        return
                    await send(
                        {
                            "type": "http.response.body",
                            "more_body": True,
                            "body": encode_control("ping", self.next_step),
                        }
                    )
                    continue
                chunks, last = get.result()
                for chunk in chunks:
                    for piece in _pieces(chunk):
                        await send({"type": "http.response.body", "body": piece, "more_body": True})
                self.slots.release()
                if last:
                    break
                self.sent += 1
                self.next_step += 1
                with self.metrics.lock:
                    self.metrics.batches += 1
                    self.metrics.bytes += frame_size(chunks)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-write
        finally:
            left.cancel()
            self.close()


_PIECE = 1 << 18


def _pieces(chunk: Any) -> Iterator[Any]:
    """A large chunk in 256 KiB slices (views, no copy).

    NOTE: the HTTP layer copies every body it is given (chunked framing), and the event loop's
    transport copies whatever the socket does not take at once.  Pieces the size of a socket
    buffer are mostly taken at once and stay below the allocator's mmap threshold, which on
    9.6 MB image batches halves the server's CPU per batch.
    """
    view = memoryview(chunk)
    if view.nbytes <= _PIECE:
        yield chunk
        return
    view = view.cast("B")
    for start in range(0, view.nbytes, _PIECE):
        yield view[start : start + _PIECE]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
