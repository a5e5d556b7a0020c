"""The thread behind a :class:`~shardloader.service.client.RemoteLoader` pass: it reads one
pass's frames from the servers, reconnecting where the last one broke off, and keeps a few
decoded ahead of the training loop.

NOTE [faults]: every frame carries its step.  The reader counts the steps it has received; on
any server fault it reconnects, to the next URL round-robin, and asks for ``start = first step
not received``, so no batch is lost or repeated.  A fault is anything another replica, or the
same one restarted, may not repeat:

- a refused, reset or timed-out connection, a stream cut mid-frame, 5xx;
- a stream whose server stopped (SIGTERM to its process group, as systemd stops a service:
  uvicorn closes the connection, or the stream's workers die first);
- a stream whose pipeline lost a worker process (SIGKILL, the OOM killer): the server sends an
  ``error`` frame marked ``transient`` for every failure that is not a ShardloaderError of
  the pipeline itself (:meth:`shardloader.service.stream.Stream._fail`);
- 503 with Retry-After (``--max-clients``): not an attempt, a wait of that long once every
  replica said busy.

Attempts that deliver nothing are spent by the one retry loop there is,
:func:`~shardloader.storage.retry.call_with_retries` under the loader's
:class:`~shardloader.storage.retry.RetryPolicy` (through
:class:`~shardloader.service.failover.Failover`): its budget counts from the last batch
received, so a connection that delivered batches starts it afresh.  Answers that another
attempt cannot change (400, 401, 409: another dataset, seed, plan or pipeline, and a
pipeline's own ShardloaderError, which every replica would raise) raise at once.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import queue
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from shardloader import errors
from shardloader.errors import ShardloaderError, TruncatedBodyError
from shardloader.service.failover import Failover, _LoopStopped, check_status, remote_error
from shardloader.service.frames import read_frame
from shardloader.service.wire import decode_batches

if TYPE_CHECKING:
    from shardloader.service.client import RemoteLoader

__all__ = ["PassReader"]


_END = object()


class PassReader:
    """A thread that keeps up to ``loader.prefetch`` frames of one pass received ahead of the
    loop (NOTE [faults]).

    It asks the loader's servers, from the loader's first one on, for the pass of ``epoch``
    after ``position`` global batches, with what the loader pinned; the query is built anew
    at each connection.
    """

    def __init__(self, loader: RemoteLoader, epoch: int, position: int) -> None:
        self.loader, self.epoch, self.position = loader, epoch, position
        self.q: queue.Queue[Any] = queue.Queue(maxsize=loader.prefetch)
        self.received = 0  # steps of the pass received (the reader thread's own)
        self.place = f"rank {loader.rank}/{loader.world_size}"
        self.stop = threading.Event()
        self._body: Any = None  # the stream being read, for close() to abort
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"shardloader-remote-rank{loader.rank}"
        )
        self._thread.start()

    def batches(self) -> Iterator[Any]:
        while True:
            item = self.q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            while item:  # popped, so the loop alone keeps a batch it has seen alive
                yield item.pop(0)

    def close(self) -> None:
        self.stop.set()
        body = self._body
        if body is not None:
            with contextlib.suppress(OSError):
                body.abort()  # wakes a blocked read
        self._thread.join(timeout=10)

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            with contextlib.suppress(queue.Full):
                self.q.put(item, timeout=0.2)
                return True
        return False

    def _run(self) -> None:
        failover = Failover(self.loader, self.stop)
        try:
            # each call: the attempts until one delivers a batch (NOTE [faults])
            while not failover.call(
                functools.partial(self._stream, failover),
                f"read epoch {self.epoch} step {self.received} ({self.place}) from the service at",
            ):
                pass
            self._put(_END)
        except _LoopStopped:
            pass
        except BaseException as err:  # a bug must reach the loop, not hang it
            self._put(err)

    def _stream(self, failover: Failover, endpoint: str) -> bool:
        """Read the pass from ``endpoint`` at the first step not received: True at its end,
        False when it broke after delivering batches (the next call starts a fresh budget);
        a fault before any batch raises, as the retry loop wants it."""
        place = self.place
        begun = self.received
        try:
            for frame in self._frames(endpoint, self.received):
                kind = frame.kind
                if kind == "batch":
                    if frame.header["step"] != self.received:
                        raise errors.DecodeError(
                            f"{endpoint} sent step {frame.header['step']} where step "
                            f"{self.received} was due ({place}, epoch {self.epoch})"
                        )
                    batches = decode_batches(frame)
                    if not self._put(batches):  # a frame's batches go as one item
                        raise _LoopStopped()
                    self.received += len(batches)
                elif kind == "end":
                    if frame.header.get("steps") != self.received:
                        raise errors.DecodeError(
                            f"{endpoint} ended the pass at {self.received} steps but "
                            f"announced {frame.header.get('steps')} ({place})"
                        )
                    return True
                elif kind == "error":
                    raise remote_error(endpoint, frame.header, self.epoch, place)
            raise TruncatedBodyError(f"{endpoint} closed the stream before its end")
        except (OSError, http.client.HTTPException) as err:
            if self.received == begun or self.stop.is_set():
                raise
            if isinstance(err, ShardloaderError) and not isinstance(err, TruncatedBodyError):
                raise
            failover.advance(endpoint, err)  # progress: reconnect at once, budget afresh
            return False

    def _frames(self, endpoint: str, start: int) -> Iterator[Any]:
        loader = self.loader
        params = {**loader._params(self.epoch, self.position), "start": start}
        body = loader._http.get(f"{endpoint}/v1/batches?{urlencode(params)}", any_status=True)
        self._body = body
        try:
            if self.stop.is_set():
                return
            check_status(endpoint, body, loader.pipeline_spec)
            while (frame := read_frame(body.readinto)) is not None:
                yield frame
        finally:
            self._body = None
            body.close()
