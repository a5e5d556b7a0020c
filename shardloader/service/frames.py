"""Frames: how ``shardloader serve`` and :class:`RemoteLoader` cut a stream into messages.

NOTE [frame layout, protocol 1]: a batch stream is a sequence of frames::

    prefix   16 bytes   b"SLF1" | header length (uint32 LE) | payload length (uint64 LE)
    header   UTF-8 JSON {"kind": "batch"|"end"|"error"|"ping", "step": int, ...}
    payload  raw bytes (a batch's values: service/wire.py)

``PROTOCOL`` numbers the whole stream format, frames and the batches in them; a client and a
server of different protocols refuse each other at the start.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.errors import DecodeError, TruncatedBodyError, UsageError

__all__ = [
    "MAGIC",
    "PROTOCOL",
    "SMALL_PIECE",
    "Frame",
    "encode_control",
    "frame_chunks",
    "frame_size",
    "read_frame",
]

MAGIC = b"SLF1"
PROTOCOL = 3
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 << 20  # a header this large means a broken or hostile stream
MAX_PAYLOAD = 1 << 36
KINDS = ("batch", "end", "error", "ping")
SMALL_PIECE = 64 << 10  # smaller pieces are copied together (encode) or into a bytearray (read)


@dataclass(frozen=True)
class Frame:
    """One decoded frame: its header (JSON) and its raw payload."""

    header: dict[str, Any]
    payload: memoryview  # writable bytes; decoded tensors and arrays share it

    @property
    def kind(self) -> str:
        return str(self.header["kind"])


def frame_size(chunks: list[Any]) -> int:
    """Bytes on the wire of an encoded frame (the sum of its chunks)."""
    return sum(memoryview(c).nbytes for c in chunks)


def frame_chunks(header: dict[str, Any], body: list[Any], size: int) -> list[Any]:
    """A frame's chunks to write in order: prefix and ``header``, then ``body`` (``size`` bytes
    of payload); :mod:`shardloader.service.response` joins small chunks into one write."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return [_PREFIX.pack(MAGIC, len(head), size) + head, *body]


ReadInto = Callable[[memoryview], int]


def _fill(readinto: ReadInto, view: memoryview) -> int:
    """Read into ``view`` until it is full or the stream ends; the bytes read."""
    got = 0
    while got < len(view) and (k := readinto(view[got:])):
        got += k
    return got


def _read_exact(readinto: ReadInto, n: int, what: str) -> memoryview:
    # numpy's empty: no zero-filling pass over a buffer the socket is about to fill
    try:
        view = np.empty(n, np.uint8).data if n >= SMALL_PIECE else memoryview(bytearray(n))
    except MemoryError as err:
        raise DecodeError(f"a frame announces a {what} of {n} bytes; cannot hold it") from err
    if (got := _fill(readinto, view)) < n:
        raise TruncatedBodyError(f"stream ended inside a frame's {what} ({got} of {n} bytes)")
    return view


def read_frame(readinto: ReadInto) -> Frame | None:
    """Read one frame with ``readinto`` (file-like ``readinto``); None at a clean end of stream.

    A stream cut inside a frame raises ``TruncatedBodyError`` (a ``ConnectionError``: worth a
    reconnect); a malformed frame raises :class:`DecodeError`.
    """
    first = memoryview(bytearray(_PREFIX.size))
    got = _fill(readinto, first)
    if got == 0:
        return None
    if got < len(first):
        raise TruncatedBodyError(f"stream ended inside a frame prefix ({got} bytes)")
    magic, head_len, size = _PREFIX.unpack(first)
    if magic != MAGIC:
        raise DecodeError(f"not a shardloader frame (magic {bytes(magic)!r}, want {MAGIC!r})")
    if head_len > MAX_HEADER or size > MAX_PAYLOAD:
        raise DecodeError(f"frame header {head_len} B / payload {size} B exceed the limits")
    try:
        header = json.loads(bytes(_read_exact(readinto, head_len, "header")))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DecodeError(f"frame header is not JSON: {err}") from err
    if not isinstance(header, dict) or header.get("kind") not in KINDS:
        raise DecodeError(f"frame header has no known kind: {str(header)[:200]}")
    if not isinstance(header.get("step"), int):
        raise DecodeError(f"frame header has no integer step: {str(header)[:200]}")
    return Frame(header, _read_exact(readinto, size, "payload"))


def encode_control(kind: str, step: int, **fields: Any) -> bytes:
    """An ``end`` / ``error`` / ``ping`` frame (no payload)."""
    if kind not in KINDS or kind == "batch":
        raise UsageError(f"control frame kind {kind!r} is not one of end, error, ping")
    return b"".join(frame_chunks({"kind": kind, "step": int(step), **fields}, [], 0))
