"""The service: run a dataset's pipeline here, stream each rank's finished batches to trainers.

NOTE [what a stream is]: ``GET /v1/batches?epoch=E&rank=R&world_size=W&position=P&start=J``
streams rank R's steps J, J+1, ... of the pass of epoch E that begins after P global batches
(P is the loader state's ``position``: 0 for a fresh epoch).  That is a pure function of
(manifest, seed, plan, E, P, W, R), so any replica can serve any part of it, and a client that
lost its connection asks again with J = the first step it has not received.  The pass is the
dataset planned from P (exactly what a local loader resumed at P reads); the first J steps of
this rank are cut from the plan, never read.

Per stream a producer thread iterates a DataLoader (``workers`` processes) and hands encoded
frames to the event loop through at most ``max_inflight`` slots: a slow client blocks its
producer, so memory stays flat.  Streams beyond ``max_clients`` get 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from shardloader.dataset import ShardedDataset
from shardloader.errors import ShardloaderError, UsageError
from shardloader.loader import make_loader
from shardloader.service.wire import PROTOCOL, encode_batch, encode_control, frame_size

__all__ = ["ServeOptions", "create_app", "is_loopback", "pass_dataset", "serve", "steps_of_pass",
           "warm_up"]

log = logging.getLogger(__name__)

_MAX_INT = 1 << 62
_CONTROL_PARAMS = ("fingerprint", "seed", "plan")
_SERIAL_PIPELINE = threading.Lock()  # workers=0 pipelines share the global RNGs: one at a time

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class ServeOptions:
    """How the service runs streams (mirrors ``shardloader serve`` options)."""

    workers: int = 2  # DataLoader worker processes per stream
    max_inflight: int = 4  # encoded batches buffered per stream (backpressure)
    max_clients: int = 8  # concurrent streams; more get 503
    token: str | None = None  # every request but /health needs "Authorization: Bearer <token>"
    ping_interval: float = 5.0  # seconds without a batch before a keep-alive frame
    prefetch_factor: int = 2  # batches each worker prepares ahead

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise UsageError(f"--workers {self.workers} must be >= 0")
        if self.max_inflight < 1:
            raise UsageError(f"--max-inflight {self.max_inflight} must be >= 1")
        if self.max_clients < 1:
            raise UsageError(f"--max-clients {self.max_clients} must be >= 1")
        if self.token is not None and not self.token:
            raise UsageError("the token is empty; put a secret in the --token-file")
        if not self.ping_interval > 0:
            raise UsageError(f"ping_interval {self.ping_interval} must be > 0")
        if self.prefetch_factor < 1:
            raise UsageError(f"prefetch_factor {self.prefetch_factor} must be >= 1")


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and ``localhost``: binds that need no token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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
    with _SERIAL_PIPELINE:
        try:
            next(batches)
        finally:
            batches.close()  # type: ignore[attr-defined]


def steps_of_pass(dataset: ShardedDataset, epoch: int, position: int, world_size: int) -> int:
    """Steps per rank of the pass of ``epoch`` that begins after ``position`` global batches."""
    view = dataset.for_rank(0, world_size)
    view.seek(epoch, position)
    return len(view)


# -- metrics ----------------------------------------------------------------------------------


class _Metrics:
    """Counters for ``/metrics``; producer threads and the event loop both write."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.batches = 0
        self.bytes = 0
        self.streams = 0
        self.streams_done = 0
        self.rejected: dict[str, int] = {}
        self.pipeline_errors = 0
        self.busy_seconds = 0.0  # producers waiting on the pipeline for a batch
        self.idle_seconds = 0.0  # producers blocked because their client had not taken batches
        self.active: dict[int, _Stream] = {}

    def reject(self, status: int) -> None:
        with self.lock:
            self.rejected[str(status)] = self.rejected.get(str(status), 0) + 1

    def render(self) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str,
                   rows: list[tuple[dict[str, Any], float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in rows:
                text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
                labelled = f"{name}{{{text}}}" if text else name
                out.append(f"{labelled} {_number(value)}")

        with self.lock:
            streams = list(self.active.values())
            busy, idle = self.busy_seconds, self.idle_seconds
            for s in streams:
                b, i = s.times()
                busy, idle = busy + b, idle + i
            metric("shardloader_batches_served_total", "counter", "Batches sent to clients.",
                   [({}, self.batches)])
            metric("shardloader_bytes_served_total", "counter", "Frame bytes sent to clients.",
                   [({}, self.bytes)])
            metric("shardloader_streams_total", "counter", "Batch streams accepted.",
                   [({}, self.streams)])
            metric("shardloader_streams_active", "gauge", "Batch streams open now.",
                   [({}, len(streams))])
            metric("shardloader_requests_rejected_total", "counter",
                   "Requests answered with an error status.",
                   [({"status": k}, v) for k, v in sorted(self.rejected.items())])
            metric("shardloader_pipeline_errors_total", "counter",
                   "Streams ended by an error in the pipeline.", [({}, self.pipeline_errors)])
            metric("shardloader_pipeline_busy_seconds_total", "counter",
                   "Producer time spent waiting for the pipeline to finish a batch.",
                   [({}, busy)])
            metric("shardloader_pipeline_busy_share", "gauge",
                   "Share of producer time the pipeline was the bottleneck (1: clients wait on "
                   "the pipeline; 0: the pipeline waits on clients).",
                   [({}, busy / (busy + idle) if busy + idle > 0 else 0.0)])
            rows = [(s.labels(), s) for s in streams]
            metric("shardloader_client_lag_batches", "gauge",
                   "Batches ready on the server that the client has not taken yet.",
                   [(lab, s.lag) for lab, s in rows])
            metric("shardloader_client_next_step", "gauge",
                   "Next step the stream will send.", [(lab, s.next_step) for lab, s in rows])
            metric("shardloader_client_batches_total", "counter",
                   "Batches sent on this stream.", [(lab, s.sent) for lab, s in rows])
            metric("shardloader_client_blocked_seconds_total", "counter",
                   "Producer time blocked because this client did not take batches.",
                   [(lab, s.times()[1]) for lab, s in rows])
            metric("shardloader_client_pipeline_busy_share", "gauge",
                   "Share of this stream's producer time spent waiting for the pipeline.",
                   [(lab, s.busy_share()) for lab, s in rows])
        return "\n".join(out) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


# -- one stream: producer thread → bounded slots → event loop ---------------------------------


@dataclass(frozen=True)
class _Request:
    epoch: int
    rank: int
    world_size: int
    position: int
    start: int
    steps: int


class _Stream:
    """One client's batch stream: a producer thread and the frames it has ready."""

    _ids = itertools.count(1)

    def __init__(self, dataset: ShardedDataset, req: _Request, options: ServeOptions,
                 metrics: _Metrics, client: str, loop: asyncio.AbstractEventLoop) -> None:
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
        self._thread = threading.Thread(target=self._produce, name=f"shardloader-stream-{self.id}",
                                        daemon=True)

    def labels(self) -> dict[str, Any]:
        r = self.req
        return {"stream": self.id, "client": self.client, "epoch": r.epoch, "rank": r.rank,
                "world_size": r.world_size}

    @property
    def lag(self) -> int:
        """Batches ready here that the client has not taken (at most ``max_inflight``)."""
        return max(self.produced - self.sent, 0)

    def times(self) -> tuple[float, float]:
        """(seconds waiting on the pipeline, seconds waiting on the client), ongoing waits in."""
        now = time.monotonic()
        busy_since, idle_since = self._busy_since, self._idle_since
        return (self._busy + (now - busy_since if busy_since is not None else 0.0),
                self._idle + (now - idle_since if idle_since is not None else 0.0))

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
                view = pass_dataset(self.dataset, r.epoch, r.position, r.rank, r.world_size,
                                    r.start)
                extra: dict[str, Any] = {"persistent_workers": False}
                if self.options.workers:
                    extra["prefetch_factor"] = self.options.prefetch_factor
                loader = make_loader(view, num_workers=self.options.workers, **extra)
                batches = iter(loader)
                try:
                    while not self.stop.is_set():
                        self._busy_since = t0 = time.monotonic()
                        try:
                            if self.options.workers:
                                batch = next(batches)
                            else:
                                with _SERIAL_PIPELINE:
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
            log.warning("stream %d (%s, epoch %d, rank %d/%d) failed at step %d: %s", self.id,
                        self.client, r.epoch, r.rank, r.world_size, step, err, exc_info=True)
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
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/x-shardloader-frames"),
                (b"cache-control", b"no-store"),
                (b"x-shardloader-protocol", str(PROTOCOL).encode()),
            ]})
            while True:
                get = asyncio.ensure_future(self.ready.get())
                done, _ = await asyncio.wait({get, left}, timeout=self.options.ping_interval,
                                             return_when=asyncio.FIRST_COMPLETED)
                if left in done or not done:
                    get.cancel()
                    if left in done:
                        return
                    await send({"type": "http.response.body", "more_body": True,
                                "body": encode_control("ping", self.next_step)})
                    continue
                chunks, last = get.result()
                for chunk in chunks:
                    for piece in _pieces(chunk):
                        await send({"type": "http.response.body", "body": piece,
                                    "more_body": True})
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


# -- the app ----------------------------------------------------------------------------------


class _ServiceError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def _params(query: Any, allowed: dict[str, bool]) -> dict[str, str]:
    """Query parameters, each at most once, all known; ``allowed`` maps name → required."""
    out: dict[str, str] = {}
    for key, value in query.multi_items():
        if key not in allowed:
            raise _ServiceError(400, f"unknown parameter {key!r}; known: {', '.join(allowed)}")
        if key in out:
            raise _ServiceError(400, f"parameter {key!r} is given more than once")
        out[key] = value
    missing = [k for k, required in allowed.items() if required and k not in out]
    if missing:
        raise _ServiceError(400, f"missing parameter(s): {', '.join(missing)}")
    return out


def _int(params: dict[str, str], name: str, default: int, lo: int = 0) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        raise _ServiceError(400, f"{name}={raw[:40]!r} is not an integer") from None
    if not lo <= value < _MAX_INT:
        raise _ServiceError(400, f"{name}={value} is outside [{lo}, 2**62)")
    return value


class Service:
    """Endpoints, auth and the stream registry around one dataset."""

    def __init__(self, dataset: ShardedDataset, options: ServeOptions) -> None:
        self.dataset, self.options = dataset, options
        self.metrics = _Metrics()
        self._token = options.token.encode() if options.token else None
        self._steps: dict[tuple[int, int, int], int] = {}

    def check_token(self, headers: Any) -> None:
        if self._token is None:
            return
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(),
                                                                 self._token):
            raise _ServiceError(401, "missing or wrong token: send 'Authorization: Bearer "
                                "<token>' with the token in the server's --token-file",
                                {"www-authenticate": 'Bearer realm="shardloader"'})

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        _params(request.query_params, {})
        return JSONResponse({"status": "ok", "protocol": PROTOCOL})

    async def metrics_text(self, request: Any) -> Any:
        from starlette.responses import Response

        _params(request.query_params, {})
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def _read_request(self, params: dict[str, str]) -> tuple[int, int, int, int]:
        epoch = _int(params, "epoch", 0)
        world = _int(params, "world_size", 1, lo=1)
        rank = _int(params, "rank", 0)
        if rank >= world:
            raise _ServiceError(400, f"rank {rank} is outside world_size {world}")
        position = _int(params, "position", 0)
        ds = self.dataset
        for name, mine in (("fingerprint", ds.manifest.fingerprint), ("seed", str(ds.seed)),
                           ("plan", ds.plan_signature)):
            if name in params and params[name] != mine:
                raise _ServiceError(
                    409, f"the client expects {name} {params[name][:200]!r} but this server "
                    f"serves {mine!r}: client and server must read the same dataset with the "
                    "same seed and plan (check the URL list and the loader state)")
        return epoch, rank, world, position

    async def _pass_steps(self, epoch: int, position: int, world: int) -> int:
        key = (epoch, position, world)
        steps = self._steps.get(key)
        if steps is None:
            from starlette.concurrency import run_in_threadpool

            try:
                steps = await run_in_threadpool(steps_of_pass, self.dataset, epoch, position,
                                                world)
            except UsageError as err:
                raise _ServiceError(400, str(err)) from None
            if len(self._steps) > 256:
                self._steps.clear()
            self._steps[key] = steps
        return steps

    async def info(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        allowed = {"epoch": False, "rank": False, "world_size": False, "position": False,
                   **{k: False for k in _CONTROL_PARAMS}}
        params = _params(request.query_params, allowed)
        epoch, rank, world, position = self._read_request(params)
        ds = self.dataset
        return JSONResponse({
            "protocol": PROTOCOL, "fingerprint": ds.manifest.fingerprint, "seed": ds.seed,
            "plan": ds.plan_signature, "num_samples": ds.manifest.num_samples,
            "batch_size": ds.batch_size, "epoch": epoch, "rank": rank, "world_size": world,
            "position": position, "steps": await self._pass_steps(epoch, position, world),
        })

    async def batches(self, request: Any) -> Any:
        if request.method != "GET":  # a HEAD would run a pipeline to send nothing
            raise _ServiceError(405, "use GET for /v1/batches", {"allow": "GET"})
        allowed = {"epoch": True, "rank": True, "world_size": True, "position": False,
                   "start": False, **{k: False for k in _CONTROL_PARAMS}}
        params = _params(request.query_params, allowed)
        epoch, rank, world, position = self._read_request(params)
        start = _int(params, "start", 0)
        steps = await self._pass_steps(epoch, position, world)
        if start > steps:
            raise _ServiceError(400, f"start={start} is past the {steps} steps rank {rank} has "
                                f"in epoch {epoch} from position {position}")
        if len(self.metrics.active) >= self.options.max_clients:
            raise _ServiceError(503, f"this server already runs {self.options.max_clients} "
                                "streams (--max-clients); retry shortly or use another replica",
                                {"retry-after": "1"})
        client = request.client
        name = f"{client.host}:{client.port}" if client else "?"
        stream = _Stream(self.dataset, _Request(epoch, rank, world, position, start, steps),
                         self.options, self.metrics, name, asyncio.get_running_loop())
        with self.metrics.lock:
            self.metrics.active[stream.id] = stream
            self.metrics.streams += 1
        stream.start()
        log.info("stream %d: %s epoch %d rank %d/%d position %d from step %d of %d", stream.id,
                 name, epoch, rank, world, position, start, steps)
        return _StreamResponse(stream)


class _StreamResponse:
    """An ASGI response that runs a stream (starlette calls it like any Response)."""

    def __init__(self, stream: _Stream) -> None:
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream.respond(scope, receive, send)


class _Auth:
    """Pure ASGI middleware: every request but ``/health`` carries the bearer token."""

    def __init__(self, app: Any, service: Service) -> None:
        self.app, self.service = app, service

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            from starlette.datastructures import Headers

            try:
                self.service.check_token(Headers(scope=scope))
            except _ServiceError as err:
                self.service.metrics.reject(err.status)
                response = _error_response(err.status, err.message, err.headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message, "status": status}, status_code=status,
                        headers=headers)


def create_app(dataset: ShardedDataset, options: ServeOptions | None = None) -> Any:
    """The Starlette app serving ``dataset`` (run it with uvicorn; see :func:`serve`)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    if not isinstance(dataset, ShardedDataset):
        raise UsageError(f"the pipeline must be a ShardedDataset, got {type(dataset).__name__}")
    service = Service(dataset, options or ServeOptions())

    async def on_error(request: Any, exc: Exception) -> Any:
        if isinstance(exc, _ServiceError):
            status, message, headers = exc.status, exc.message, exc.headers
        elif isinstance(exc, HTTPException):
            status, message, headers = exc.status_code, exc.detail, dict(exc.headers or {})
            if status == 404:
                message = (f"no such endpoint {request.url.path!r}; see /v1/info, /v1/batches, "
                           "/metrics, /health")
        else:  # pragma: no cover - registered for the two types above only
            raise exc
        service.metrics.reject(status)
        return _error_response(status, message, headers)

    app = Starlette(
        routes=[Route("/health", service.health), Route("/metrics", service.metrics_text),
                Route("/v1/info", service.info), Route("/v1/batches", service.batches)],
        middleware=[Middleware(_Auth, service=service)],
        exception_handlers={_ServiceError: on_error, HTTPException: on_error},
    )
    app.state.service = service
    return app


def serve(dataset: ShardedDataset, options: ServeOptions, *, host: str, port: int,
          on_ready: Callable[[str, int], None] | None = None, log_level: str = "warning") -> None:
    """Bind ``host:port`` (0: any free port), call ``on_ready(host, port)``, serve until SIGTERM.

    A non-loopback ``host`` needs a token (the CLI checks this too).
    """
    import socket

    import uvicorn

    if not is_loopback(host) and options.token is None:
        raise UsageError(f"--host {host} is not a loopback address: pass --token-file so every "
                         "request is authenticated")
    app = create_app(dataset, options)
    warm_up(dataset)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as err:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {err}") from err
    sock.listen(128)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                            http="h11", loop="asyncio", timeout_graceful_shutdown=3,
                            timeout_keep_alive=30)
    server = uvicorn.Server(config)
    if on_ready is not None:
        on_ready(host, bound)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
