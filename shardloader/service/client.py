"""``RemoteLoader``: the training loop's end of ``shardloader serve``.

It yields, for its rank, seed and epoch, the batches a local :func:`shardloader.make_loader`
would, byte for byte, and saves/restores the same state.  A background thread keeps up to
``prefetch`` batches received ahead of the loop.

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
import json
import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit

from shardloader import errors
from shardloader.errors import ResumeError, ShardloaderError, StorageError, UsageError
from shardloader.service.wire import PROTOCOL, decode_batch, read_frame
from shardloader.split import Place
from shardloader.storage.retry import RetryPolicy, TruncatedBodyError
from shardloader.world import detect_world

__all__ = ["RemoteLoader", "DEFAULT_REMOTE_RETRY"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1  # the local loader's state format (shardloader.loader)
_END = object()

DEFAULT_REMOTE_RETRY = RetryPolicy(max_attempts=8, initial_backoff=0.1, max_backoff=5.0,
                                   max_total_seconds=120.0, connect_timeout=10.0,
                                   read_timeout=60.0)


class _Retry(ConnectionError):
    """A status another attempt may fix (5xx, 503 busy), with the server's Retry-After."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Endpoint:
    """One server URL: ``http(s)://host:port[/prefix]``."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"service URL {url!r} must look like http://host:port")
        if parts.query or parts.fragment:
            raise UsageError(f"service URL {url!r} must not carry a query or fragment")
        self.url = url.rstrip("/")
        self.https = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/")

    def connect(self, policy: RetryPolicy) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=policy.connect_timeout)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(policy.read_timeout)  # seconds without a byte, not per stream
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn


class RemoteLoader:
    """Batches of one rank from ``shardloader serve`` replicas, as the local loader yields them.

    ``urls``: one or more replicas serving the same pipeline (rank ``r`` starts at
    ``urls[r % len(urls)]`` to spread load).  ``rank``/``world_size`` default to the detected
    distributed place.  ``seed``/``fingerprint`` pin what the servers must serve (409 →
    :class:`ResumeError` otherwise); unset, they are learned from the first server.
    ``token``: the bearer token of servers started with ``--token-file``; by default it comes
    from ``$SHARDLOADER_TOKEN``, or the file ``$SHARDLOADER_TOKEN_FILE`` names.
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
    ) -> None:
        listed = [urls] if isinstance(urls, str) else list(urls)
        if not listed:
            raise UsageError("RemoteLoader needs at least one service URL")
        self._endpoints = [_Endpoint(u) for u in listed]
        r, w = detect_world(rank, world_size)
        Place(r, w)
        if prefetch < 1:
            raise UsageError(f"prefetch={prefetch} must be >= 1")
        self._rank, self._world = r, w
        self._expect: dict[str, Any] = {"fingerprint": fingerprint, "seed": seed, "plan": None}
        self._token = token if token is not None else _token_from_env()
        self.retry = retry or DEFAULT_REMOTE_RETRY
        self.prefetch = prefetch
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
        return (f"RemoteLoader({self.urls!r}, rank={self._rank}, world_size={self._world}, "
                f"epoch={self._epoch})")

    def state_dict(self) -> dict[str, Any]:
        """The local loader's state: enough to continue here or on a local loader (after a
        pass's last step: the next epoch, as ``shardloader.loader`` explains)."""
        self._pin()
        epoch, position = self._epoch, self._position
        if self._steps_left == 0:  # the pass is over: continue with the next epoch
            epoch, position = epoch + 1, 0
        return {"version": _STATE_VERSION, "epoch": epoch, "position": position,
                "seed": self._expect["seed"], "fingerprint": self._expect["fingerprint"],
                "plan": self._expect["plan"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run (local or remote); the servers check seed, manifest and plan."""
        if state.get("version") != _STATE_VERSION:
            raise ResumeError(f"loader state version {state.get('version')!r} is not "
                              f"{_STATE_VERSION}")
        for key in ("fingerprint", "seed", "plan"):
            mine = self._expect[key]
            if mine is not None and state.get(key) != mine:
                raise ResumeError(f"saved {key} {state.get(key)!r} does not match {mine!r}, "
                                  "which this RemoteLoader reads")
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
        params: dict[str, Any] = {"epoch": epoch, "rank": self._rank,
                                  "world_size": self._world, "position": position}
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
                info = _get_json(endpoint, "/v1/info", self._params(epoch, position),
                                 self._headers(), self.retry)
                break
            except (OSError, http.client.HTTPException) as err:
                if isinstance(err, ShardloaderError):
                    raise
                failures += 1
                delay = _next_delay(self.retry, failures, began, rng, err, endpoint.url,
                                    f"read /v1/info (epoch {epoch})")
                index = (index + 1) % len(self._endpoints)
                self.reconnects += 1
                time.sleep(delay)
        if info.get("protocol") != PROTOCOL:
            raise UsageError(f"{endpoint.url} speaks protocol {info.get('protocol')!r}, this "
                             f"client {PROTOCOL}; run matching shardloader versions")
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


def _next_delay(policy: RetryPolicy, failures: int, began: float, rng: random.Random,
                err: BaseException, url: str, what: str) -> float:
    """Seconds to wait before the next attempt, or StorageError when the budget is spent."""
    elapsed = time.monotonic() - began
    if failures >= policy.max_attempts or elapsed >= policy.max_total_seconds:
        raise StorageError(
            f"cannot {what} from the service (last {url}): gave up after {failures} "
            f"attempt{'s' if failures != 1 else ''} without progress in {elapsed:.1f} s; last "
            f"cause: {type(err).__name__}: {err}; check that a server runs there, or raise "
            "RemoteLoader(retry=RetryPolicy(...)) limits"
        ) from err
    delay = policy.backoff(failures, rng)
    if isinstance(err, _Retry):
        delay = max(delay, min(err.retry_after, policy.max_backoff))
    return min(delay, max(0.0, policy.max_total_seconds - elapsed))


def _check_status(endpoint: _Endpoint, resp: http.client.HTTPResponse) -> None:
    if resp.status == 200:
        return
    raw = resp.read(1 << 16)
    try:
        message = str(json.loads(raw).get("error", raw[:300]))
    except (ValueError, AttributeError):
        message = raw[:300].decode("utf-8", "replace")
    where = f"{endpoint.url} answered {resp.status}"
    if resp.status in (429, 500, 502, 503, 504):
        try:
            after = float(resp.getheader("retry-after") or 0)
        except ValueError:
            after = 0.0
        raise _Retry(f"{where}: {message}", after)
    if resp.status == 401:
        raise StorageError(f"{where}: {message}; pass RemoteLoader(token=...) with the server's "
                           "token")
    if resp.status == 409:
        raise ResumeError(f"{where}: {message}")
    raise UsageError(f"{where}: {message}")


def _get_json(endpoint: _Endpoint, path: str, params: dict[str, Any], headers: dict[str, str],
              policy: RetryPolicy) -> dict[str, Any]:
    conn = endpoint.connect(policy)
    try:
        conn.request("GET", f"{endpoint.prefix}{path}?{urlencode(params)}", headers=headers)
        resp = conn.getresponse()
        _check_status(endpoint, resp)
        body = json.loads(resp.read())
    except ValueError as err:
        if isinstance(err, ShardloaderError):
            raise
        raise _Retry(f"{endpoint.url}{path} sent a body that is not JSON: {err}") from err
    finally:
        conn.close()
    if not isinstance(body, dict):
        raise _Retry(f"{endpoint.url}{path} sent {type(body).__name__}, not a JSON object")
    return body


def _remote_error(url: str, header: dict[str, Any], epoch: int, place: str) -> ShardloaderError:
    """The error a server's pipeline raised, as the same ShardloaderError class when known."""
    name = str(header.get("error", ""))
    cls = getattr(errors, name, None) if name in errors.__all__ else None
    if not (isinstance(cls, type) and issubclass(cls, ShardloaderError)):
        cls = ShardloaderError
    return cls(f"the pipeline on {url} failed at step {header.get('step')} of epoch {epoch} "
               f"({place}): {header.get('message', 'no message')}")


class _Reader:
    """A thread that keeps up to ``prefetch`` batches of one pass received ahead of the loop."""

    def __init__(self, loader: RemoteLoader, epoch: int, position: int) -> None:
        self.loader, self.epoch, self.position = loader, epoch, position
        self.q: queue.Queue[Any] = queue.Queue(maxsize=loader.prefetch)
        self.stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"shardloader-remote-rank{loader.rank}")
        self._thread.start()

    def batches(self) -> Iterator[Any]:
        while True:
            item = self.q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

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
                                f"{received} was due ({place}, epoch {self.epoch})")
                        if not self._put(decode_batch(frame)):
                            return
                        received += 1
                        progressed, failures, since = True, 0, time.monotonic()
                    elif kind == "end":
                        if frame.header.get("steps") != received:
                            raise errors.DecodeError(
                                f"{endpoint.url} ended the pass at {received} steps but "
                                f"announced {frame.header.get('steps')} ({place})")
                        self._put(_END)
                        return
                    elif kind == "error":
                        self._put(_remote_error(endpoint.url, frame.header, self.epoch, place))
                        return
                raise TruncatedBodyError(f"{endpoint.url} closed the stream before its end")
            except (OSError, http.client.HTTPException) as err:
                if isinstance(err, ShardloaderError) and not isinstance(err, TruncatedBodyError):
                    raise
                if self.stop.is_set():
                    return
                failures += 1
                delay = 0.0 if progressed else _next_delay(
                    loader.retry, failures, since, rng, err, endpoint.url,
                    f"read epoch {self.epoch} step {received} ({place})")
                log.info("stream from %s broke at step %d (%s: %s); reconnecting in %.2f s",
                         endpoint.url, received, type(err).__name__, err, delay)
                index = (index + 1) % len(endpoints)
                loader.reconnects += 1
                self.stop.wait(delay)

    def _frames(self, endpoint: _Endpoint, start: int) -> Iterator[Any]:
        loader = self.loader
        conn = endpoint.connect(loader.retry)
        self._sock = conn.sock
        try:
            if self.stop.is_set():
                return
            params = {**loader._params(self.epoch, self.position), "start": start}
            conn.request("GET", f"{endpoint.prefix}/v1/batches?{urlencode(params)}",
                         headers=loader._headers())
            resp = conn.getresponse()
            _check_status(endpoint, resp)
            while (frame := read_frame(resp.readinto)) is not None:
                yield frame
        finally:
            self._sock = None
            conn.close()
