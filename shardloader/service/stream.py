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
import collections
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
from shardloader.samples import pipeline_draws
from shardloader.service.encoded import Encoded, EncodeInWorker
from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions
from shardloader.service.ring import Arrived, SharedRing, ring_maker
from shardloader.service.shm import WAIT_SECONDS, Segment
from shardloader.service.wireencode import (
    encode_batches,
    encode_control,
    encode_forward,
    encode_header,
)
from shardloader.service.wireframes import PROTOCOL, frame_size
from shardloader.transport import BUNDLE_BYTES, MAX_BUNDLE, unbundle, worker_bundle

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
    decoders, or a collate that is not shardloader's own (:func:`shardloader.samples.
    pipeline_draws`, the rule the dataset seeds by)."""
    return pipeline_draws(dataset.transform, dataset.decoder, dataset.collate_fn)


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
    shm: bool = False  # the client asked for the shared-memory handover (NOTE [shm handover])


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
        # NOTE [frame hand-off]: the producer appends frames; the response drains them all
        # at once.  Waking the event loop costs a write to its self-pipe and a task switch,
        # more than a forwarded token bundle's frame, so the producer wakes it only when
        # ``waiting`` says it sleeps (it checks ``pending`` again after setting the flag, so
        # a frame appended in between is not missed).
        self.pending: collections.deque[tuple[list[Any], bool, int, int]] = collections.deque()
        self.waiting = False
        self._wake: asyncio.Event | None = None
        self.segment: Segment | None = None  # the stream's shared memory, once made
        self.ring: SharedRing | None = None  # its workers' ring, when the client can map it
        self.encoded = 0  # batch frames the workers encoded into shared memory
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
        """Batches ready here that the client has not taken (at most ``max_inflight`` whose
        bytes are queued here; a forwarded token bundle's frame counts all its batches)."""
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
    def _put(self, chunks: list[Any], last: bool, count: int = 0, permits: int = 1) -> bool:
        """Queue a frame for the event loop once ``permits`` of the ``max_inflight`` are free
        (a frame of ``count`` batches takes as many, one whose bytes stay in the shared ring
        takes one); the event loop gives them back once the frame is sent."""
        self._idle_since = t0 = time.monotonic()
        try:
            for _ in range(permits):
                while not self.slots.acquire(timeout=0.2):
                    if self.stop.is_set():
                        return False
        finally:
            self._idle_since = None
            self._idle += time.monotonic() - t0
        if self.stop.is_set():
            return False
        self.pending.append((chunks, last, count, permits))
        if self.waiting:  # NOTE [frame hand-off]: wake the response only when it sleeps
            try:
                self.loop.call_soon_threadsafe(self._nudge)
            except RuntimeError:  # the event loop is gone: the server is shutting down
                return False
        return True

    def _nudge(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _produce(self) -> None:
        r = self.req
        step = r.start
        ring: SharedRing | None = None
        try:
            if r.start < r.steps:
                view = pass_dataset(
                    self.dataset, r.epoch, r.position, r.rank, r.world_size, r.start
                )
                extra: dict[str, Any] = {"persistent_workers": False}
                if self.options.workers:
                    extra["prefetch_factor"] = self.options.prefetch_factor
                    if r.shm and self.options.shm_dir and worker_bundle(view) > 1:
                        # NOTE [forwarded slots]: workers write into memory the client maps
                        extra["make_ring"] = ring_maker(self.options.shm_dir, 4)
                    elif r.shm and self.options.shm_dir:
                        self._worker_segment(extra)  # NOTE [worker slots]
                try:
                    loader = make_loader(view, num_workers=self.options.workers, **extra)
                except OSError as err:  # no room in /dev/shm for the ring: copy instead
                    log.info("stream %d: no shared ring (%s)", self.id, err)
                    extra.pop("make_ring", None)
                    loader = make_loader(view, num_workers=self.options.workers, **extra)
                ring = getattr(loader.worker_init_fn, "ring", None)
                if not isinstance(ring, SharedRing):
                    ring = None
                self.ring = ring
                serial = not self.options.workers and needs_serial_pipeline(view)
                # with a shared ring, the DataLoader's own items: bundles stay whole
                items = _items(loader) if ring is not None else iter(loader)
                group: list[Any] = []
                per_frame = 1  # batches per frame: 1 until the first batch's size is known
                try:
                    reserve = self.options.workers * (self.options.prefetch_factor + 2)
                    while not self.stop.is_set():
                        if ring is not None and self._attached():
                            ring.wait_room(reserve, WAIT_SECONDS)
                        self._busy_since = t0 = time.monotonic()
                        try:
                            if serial:
                                with _SERIAL_PIPELINE:
                                    item = next(items)
                            else:
                                item = next(items)
                        except StopIteration:
                            break
                        finally:
                            self._busy_since = None
                            self._busy += time.monotonic() - t0
                        if isinstance(item, Encoded):  # NOTE [worker slots]
                            if group:
                                if not self._send(step, group):
                                    return
                                step, group = step + len(group), []
                            frame = encode_header(step, item.fields)
                            if not self._put(frame, False, item.count):
                                return
                            self.produced += item.count
                            self.encoded += 1
                            step += item.count
                            continue
                        if isinstance(item, Arrived):
                            if self._attached():
                                if group:
                                    if not self._send(step, group):
                                        return
                                    step, group = step + len(group), []
                                frame = encode_forward(step, item.count, item.ring.forward(item))
                                if not self._put(frame, False, item.count):
                                    return
                                self.produced += item.count
                                step += item.count
                                continue
                            item = item.materialize()
                        for batch in unbundle(item) if ring is not None else (item,):
                            group.append(batch)
                            if len(group) < per_frame and step + len(group) < r.steps:
                                continue
                            if step == r.start:  # NOTE [frames of several batches]
                                one = frame_size(encode_batches(step, group))
                                with self.metrics.lock:
                                    self.metrics.frame_hint = max(self.metrics.frame_hint, one)
                                per_frame = min(
                                    max(1, BUNDLE_BYTES // max(one, 1)),
                                    MAX_BUNDLE,
                                    self.options.max_inflight,
                                )
                                if r.shm and not self._open_segment(step, per_frame * one):
                                    return
                            if not self._send(step, group):
                                return
                            step, group = step + len(group), []
                        del item
                    if group and not self.stop.is_set():
                        if not self._send(step, group):
                            return
                        step += len(group)
                finally:
                    items.close()  # type: ignore[attr-defined]
                    del items, loader, group  # shuts the DataLoader's workers down now
            if not self.stop.is_set():
                if step != r.steps:
                    raise ShardloaderError(
                        f"the pipeline ended after step {step - 1} but the pass has {r.steps} "
                        "steps for this rank; the dataset is not deterministic"
                    )
                self._put([encode_control("end", step, steps=r.steps)], True)
        except Exception as err:
            self._fail(step, err)
        finally:
            segment, self.segment = self.segment, None
            if segment is not None:  # only this thread writes to it
                with self.metrics.lock:
                    self.metrics.shm_frames += segment.used + self.encoded
                    self.metrics.shm_worker_frames += self.encoded
                    self.metrics.shm_fallbacks += segment.fallbacks
                    self.metrics.shm_forwarded += ring.forwarded if ring is not None else 0
                segment.close()
            if ring is not None:
                ring.unlink()
            self.ring = None

    def _worker_segment(self, extra: dict[str, Any]) -> None:
        """Make the segment before the workers fork, with a share of slots for each of them
        and one for this process, and let the workers encode into it (NOTE [worker slots])."""
        hint = self.metrics.frame_hint  # the batches' size, from the streams before
        if not hint:
            return
        workers = self.options.workers
        per = self.options.prefetch_factor + 3  # in flight, queued here, held by the client
        assert self.options.shm_dir is not None
        try:
            segment = Segment(self.options.shm_dir, (workers + 1) * per, hint * 3 // 2)
        except OSError as err:
            log.info("stream %d: no shared memory (%s); sending over TCP", self.id, err)
            return
        segment.mine = (workers * per, (workers + 1) * per)
        self.segment = segment
        extra["collate_fn"] = EncodeInWorker(segment, per)

    def _attached(self) -> bool:
        """Whether the client maps the stream's shared memory (then no name is left)."""
        segment = self.segment
        if segment is None or not segment.attached:
            return False
        if self.ring is not None:
            self.ring.unlink()
        return True

    def _send(self, step: int, group: list[Any]) -> bool:
        """Encode ``group`` (steps ``step..``) as one frame and queue it (False: the stream
        stopped).

        NOTE [frames of several batches]: a frame carries consecutive batches, as many as
        fill about :data:`~shardloader.transport.BUNDLE_BYTES` (judged by the stream's first
        batch, which goes alone) and at most ``max_inflight``, which still bounds the batches
        queued here: per frame the header, the event loop and the client's reader cost tens
        of microseconds, more than a token batch takes to make.  The client
        counts every batch of a frame as a step, so resuming works as with one per frame.
        """
        place = self.segment.place if self.segment is not None else None
        chunks = encode_batches(step, group, place)
        if not self._put(chunks, False, len(group), len(group)):
            return False
        self.produced += len(group)
        return True

    def _open_segment(self, step: int, frame_bytes: int) -> bool:
        """Make the stream's segment, its slots sized for frames of ``frame_bytes``, and
        announce it (False: the stream stopped).  Slots: the frames queued here, those the
        client holds (its read-ahead, the batch being decoded, the loop's current and last
        batch) and one spare."""
        folder = self.options.shm_dir
        if folder is None:
            return True
        try:
            if self.segment is None:
                self.segment = Segment(
                    folder, self.options.max_inflight + 6, max(frame_bytes * 5 // 4, 1 << 16)
                )
        except OSError as err:  # no /dev/shm, full, not writable: TCP it is
            log.info("stream %d: no shared memory (%s); sending over TCP", self.id, err)
            return True
        announce = self.segment.announce()
        if self.ring is not None:
            announce["ring"] = self.ring.announce()
        if not self._put([encode_control("shm", step, **announce)], False):
            return False
        self.segment.wait_attached(0.2)  # the client maps it as soon as it reads the frame
        return True

    def _fail(self, step: int, err: Exception) -> None:
        r = self.req
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
            wake = asyncio.Event()
            self._wake = wake
            while True:
                if not self.pending:  # NOTE [frame hand-off]
                    self.waiting = True
                    if not self.pending:
                        nudge = asyncio.ensure_future(wake.wait())
                        done, _ = await asyncio.wait(
                            {nudge, left},
                            timeout=self.options.ping_interval,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                        nudge.cancel()
                        if left in done:
                            return
                        if not done and not self.pending:
                            await send(
                                {
                                    "type": "http.response.body",
                                    "more_body": True,
                                    "body": encode_control("ping", self.next_step),
                                }
                            )
                    self.waiting = False
                    wake.clear()
                    continue
                small = bytearray()  # the frames queued now go out as one body where small
                last = False
                while self.pending and not last:
                    chunks, last, count, permits = self.pending.popleft()
                    for chunk in chunks:
                        if memoryview(chunk).nbytes < _PIECE:
                            small += chunk
                            continue
                        if small:
                            await send(
                                {
                                    "type": "http.response.body",
                                    "body": bytes(small),
                                    "more_body": True,
                                }
                            )
                            small = bytearray()
                        for piece in _pieces(chunk):
                            await send(
                                {"type": "http.response.body", "body": piece, "more_body": True}
                            )
                    self.slots.release(permits)
                    if not last:
                        self.sent += count
                        self.next_step += count
                        with self.metrics.lock:
                            self.metrics.batches += count
                            self.metrics.bytes += frame_size(chunks)
                if small:
                    await send(
                        {"type": "http.response.body", "body": bytes(small), "more_body": True}
                    )
                if last:
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-write
        finally:
            left.cancel()
            self.close()


_PIECE = 1 << 18


def _items(loader: Any) -> Iterator[Any]:
    """The DataLoader's items as its workers sent them (a :class:`~shardloader.transport.
    Bundle` stays whole), without :class:`~shardloader.loader.ShardLoader`'s unbundling; the
    stream counts the steps itself."""
    from torch.utils.data import DataLoader

    it = DataLoader.__iter__(loader)
    try:
        yield from it
    finally:
        del it  # shuts the workers down


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
