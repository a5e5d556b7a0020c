"""``RemoteLoader``: the training loop's end of ``shardloader serve``.

It yields, for its rank, seed and epoch, the batches a local :func:`shardloader.make_loader`
would, byte for byte, and saves/restores the same state.  A background thread keeps up to
``prefetch`` frames (a frame: one batch, or several small consecutive ones) received ahead of
the loop.

NOTE [faults]: every frame carries its step.  The reader counts the steps it has received; on
any connection fault (refused, reset, timeout, truncated frame, 5xx/503) it reconnects, to the
next URL round-robin, and asks for ``start = first step not received``, so no batch is lost or
repeated.  Attempts that deliver nothing are bounded by the :class:`RetryPolicy` (attempts and
seconds since the last batch, backoff with jitter between them); a connection that delivered
batches resets the count.  Answers that another attempt cannot change (400, 401, 409, a
pipeline error on the server) raise at once.
"""

from __future__ import annotations

import http.client
import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlencode

from shardloader import errors
from shardloader.errors import ResumeError, ShardloaderError, UsageError
from shardloader.service.options import is_loopback
from shardloader.service.ring import RingAttachment
from shardloader.service.shm import SHM_DIR, Attachment
from shardloader.service.transport import (
    Endpoint,
    check_status,
    get_json,
    next_delay,
    remote_error,
)
from shardloader.service.wiredecode import decode_batches
from shardloader.service.wireframes import PROTOCOL, read_frame, shm_span
from shardloader.split import Place
from shardloader.storage.retry import RetryPolicy, TruncatedBodyError
from shardloader.world import detect_world

__all__ = ["RemoteLoader", "DEFAULT_REMOTE_RETRY"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1  # the local loader's state format (shardloader.loader)
_END = object()

DEFAULT_REMOTE_RETRY = RetryPolicy(
    max_attempts=8,
    initial_backoff=0.1,
    max_backoff=5.0,
    max_total_seconds=120.0,
    connect_timeout=10.0,
    read_timeout=60.0,
)


class RemoteLoader:
    """Batches of one rank from ``shardloader serve`` replicas, as the local loader yields them.

    ``urls``: one or more replicas serving the same pipeline (rank ``r`` starts at
    ``urls[r % len(urls)]`` to spread load).  ``rank``/``world_size`` default to the detected
    distributed place.  ``seed``/``fingerprint`` pin what the servers must serve (409 →
    :class:`ResumeError` otherwise); unset, they are learned from the first server.
    ``token``: the bearer token of servers started with ``--token-file``; by default it comes
    from ``$SHARDLOADER_TOKEN``, or the file ``$SHARDLOADER_TOKEN_FILE`` names.
    ``transport``: ``"auto"`` takes batches through shared memory from a server on this host
    (a loopback URL or this host's name; NOTE [shm handover] in
    :mod:`shardloader.service.shm`) and over TCP otherwise or when that fails; ``"tcp"``
    always uses TCP.  The batches are the same either way.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        rank: int | None = None,
        world_size: int | None = None,
        *,
        seed: int | None = None,
        fingerprint: str | None = None,
        token: str | None = None,
        retry: RetryPolicy | None = None,
        prefetch: int = 2,
        transport: str = "auto",
    ) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise UsageError("RemoteLoader needs at least one service URL")
        self._endpoints = [Endpoint(u) for u in listed]
        r, w = detect_world(rank, world_size)
        Place(r, w)
        if prefetch < 1:
            raise UsageError(f"prefetch={prefetch} must be >= 1")
        self._rank, self._world = r, w
        self._expect: dict[str, Any] = {"fingerprint": fingerprint, "seed": seed, "plan": None}
        self._token = token if token is not None else _token_from_env()
        self.retry = retry or DEFAULT_REMOTE_RETRY
        self.prefetch = prefetch
        if transport not in ("auto", "tcp"):
            raise UsageError(f"transport={transport!r} must be 'auto' or 'tcp'")
        self.transport = transport
        self.shm_dir = SHM_DIR  # where a same-host server's segments are found
        self.shm_batches = 0  # batches that came through shared memory (for logs and tests)
        self.tcp_batches = 0  # batches whose bytes came over the socket
        self._epoch = 0
        self._start = 0  # global batches consumed before the next pass of this epoch
        self._position = 0  # global batches consumed, as the loop has seen them
        self._steps_left: int | None = None  # steps of the current pass not yet handed out
        self.reconnects = 0  # requests made again after a fault (for logs and tests)

    # -- public state ---------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [e.url for e in self._endpoints]

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch; keeps a loaded resume position for that same epoch."""
        if epoch != self._epoch:
            self._start = self._position = 0
            self._steps_left = None
        self._epoch = int(epoch)

    def __len__(self) -> int:
        """Steps this rank gets in the coming pass of the current epoch."""
        return int(self._info(self._epoch, self._start)["steps"])

    def __repr__(self) -> str:
        return (
            f"RemoteLoader({self.urls!r}, rank={self._rank}, world_size={self._world}, "
            f"epoch={self._epoch})"
        )

    def state_dict(self) -> dict[str, Any]:
        """The local loader's state: enough to continue here or on a local loader (after a
        pass's last step: the next epoch, as ``shardloader.loader`` explains)."""
        self._pin()
        epoch, position = self._epoch, self._position
        if self._steps_left == 0:  # the pass is over: continue with the next epoch
            epoch, position = epoch + 1, 0
        return {
            "version": _STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": self._expect["seed"],
            "fingerprint": self._expect["fingerprint"],
            "plan": self._expect["plan"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run (local or remote); the servers check seed, manifest and plan."""
        if state.get("version") != _STATE_VERSION:
            raise ResumeError(
                f"loader state version {state.get('version')!r} is not {_STATE_VERSION}"
            )
        for key in ("fingerprint", "seed", "plan"):
            mine = self._expect[key]
            if mine is not None and state.get(key) != mine:
                raise ResumeError(
                    f"saved {key} {state.get(key)!r} does not match {mine!r}, "
                    "which this RemoteLoader reads"
                )
            self._expect[key] = state.get(key)
        self._epoch = int(state["epoch"])
        self._start = self._position = int(state["position"])
        self._steps_left = None

    # -- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        epoch, start = self._epoch, self._start
        planned = len(self)  # also pins seed, fingerprint and plan
        self._position, self._steps_left = start, planned
        reader = _Reader(self, epoch, start)
        try:
            for seen, batch in enumerate(reader.batches(), 1):
                self._position += self._world
                self._steps_left = planned - seen
                yield batch
        finally:
            reader.close()
        if self._epoch == epoch:
            self._start = 0  # the epoch is done; a re-run starts it afresh

    # -- requests -------------------------------------------------------------------------
    def _params(self, epoch: int, position: int) -> dict[str, Any]:
        params: dict[str, Any] = {
            "epoch": epoch,
            "rank": self._rank,
            "world_size": self._world,
            "position": position,
        }
        params.update({k: v for k, v in self._expect.items() if v is not None})
        return params

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _pin(self) -> None:
        if any(v is None for v in self._expect.values()):
            self._info(self._epoch, self._start)

    def _info(self, epoch: int, position: int) -> dict[str, Any]:
        rng = random.Random()
        index, failures, began = self._first(), 0, time.monotonic()
        while True:
            endpoint = self._endpoints[index]
            try:
                info = get_json(
                    endpoint, "/v1/info", self._params(epoch, position), self._headers(), self.retry
                )
                break
            except (OSError, http.client.HTTPException) as err:
                if isinstance(err, ShardloaderError):
                    raise
                failures += 1
                delay = next_delay(
                    self.retry,
                    failures,
                    began,
                    rng,
                    err,
                    endpoint.url,
                    f"read /v1/info (epoch {epoch})",
                )
                index = (index + 1) % len(self._endpoints)
                self.reconnects += 1
                time.sleep(delay)
        if info.get("protocol") != PROTOCOL:
            raise UsageError(
                f"{endpoint.url} speaks protocol {info.get('protocol')!r}, this "
                f"client {PROTOCOL}; run matching shardloader versions"
            )
        for key in ("fingerprint", "seed", "plan"):
            if self._expect[key] is None:
                self._expect[key] = info[key]
        return info

    def _first(self) -> int:
        return self._rank % len(self._endpoints)


def _token_from_env() -> str | None:
    token = os.environ.get("SHARDLOADER_TOKEN")
    path = os.environ.get("SHARDLOADER_TOKEN_FILE")
    if token is None and path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read()
        except OSError as err:
            raise UsageError(f"SHARDLOADER_TOKEN_FILE={path}: cannot read it ({err})") from err
    if token is None or not token.strip():
        return None
    return token.strip()


class _Reader:
    """A thread that keeps up to ``prefetch`` frames of one pass received ahead of the loop."""

    def __init__(self, loader: RemoteLoader, epoch: int, position: int) -> None:
        self.loader, self.epoch, self.position = loader, epoch, position
        self.q: queue.Queue[Any] = queue.Queue(maxsize=loader.prefetch)
        self.stop = threading.Event()
        self._sock: socket.socket | None = None
        self.attachment: Attachment | None = None  # the current stream's shared memory
        self.ring: RingAttachment | None = None  # and its workers' ring (token batches)
        self._thread = threading.Thread(
            target=self._run, daemon=True, name=f"shardloader-remote-rank{loader.rank}"
        )
        self._thread.start()

    def batches(self) -> Iterator[Any]:
        while True:
            item = self.q.get()
            attachment, ring = self.attachment, self.ring
            if attachment is not None:
                attachment.collect()  # slots of batches the loop has dropped: NOTE [shm handover]
            if ring is not None:
                ring.collect()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            while item:  # popped, so the loop alone keeps a batch it has seen alive
                yield item.pop(0)

    def close(self) -> None:
        self.stop.set()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read
            except OSError:
                pass
        self._thread.join(timeout=10)

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            self._read_pass()
        except BaseException as err:  # a bug must reach the loop, not hang it
            self._put(err)

    def _read_pass(self) -> None:
        loader = self.loader
        place = f"rank {loader.rank}/{loader.world_size}"
        endpoints = loader._endpoints
        rng = random.Random()  # jitter only: never touches the data order
        index, received, failures, since = loader._first(), 0, 0, time.monotonic()
        while not self.stop.is_set():
            endpoint = endpoints[index]
            progressed = False
            try:
                for frame in self._frames(endpoint, received):
                    kind = frame.kind
                    if kind == "batch":
                        if frame.header["step"] != received:
                            raise errors.DecodeError(
                                f"{endpoint.url} sent step {frame.header['step']} where step "
                                f"{received} was due ({place}, epoch {self.epoch})"
                            )
                        batches = self._decode(frame, endpoint)
                        if "shm" in frame.header or "ring" in frame.header:
                            loader.shm_batches += len(batches)
                        else:
                            loader.tcp_batches += len(batches)
                        if not self._put(batches):  # a frame's batches go as one item
                            return
                        received += len(batches)
                        progressed, failures, since = True, 0, time.monotonic()
                    elif kind == "shm":
                        self._attach(frame.header, endpoint)
                    elif kind == "end":
                        if frame.header.get("steps") != received:
                            raise errors.DecodeError(
                                f"{endpoint.url} ended the pass at {received} steps but "
                                f"announced {frame.header.get('steps')} ({place})"
                            )
                        self._put(_END)
                        return
                    elif kind == "error":
                        self._put(remote_error(endpoint.url, frame.header, self.epoch, place))
                        return
                raise TruncatedBodyError(f"{endpoint.url} closed the stream before its end")
            except (OSError, http.client.HTTPException) as err:
                if isinstance(err, ShardloaderError) and not isinstance(err, TruncatedBodyError):
                    raise
                if self.stop.is_set():
                    return
                failures += 1
                delay = (
                    0.0
                    if progressed
                    else next_delay(
                        loader.retry,
                        failures,
                        since,
                        rng,
                        err,
                        endpoint.url,
                        f"read epoch {self.epoch} step {received} ({place})",
                    )
                )
                log.info(
                    "stream from %s broke at step %d (%s: %s); reconnecting in %.2f s",
                    endpoint.url,
                    received,
                    type(err).__name__,
                    err,
                    delay,
                )
                index = (index + 1) % len(endpoints)
                loader.reconnects += 1
                self.stop.wait(delay)

    def _decode(self, frame: Any, endpoint: Endpoint) -> list[Any]:
        if "ring" in frame.header:  # NOTE [forwarded slots]
            if self.ring is None or frame.header.get("count") != len(
                batches := self.ring.batches(frame.header)
            ):
                raise errors.DecodeError(
                    f"{endpoint.url} sent a bundle from a shared ring this client never "
                    "mapped, or one whose count does not match its layout"
                )
            return batches
        if "shm" not in frame.header:
            return decode_batches(frame)
        if self.attachment is None:
            raise errors.DecodeError(
                f"{endpoint.url} sent a batch through shared memory this client never mapped"
            )
        return decode_batches(frame, self.attachment.receive(*shm_span(frame.header)))

    def _attach(self, header: dict[str, Any], endpoint: Endpoint) -> None:
        """Map the stream's segment if it is on this host; else the server keeps to TCP."""
        try:
            ring = header.get("ring")
            if ring is not None:  # mapped first: attaching the segment tells the server
                self.ring = RingAttachment(self.loader.shm_dir, ring)
            self.attachment = Attachment(self.loader.shm_dir, header)
        except (OSError, ValueError) as err:
            self.ring = None
            log.info(
                "shared memory of %s is not reachable from here (%s); reading over TCP",
                endpoint.url,
                err,
            )

    def _wants_shm(self, endpoint: Endpoint) -> bool:
        if self.loader.transport != "auto" or not os.path.isdir(self.loader.shm_dir):
            return False
        return is_loopback(endpoint.host) or endpoint.host == socket.gethostname()

    def _frames(self, endpoint: Endpoint, start: int) -> Iterator[Any]:
        loader = self.loader
        conn = endpoint.connect(loader.retry)
        self._sock = conn.sock
        self.attachment = None  # a new stream announces its own segment
        self.ring = None
        try:
            if self.stop.is_set():
                return
            params = {**loader._params(self.epoch, self.position), "start": start}
            if self._wants_shm(endpoint):
                params["shm"] = 1
            conn.request(
                "GET",
                f"{endpoint.prefix}/v1/batches?{urlencode(params)}",
                headers=loader._headers(),
            )
            resp = conn.getresponse()
            check_status(endpoint, resp)
            while (frame := read_frame(resp.readinto)) is not None:
                yield frame
        finally:
            self._sock = None
            conn.close()
