"""The HTTP face of the service: endpoints, bearer-token auth, errors as JSON, the stream registry.

``/health`` (no token), ``/metrics`` (Prometheus text), ``/v1/info`` (the pass a client would
read) and ``/v1/batches`` (a stream of frames, :mod:`shardloader.service.stream`).  Streams
beyond ``max_clients`` get 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import logging
from collections.abc import Mapping
from typing import Any, cast

from shardloader.dataset import ShardedDataset
from shardloader.errors import UsageError
from shardloader.plan.partition import choose_partition
from shardloader.service.fingerprint import fingerprint, pipeline_spec
from shardloader.service.frames import PROTOCOL
from shardloader.service.metrics import Metrics
from shardloader.service.options import ServeOptions
from shardloader.service.passes import steps_of_pass
from shardloader.service.response import Receive, Scope, Send
from shardloader.service.stream import Request, Stream

__all__ = ["Service", "create_app"]

log = logging.getLogger(__name__)

_MAX_INT = 1 << 62
# what /v1/info and /v1/batches both take: the pass asked for, and what the client pinned
_PASS_PARAMS: tuple[str, ...] = ("epoch", "rank", "world_size", "position", "ranks_per_node")
_PASS_PARAMS += ("fingerprint", "seed", "plan", "partitions", "pipeline")


class _ServiceError(Exception):
    """An answer with an error status; its JSON body holds ``message`` and ``extra``."""

    def __init__(
        self,
        status: int,
        message: str,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}
        self.body = {**(extra or {}), "error": message, "status": status}

    def response(self) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


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

    def __init__(
        self,
        dataset: ShardedDataset,
        options: ServeOptions,
        declared: Mapping[str, Any] | None = None,
    ) -> None:
        self.dataset, self.options = dataset, options
        self.metrics = Metrics()
        # NOTE [pinned pipeline] in shardloader/service/fingerprint.py
        self.pipeline_spec = pipeline_spec(dataset, declared)
        self.pipeline = fingerprint(self.pipeline_spec)
        self._token = options.token.encode() if options.token else None
        # planning a pass walks its epoch: once per pass asked for (a client asks twice)
        self._steps_of = functools.lru_cache(maxsize=256)(functools.partial(steps_of_pass, dataset))

    def check_token(self, headers: Any) -> None:
        if self._token is None:
            return
        scheme, _, value = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            value.strip().encode(), self._token
        ):
            raise _ServiceError(
                401,
                "missing or wrong token: send 'Authorization: Bearer "
                "<token>' with the token in the server's --token-file",
                # NOTE [connection rules] 4: no idle connection for a client without the token
                {"www-authenticate": 'Bearer realm="shardloader"', "connection": "close"},
            )

    async def health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        _params(request.query_params, {})
        return JSONResponse({"status": "ok", "protocol": PROTOCOL})

    async def metrics_text(self, request: Any) -> Any:
        from starlette.responses import Response

        _params(request.query_params, {})
        return Response(
            self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    def _read_request(self, params: dict[str, str]) -> Request:
        epoch = _int(params, "epoch", 0)
        world = _int(params, "world_size", 1, lo=1)
        rank = _int(params, "rank", 0)
        if rank >= world:
            raise _ServiceError(400, f"rank {rank} is outside world_size {world}")
        position = _int(params, "position", 0)
        per_node = _int(params, "ranks_per_node", 0) or None
        if per_node is not None and world % per_node:
            raise _ServiceError(
                400, f"ranks_per_node={per_node} does not divide world_size={world}"
            )
        ds = self.dataset
        # the partitions this client's world reads in (NOTE [node partitions]): a saved
        # position means the same batches only in the same ones
        partitions = choose_partition(
            ds.partition_mode, world, per_node, ds.manifest.num_samples
        ).nodes
        for name, mine in (
            ("fingerprint", ds.manifest.fingerprint),
            ("seed", str(ds.seed)),
            ("plan", ds.plan_signature),
        ):
            if params.get(name, mine) != mine:
                raise _ServiceError(
                    409,
                    f"the client expects {name} {params[name][:200]!r} but this server "
                    f"serves {mine!r}: client and server must read the same dataset with the "
                    "same seed and plan (check the URL list and the loader state)",
                )
        if params.get("partitions", str(partitions)) != str(partitions):
            raise _ServiceError(
                409,
                f"the client's position was counted in {params['partitions'][:20]!r} partitions, "
                f"but a world of {world} ranks ({per_node or 'unknown'} a node) reads in "
                f"{partitions} here: resume with the same world and ranks per node, or on a "
                "local loader (make_loader), which re-plans the rest for the new partitions",
            )
        if params.get("pipeline", self.pipeline) != self.pipeline:
            raise _ServiceError(
                409,
                f"the client reads pipeline {params['pipeline'][:40]!r} but this server runs "
                f"pipeline {self.pipeline!r} (another decoder, transform, collate or "
                "--transform options): its batches would differ; start every replica with "
                "the same pipeline and options",
                extra={"pipeline": self.pipeline, "pipeline_spec": self.pipeline_spec},
            )
        return Request(epoch, rank, world, position, per_node, partitions)

    async def _pass_steps(self, a: Request) -> int:
        from starlette.concurrency import run_in_threadpool

        try:
            return await run_in_threadpool(
                self._steps_of, a.epoch, a.position, a.world_size, a.ranks_per_node
            )
        except UsageError as err:
            raise _ServiceError(400, str(err)) from None

    async def info(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        params = _params(request.query_params, dict.fromkeys(_PASS_PARAMS, False))
        a = self._read_request(params)
        ds = self.dataset
        return JSONResponse(
            {
                "protocol": PROTOCOL,
                "fingerprint": ds.manifest.fingerprint,
                "seed": ds.seed,
                "plan": ds.plan_signature,
                "pipeline": self.pipeline,
                "pipeline_spec": self.pipeline_spec,
                "num_samples": ds.manifest.num_samples,
                "batch_size": ds.batch_size,
                **dataclasses.asdict(a),  # the pass asked for (epoch, rank, ...), as read here
                "steps": await self._pass_steps(a),
            }
        )

    async def batches(self, request: Any) -> Any:
        if request.method != "GET":  # a HEAD would run a pipeline to send nothing
            raise _ServiceError(405, "use GET for /v1/batches", {"allow": "GET"})
        required = dict.fromkeys(("epoch", "rank", "world_size"), True)
        allowed = {**dict.fromkeys((*_PASS_PARAMS, "start"), False), **required}
        params = _params(request.query_params, allowed)
        a = self._read_request(params)
        start = _int(params, "start", 0)
        steps = await self._pass_steps(a)
        if start > steps:
            raise _ServiceError(
                400,
                f"start={start} is past the {steps} steps rank {a.rank} has "
                f"in epoch {a.epoch} from position {a.position}",
            )
        if len(self.metrics.active) >= self.options.max_clients:
            raise _ServiceError(
                503,
                f"this server already runs {self.options.max_clients} "
                "streams (--max-clients); retry shortly or use another replica",
                {"retry-after": "1"},
            )
        client = request.client
        name = f"{client.host}:{client.port}" if client else "?"
        req = dataclasses.replace(a, start=start, steps=steps)
        stream = Stream(
            self.dataset, req, self.options, self.metrics, name, asyncio.get_running_loop()
        )
        log.info("stream %d: %s %s", stream.id, name, req)
        return stream  # an ASGI response: it writes the stream's frames


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
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    dataset: ShardedDataset,
    options: ServeOptions | None = None,
    declared: Mapping[str, Any] | None = None,
) -> Any:
    """The Starlette app serving ``dataset`` (run it with uvicorn; see :func:`serve`);
    ``declared``: the options that built its pipeline (NOTE [pinned pipeline])."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.routing import Route

    if not isinstance(dataset, ShardedDataset):
        raise UsageError(f"the pipeline must be a ShardedDataset, got {type(dataset).__name__}")
    service = Service(dataset, options or ServeOptions(), declared)

    async def on_error(request: Any, exc: Exception) -> Any:
        if isinstance(exc, HTTPException):  # starlette's own: 404, 405
            message = exc.detail
            if exc.status_code == 404:
                message = (
                    f"no such endpoint {request.url.path!r}; see /v1/info, /v1/batches, "
                    "/metrics, /health"
                )
            exc = _ServiceError(exc.status_code, message, dict(exc.headers or {}))
        err = cast(_ServiceError, exc)  # the two types it is registered for
        service.metrics.reject(err.status)
        return err.response()

    app = Starlette(
        routes=[
            Route("/health", service.health),
            Route("/metrics", service.metrics_text),
            Route("/v1/info", service.info),
            Route("/v1/batches", service.batches),
        ],
        middleware=[Middleware(_Auth, service=service)],
        exception_handlers={_ServiceError: on_error, HTTPException: on_error},
    )
    app.state.service = service
    return app
