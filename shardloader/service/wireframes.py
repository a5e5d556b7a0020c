"""What both ends of a batch stream share: the frame prefix and its limits, the dtype
allowlists, a frame's bytes written out and read back (NOTE [frame layout] in
:mod:`shardloader.service.wire`).

The encoder (:mod:`~shardloader.service.wireencode`) and the decoder
(:mod:`~shardloader.service.wiredecode`) turn batches into frames and back; this module knows
only the envelope, so a reader of a stream needs nothing else to cut it into frames.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.errors import DecodeError
from shardloader.storage.retry import TruncatedBodyError

__all__ = [
    "KINDS",
    "MAGIC",
    "MAX_DEPTH",
    "MAX_HEADER",
    "MAX_PAYLOAD",
    "NUMPY_KINDS",
    "PROTOCOL",
    "TORCH_DTYPES",
    "Frame",
    "ReadInto",
    "frame_chunks",
    "frame_size",
    "is_scalar",
    "iter_frames",
    "read_frame",
]

MAGIC = b"SLF1"
PROTOCOL = 2
_PREFIX = struct.Struct("<4sIQ")
MAX_HEADER = 64 << 20  # a header this large means a broken or hostile stream
MAX_PAYLOAD = 1 << 36
MAX_DEPTH = 64
KINDS = ("batch", "end", "error", "ping")
_SMALL = 64 << 10  # pieces below this are copied together: one write instead of many

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
    if hasattr(torch, name)
}
NUMPY_KINDS = frozenset("biufc")  # bool, int, uint, float, complex: plain bytes, nothing else


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


def is_scalar(v: Any) -> bool:
    """Whether a ``j``/``J`` node may hold ``v`` as plain JSON (a numpy scalar is a ``g`` node)."""
    return v is None or (isinstance(v, bool | int | float | str) and not isinstance(v, np.generic))


def frame_chunks(
    header: dict[str, Any], payload: list[Any], spans: list[list[int]], size: int
) -> list[Any]:
    """A frame's chunks (bytes / memoryviews) to write in order: prefix, ``header`` and
    the ``payload`` buffers at their ``spans`` (offset, nbytes), ``size`` bytes in all; small
    pieces are copied together, large ones go out without a copy."""
    head = json.dumps(header, separators=(",", ":")).encode()
    chunks: list[Any] = []
    small = bytearray(_PREFIX.pack(MAGIC, len(head), size) + head)
    pos = 0
    for raws, (offset, nbytes) in zip(payload, spans, strict=True):
        small += bytes(offset - pos)  # alignment padding
        for raw in raws if isinstance(raws, list) else (raws,):
            if raw.nbytes >= _SMALL:
                if small:
                    chunks.append(bytes(small))
                chunks.append(raw)  # large values go out without a copy
                small = bytearray()
            else:
                small += raw
        pos = offset + nbytes
    if small:
        chunks.append(bytes(small))
    return chunks


ReadInto = Callable[[memoryview], int]


def _read_exact(readinto: ReadInto, n: int, what: str) -> memoryview:
    # numpy's empty: no zero-filling pass over a buffer the socket is about to fill
    try:
        view = np.empty(n, np.uint8).data if n >= _SMALL else memoryview(bytearray(n))
    except MemoryError as err:
        raise DecodeError(f"a frame announces a {what} of {n} bytes; cannot hold it") from err
    got = 0
    while got < n:
        k = readinto(view[got:])
        if not k:
            raise TruncatedBodyError(f"stream ended inside a frame's {what} ({got} of {n} bytes)")
        got += k
    return view


def read_frame(readinto: ReadInto) -> Frame | None:
    """Read one frame with ``readinto`` (file-like ``readinto``); None at a clean end of stream.

    A stream cut inside a frame raises ``TruncatedBodyError`` (a ``ConnectionError``: worth a
    reconnect); a malformed frame raises :class:`DecodeError`.
    """
    first = bytearray(_PREFIX.size)
    view = memoryview(first)
    got = 0
    while got < len(first):
        k = readinto(view[got:])
        if not k:
            if got == 0:
                return None
            raise TruncatedBodyError(f"stream ended inside a frame prefix ({got} bytes)")
        got += k
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


def iter_frames(data: bytes | bytearray) -> Iterator[Frame]:
    """Frames of a complete byte string (tests, tools)."""
    view = memoryview(data)
    pos = 0

    def readinto(buf: memoryview) -> int:
        nonlocal pos
        n = min(len(buf), len(view) - pos)
        buf[:n] = view[pos : pos + n]
        pos += n
        return n

    while (frame := read_frame(readinto)) is not None:
        yield frame
