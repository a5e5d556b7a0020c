"""The event loop's end of a stream: the HTTP response that writes the frames a stream's producer
thread hands over (a :class:`~shardloader.service.handoff.Handoff`, NOTE [frame hand-off]), with
pings while the pipeline has none ready, until the pass ends or the client leaves.  It reads
nothing of the stream but that hand-off.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from shardloader.service.frames import PROTOCOL, encode_control
from shardloader.service.handoff import Handoff

__all__ = ["Receive", "Scope", "Send", "stream_response"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def stream_response(handoff: Handoff, scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI response of a stream: the frames ``handoff`` gets as they come, pings while none
    do, until the last frame or a disconnect."""
    left = asyncio.ensure_future(_disconnected(receive))

    async def body(data: Any) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})

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
        handoff.wake = wake
        while True:
            if not handoff.pending:  # NOTE [frame hand-off]
                handoff.waiting = True
                if not handoff.pending:
                    nudge = asyncio.ensure_future(wake.wait())
                    done, _ = await asyncio.wait(
                        {nudge, left},
                        timeout=handoff.ping_interval,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                    nudge.cancel()
                    if left in done:
                        return
                    if not done and not handoff.pending:
                        await body(encode_control("ping", handoff.next_step))
                handoff.waiting = False
                wake.clear()
                continue
            small = bytearray()  # the frames queued now go out as one body where small
            last = False
            while handoff.pending and not last:
                frame = handoff.pending.popleft()
                last = frame.last
                for chunk in frame.chunks:
                    if memoryview(chunk).nbytes < _PIECE:
                        small += chunk
                        continue
                    if small:
                        await body(bytes(small))
                        small = bytearray()
                    for piece in _pieces(chunk):
                        await body(piece)
                handoff.written(frame)
            if small:
                await body(bytes(small))
            if last:
                break
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    except OSError:
        pass  # the client went away mid-write
    finally:
        left.cancel()


_PIECE = 1 << 18


def _pieces(chunk: Any) -> Iterator[Any]:
    """A large chunk in 256 KiB slices (views, no copy).

    NOTE: the HTTP layer copies every body it is given (chunked framing), and the event loop's
    transport copies whatever the socket does not take at once.  Pieces the size of a socket
    buffer are mostly taken at once and stay below the allocator's mmap threshold, which on
    9.6 MB image batches halves the server's CPU per batch.
    """
    view = memoryview(chunk).cast("B")
    for start in range(0, view.nbytes, _PIECE):
        yield view[start : start + _PIECE]


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
