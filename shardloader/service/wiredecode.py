"""Frames back into batches (NOTE [frame layout] in :mod:`shardloader.service.wire`): the
receiving side of a batch stream.  Values are built only from the layout's tags and allowlisted
dtypes, so a stream can never make the receiver run code; anything else is a
:class:`~shardloader.errors.DecodeError`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from shardloader.batching.raw import ByteColumn, RawBatch
from shardloader.errors import DecodeError
from shardloader.service.wireframes import (
    MAX_DEPTH,
    NUMPY_KINDS,
    TORCH_DTYPES,
    Frame,
    is_scalar,
)

__all__ = ["decode_batch", "decode_batches"]


class _Decoder:
    def __init__(self, frame: Frame) -> None:
        # every tensor is a view of one tensor over the payload
        self.payload = np.frombuffer(frame.payload, np.uint8)
        self._base: torch.Tensor | None = None
        spans = frame.header.get("buffers", [])
        if not isinstance(spans, list):
            raise DecodeError("frame buffers is not a list")
        self.spans: list[tuple[int, int]] = []
        for span in spans:
            if (
                not isinstance(span, list)
                or len(span) != 2
                or not all(isinstance(x, int) and x >= 0 for x in span)
                or span[0] + span[1] > len(self.payload)
            ):
                raise DecodeError(
                    f"frame buffer {span!r} lies outside the {len(self.payload)} B payload"
                )
            self.spans.append((span[0], span[1]))

    def span(self, index: Any) -> tuple[int, int]:
        if not isinstance(index, int) or not 0 <= index < len(self.spans):
            raise DecodeError(f"frame refers to buffer {index!r} of {len(self.spans)}")
        return self.spans[index]

    def node(self, node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not isinstance(node, list) or not node:
            raise DecodeError(f"malformed frame node {str(node)[:80]}")
        tag, args = node[0], node[1:]
        if tag == "j" and len(args) == 1 and is_scalar(args[0]):
            return args[0]
        if tag == "J" and len(args) == 1 and isinstance(args[0], list):
            if not all(is_scalar(v) for v in args[0]):
                raise DecodeError("a J node holds a non-scalar")
            return list(args[0])
        if tag in ("l", "u") and len(args) == 1 and isinstance(args[0], list):
            items = [self.node(v, depth + 1) for v in args[0]]
            return items if tag == "l" else tuple(items)
        if tag in ("d", "r") and len(args) == 1 and isinstance(args[0], dict):
            fields = {k: self.node(v, depth + 1) for k, v in args[0].items()}
            return fields if tag == "d" else RawBatch(fields)
        if tag == "b" and len(args) == 1:
            return self.bytes(args[0])
        if tag == "c" and len(args) == 3:
            return self.column(*args)
        if tag == "t" and len(args) == 4:
            return self.tensor(*args)
        if tag in ("n", "g") and len(args) == (3 if tag == "n" else 2):
            arr = self.array(args[0], args[1], args[2] if tag == "n" else [])
            return arr if tag == "n" else arr[()]
        raise DecodeError(f"malformed frame node {str(node)[:80]}")

    def tensor(self, index: Any, dtype_name: Any, shape: Any, layout: Any) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise DecodeError(f"frame tensor has dtype {dtype_name!r}, not one of the allowlist")
        if layout not in ("c", "cl") or (layout == "cl" and len(_shape(shape)) != 4):
            raise DecodeError(f"frame tensor layout {layout!r} does not fit shape {shape!r}")
        dims = _shape(shape)
        off, n = self.span(index)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if math.prod(dims) * itemsize != n:
            raise DecodeError(f"frame tensor {dims} {dtype_name} does not fill its {n} B buffer")
        if n == 0:
            return torch.empty(dims, dtype=dtype)
        if off % itemsize:
            raise DecodeError(f"frame tensor buffer at {off} is not aligned to its {dtype_name}")
        if self._base is None:
            self._base = torch.from_numpy(self.payload)
        flat = self._base[off : off + n].view(dtype)
        if layout == "cl":
            b, c, h, w = dims
            return flat.view(b, h, w, c).permute(0, 3, 1, 2)
        return flat.view(dims)

    def view(self, off: int, n: int) -> np.ndarray:
        """Bytes ``off..off+n`` of the payload as an array that keeps the payload alive (a
        plain numpy slice would refer to the payload's base only)."""
        if self._base is None:
            self._base = torch.from_numpy(self.payload)
        return self._base[off : off + n].numpy()

    def bytes(self, index: Any) -> bytes:
        off, n = self.span(index)
        return self.payload[off : off + n].tobytes()

    def column(self, data: Any, offsets: Any, present: Any) -> ByteColumn:
        """A ByteColumn over the payload (its values come out as bytes when read)."""
        d_off, d_n = self.span(data)
        raw = self.view(d_off, d_n).data.toreadonly()
        off, n = self.span(offsets)
        if n % 8 or n == 0:
            raise DecodeError(f"frame column offsets fill {n} B, not a whole int64 array")
        at = np.frombuffer(self.payload[off : off + n].tobytes(), "<i8").astype(np.int64)
        if at[0] != 0 or at[-1] != len(raw) or (len(at) > 1 and np.any(np.diff(at) < 0)):
            raise DecodeError("frame column offsets do not cut its buffer in order")
        there = None
        if present is not None:
            p_off, p_n = self.span(present)
            if p_n != len(at) - 1:
                raise DecodeError(f"frame column presence has {p_n} values for {len(at) - 1}")
            there = self.payload[p_off : p_off + p_n].astype(bool)
        return ByteColumn(raw, at, there)

    def array(self, index: Any, dtype_name: Any, shape: Any) -> np.ndarray:
        try:
            dtype = np.dtype(dtype_name) if isinstance(dtype_name, str) else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in NUMPY_KINDS or dtype.fields is not None:
            raise DecodeError(f"frame array has dtype {dtype_name!r}, not one of the allowlist")
        dims = _shape(shape)
        off, n = self.span(index)
        if math.prod(dims) * dtype.itemsize != n:
            raise DecodeError(f"frame array {dims} {dtype_name} does not fill its {n} B buffer")
        if n == 0:
            return np.empty(dims, dtype=dtype)
        if off % dtype.itemsize:
            raise DecodeError(f"frame array buffer at {off} is not aligned to its {dtype_name}")
        if self._base is None:
            self._base = torch.from_numpy(self.payload)
        return self._base[off : off + n].numpy().view(dtype).reshape(dims)


def _shape(shape: Any) -> list[int]:
    if (
        not isinstance(shape, list)
        or len(shape) > 32
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise DecodeError(f"malformed frame shape {shape!r}")
    return shape


def decode_batch(frame: Frame) -> Any:
    """The batch a one-batch frame carries; its tensors share the frame's payload buffer."""
    batches = decode_batches(frame)
    if len(batches) != 1:
        raise DecodeError(f"a frame of {len(batches)} batches where one was expected")
    return batches[0]


def decode_batches(frame: Frame) -> list[Any]:
    """The batches (consecutive steps from the header's ``step``) a ``batch`` frame carries;
    their tensors share the frame's payload."""
    header = frame.header
    if frame.kind != "batch" or ("tree" in header) == ("trees" in header):
        raise DecodeError(f"a {frame.kind!r} frame carries no batch")
    if "shm" in header or "ring" in header:  # shared memory this client never asks for
        raise DecodeError("a frame's payload is not where its header says")
    trees = [header["tree"]] if "tree" in header else header["trees"]
    if not isinstance(trees, list) or not trees:
        raise DecodeError("a batch frame's trees are not a non-empty list")
    decoder = _Decoder(frame)
    return [decoder.node(tree, 0) for tree in trees]
