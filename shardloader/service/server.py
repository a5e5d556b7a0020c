"""The service: run a dataset's pipeline here, stream each rank's finished batches to trainers.

:func:`serve` binds the socket and runs the app (:mod:`shardloader.service.app`: endpoints and
auth) under uvicorn.  Per stream (:mod:`shardloader.service.stream`, NOTE [what a stream is]) a
producer thread iterates a DataLoader (``workers`` processes) and hands encoded frames
(:mod:`shardloader.service.wire`) to the event loop through at most ``max_inflight`` slots: a
slow client blocks its producer, so memory stays flat.  Streams beyond ``max_clients`` get 503
with Retry-After.  Counters: :mod:`shardloader.service.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardloader.dataset import ShardedDataset
from shardloader.errors import UsageError
from shardloader.service.app import create_app
from shardloader.service.options import ServeOptions, is_loopback
from shardloader.service.passes import warm_up

__all__ = ["serve", "uvicorn_server"]


def serve(
    dataset: ShardedDataset,
    options: ServeOptions,
    *,
    host: str,
    port: int,
    on_ready: Callable[[str, int], None] | None = None,
    log_level: str = "warning",
    declared: Mapping[str, Any] | None = None,
) -> None:
    """Bind ``host:port`` (0: any free port), call ``on_ready(host, port)``, serve until SIGTERM.

    A non-loopback ``host`` needs a token.  ``declared``: the options
    that built the dataset's pipeline, part of its fingerprint (NOTE [pinned pipeline] in
    :mod:`shardloader.service.fingerprint`).
    """
    import socket

    if not is_loopback(host) and options.token is None:
        raise UsageError(
            f"--host {host} is not a loopback address: pass --token-file so every "
            "request is authenticated"
        )
    app = create_app(dataset, options, declared)
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
    server = uvicorn_server(app, options, log_level)
    if on_ready is not None:
        on_ready(host, bound)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def uvicorn_server(app: Any, options: ServeOptions, log_level: str = "warning") -> Any:
    """The ``uvicorn.Server`` that runs ``app`` under NOTE [connection rules]
    (:mod:`shardloader.service.connections`): header, idle and write timeouts, and a cap on
    connections that have sent no request."""
    import uvicorn

    from shardloader.service.connections import guarded_protocol

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=False,
        lifespan="off",
        http=guarded_protocol(options, app.state.service.metrics),
        loop="asyncio",
        timeout_graceful_shutdown=3,
        timeout_keep_alive=int(options.idle_timeout) + 1,  # ours (rule 1) comes first
    )
    return uvicorn.Server(config)
