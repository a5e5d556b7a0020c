"""One stream's shared memory: which of the server's shared-memory roads it takes, and what
went through them.

A same-host client maps a segment of slots that carry the stream's payloads (NOTE [shm
handover] in :mod:`shardloader.service.shm`); the server fills them, or its DataLoader workers
do (NOTE [worker slots] in :mod:`shardloader.service.encoded`); token batches may instead stay
in the workers' ring (NOTE [forwarded slots] in :mod:`shardloader.service.ring`).  The stream's
producer thread alone makes, uses and closes these (:class:`~shardloader.service.stream.Stream`);
what went through them is added to the server's metrics when the stream ends.

NOTE [unattached reserve]: a segment or ring is made before its client maps it, and a client
that asks for shared memory and never maps it (another host, a crafted client) makes the server
hold it for as long as its stream runs.  The bytes of every stream's files that no client maps
yet are counted (``Metrics.shm_unattached``, one gauge for the whole server) and kept at most
``ServeOptions.shm_reserve`` (default: half of the folder's file system, at most 1 GiB); a
stream whose files would pass it stays on TCP.  A stream's claim ends when its client maps the
segment (the names are unlinked then) or when the stream ends.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Iterator
from typing import Any

from shardloader.service.encoded import EncodeInWorker
from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions
from shardloader.service.ring import SharedRing
from shardloader.service.shm import Segment, segment_size
from shardloader.service.shmfiles import default_reserve
from shardloader.service.wireencode import Place

__all__ = ["StreamMemory"]

log = logging.getLogger(__name__)


class StreamMemory:
    """The segment and ring of one stream (``stream_id``), made only where the client asked
    for shared memory and the server has a folder for it (``options.shm_dir``)."""

    def __init__(self, options: ServeOptions, metrics: Metrics, stream_id: int) -> None:
        self.options, self.metrics, self.stream_id = options, metrics, stream_id
        self.segment: Segment | None = None  # the stream's shared memory, once made
        self.ring: SharedRing | None = None  # its workers' ring, when the client can map it
        self.encoded = 0  # batch frames the workers encoded into shared memory
        self.claimed = 0  # bytes of this stream's files counted as unattached
        folder, limit = options.shm_dir, options.shm_reserve
        if limit is None:
            limit = default_reserve(folder) if folder is not None else 0
        self.limit = limit

    @contextlib.contextmanager
    def claiming(self, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` of a file made in the block for the client (NOTE [unattached
        reserve]): an OSError when that would pass the limit (the caller stays on TCP), and
        not counted if the block fails."""
        with self.metrics.lock:
            if self.metrics.shm_unattached + nbytes > self.limit:
                raise OSError(
                    errno.ENOSPC,
                    f"{nbytes} B more of shared memory would pass the {self.limit} B that "
                    "clients which have not mapped theirs may hold (--shm-reserve)",
                )
            self.metrics.shm_unattached += nbytes
            self.claimed += nbytes
        try:
            yield
        except BaseException:
            with self.metrics.lock:
                self.metrics.shm_unattached -= nbytes
                self.claimed -= nbytes
            raise

    def _release(self) -> None:
        with self.metrics.lock:
            self.metrics.shm_unattached -= self.claimed
            self.claimed = 0

    def for_workers(self, extra: dict[str, Any]) -> None:
        """Make the segment before the workers fork, with a share of slots for each of them
        and one for this process, and let the workers encode into it (NOTE [worker slots]):
        ``extra`` are the DataLoader's arguments."""
        hint = self.metrics.frame_hint  # the batches' size, from the streams before
        if not hint:
            return
        workers = self.options.workers
        per = self.options.prefetch_factor + 3  # in flight, queued here, held by the client
        assert self.options.shm_dir is not None
        slots, slot_bytes = (workers + 1) * per, hint * 3 // 2
        try:
            with self.claiming(segment_size(slots, slot_bytes)):
                segment = Segment(self.options.shm_dir, slots, slot_bytes)
        except OSError as err:
            log.info("stream %d: no shared memory (%s); sending over TCP", self.stream_id, err)
            return
        segment.mine = (workers * per, (workers + 1) * per)
        self.segment = segment
        extra["collate_fn"] = EncodeInWorker(segment, per)

    def attached(self) -> bool:
        """Whether the client maps the stream's shared memory (then no name is left)."""
        segment = self.segment
        if segment is None or not segment.attached:
            return False
        if self.ring is not None:
            self.ring.unlink()
        if self.claimed:
            self._release()
        return True

    @property
    def place(self) -> Place | None:
        """Where the server copies a frame's payload: a free slot of the segment, if any."""
        return self.segment.place if self.segment is not None else None

    def open(self, frame_bytes: int) -> dict[str, Any] | None:
        """Make the segment, its slots sized for frames of ``frame_bytes``; the fields of the
        ``shm`` frame that announces it (None: no shared memory, TCP it is).  Slots: the
        frames queued here, those the client holds (its read-ahead, the batch being decoded,
        the loop's current and last batch) and one spare."""
        folder = self.options.shm_dir
        if folder is None:
            return None
        try:
            if self.segment is None:
                slots, slot_bytes = (
                    self.options.max_inflight + 6,
                    max(frame_bytes * 5 // 4, 1 << 16),
                )
                with self.claiming(segment_size(slots, slot_bytes)):
                    self.segment = Segment(folder, slots, slot_bytes)
        except OSError as err:  # no /dev/shm, full, not writable: TCP it is
            log.info("stream %d: no shared memory (%s); sending over TCP", self.stream_id, err)
            return None
        announce = self.segment.announce()
        if self.ring is not None:
            announce["ring"] = self.ring.announce()
        return announce

    def wait_attached(self, seconds: float) -> None:
        """Give the client ``seconds`` to map the segment just announced."""
        if self.segment is not None:
            self.segment.wait_attached(seconds)

    def close(self) -> None:
        """Count what went through shared memory, close the segment, unlink the ring."""
        segment, self.segment = self.segment, None
        ring = self.ring
        if segment is not None:  # only the producer thread writes to it
            with self.metrics.lock:
                self.metrics.shm_frames += segment.used + self.encoded
                self.metrics.shm_worker_frames += self.encoded
                self.metrics.shm_fallbacks += segment.fallbacks
                self.metrics.shm_forwarded += ring.forwarded if ring is not None else 0
            segment.close()
        if ring is not None:
            ring.unlink()
        self.ring = None
        self._release()
