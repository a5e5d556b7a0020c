"""Batches into frames (NOTE [frame layout] in :mod:`shardloader.service.wire`): the sending
side of a batch stream.  Only the types the layout names are encoded; anything else is a
:class:`~shardloader.errors.UsageError` here, before a byte is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from shardloader.batching.raw import ByteColumn, RawBatch
from shardloader.errors import UsageError
from shardloader.service.wireframes import (
    KINDS,
    MAX_DEPTH,
    NUMPY_KINDS,
    TORCH_DTYPES,
    frame_chunks,
    is_scalar,
)

__all__ = [
    "encode_batch",
    "encode_batches",
    "encode_control",
]

_ALIGN = 64
_JOIN = 32  # a column of more values than this is joined before it is copied
_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class _Encoder:
    def __init__(self) -> None:
        self.buffers: list[memoryview | list[memoryview]] = []
        self.spans: list[list[int]] = []
        self.size = 0

    def add(self, raw: memoryview | list[memoryview]) -> int:
        """A buffer (or several, end to end: one span) of the payload; its index."""
        offset = -(-self.size // _ALIGN) * _ALIGN
        nbytes = raw.nbytes if isinstance(raw, memoryview) else sum(p.nbytes for p in raw)
        self.buffers.append(raw)
        self.spans.append([offset, nbytes])
        self.size = offset + nbytes
        return len(self.spans) - 1

    def node(self, value: Any, where: str, depth: int) -> list[Any]:
        if depth > MAX_DEPTH:
            raise UsageError(f"batch value at {where} is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, np.generic):  # before float: np.float64 subclasses float
            dtype = _numpy_dtype_name(value.dtype, where)
            return ["g", self.add(_raw(np.asarray(value))), dtype]
        if value is None or isinstance(value, bool | int | float | str):
            return ["j", value]  # JSON keeps floats exactly (repr round-trips), NaN/inf included
        if isinstance(value, torch.Tensor):
            return self.tensor(value, where)
        if isinstance(value, np.ndarray):
            dtype = _numpy_dtype_name(value.dtype, where)
            arr = value if value.flags.c_contiguous else value.copy(order="C")  # keeps 0-d
            return ["n", self.add(_raw(arr)), dtype, list(arr.shape)]
        if isinstance(value, bytes):
            return ["b", self.add(memoryview(value))]
        if isinstance(value, list | tuple):
            if isinstance(value, list) and all(is_scalar(v) for v in value):
                return ["J", list(value)]
            items = [self.node(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
            return ["l" if isinstance(value, list) else "u", items]
        if isinstance(value, ByteColumn):
            parts, offsets, present = value.pieces()  # not joined: copied once, below
            if len(parts) > _JOIN:  # many small values: one C-level join beats a Python loop
                data: memoryview | list[memoryview] = memoryview(b"".join(parts))
            else:
                data = [memoryview(p).cast("B") for p in parts]
            return [
                "c",
                self.add(data),
                self.add(_raw(np.ascontiguousarray(offsets, dtype="<i8"))),
                None if present is None or present.all() else self.add(_raw(present)),
            ]
        if isinstance(value, dict):
            out = {}
            for key, v in value.items():
                if not isinstance(key, str):
                    raise UsageError(
                        f"batch dict at {where} has a {type(key).__name__} key {key!r}; only str "
                        "keys can be sent (convert the key in the collate function)"
                    )
                out[key] = self.node(v, f"{where}[{key!r}]", depth + 1)
            return ["r" if isinstance(value, RawBatch) else "d", out]
        raise UsageError(
            f"batch value at {where} is a {type(value).__module__}.{type(value).__qualname__}, "
            "which shardloader serve cannot send: batches may hold tensors, numpy arrays, bytes, "
            "str/int/float/bool/None and lists, tuples and str-keyed dicts of them (nothing is "
            "pickled); convert it in the transform or collate function"
        )

    def tensor(self, t: torch.Tensor, where: str) -> list[Any]:
        name = _TORCH_NAMES.get(t.dtype)
        if name is None or t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
            raise UsageError(
                f"batch tensor at {where} ({t.dtype}, {t.layout}, {t.device}) cannot be sent: "
                f"only dense CPU tensors of {', '.join(TORCH_DTYPES)}"
            )
        t = t.detach()
        layout = "c"
        if (
            t.dim() == 4
            and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last)
        ):
            t, layout = t.permute(0, 2, 3, 1), "cl"  # NHWC order: a contiguous view, no copy
        shape = list(t.shape) if layout == "c" else [t.shape[0], t.shape[3], t.shape[1], t.shape[2]]
        t = t.contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")
        return ["t", self.add(raw), name, shape, layout]


def _raw(arr: np.ndarray) -> memoryview:
    return arr.reshape(-1).view(np.uint8).data if arr.size else memoryview(b"")


def _numpy_dtype_name(dtype: np.dtype, where: str) -> str:
    if dtype.kind not in NUMPY_KINDS or dtype.byteorder == ">" or dtype.fields is not None:
        raise UsageError(
            f"numpy value at {where} has dtype {dtype}; only little-endian bool/int/uint/float/"
            "complex arrays can be sent"
        )
    return dtype.newbyteorder("<").str if dtype.itemsize > 1 else dtype.str


def encode_batch(step: int, batch: Any) -> list[Any]:
    """Encode one batch as a frame: a list of chunks (bytes / memoryviews) to write in order.

    The chunks alias the batch's tensors (no copy); keep the batch alive until they are sent.
    """
    enc = _Encoder()
    tree = enc.node(batch, "batch", 0)
    header = {"kind": "batch", "step": int(step), "tree": tree, "buffers": enc.spans}
    return frame_chunks(header, enc.buffers, enc.spans, enc.size)


def encode_batches(step: int, batches: list[Any]) -> list[Any]:
    """Encode consecutive batches (steps ``step, step + 1, ...``) as one frame.

    The chunks alias the batches' tensors (no copy); keep the batches alive until they are
    sent.
    """
    enc = _Encoder()
    trees = [enc.node(b, f"batch (step {step + i})", 0) for i, b in enumerate(batches)]
    header: dict[str, Any] = {"kind": "batch", "step": int(step)}
    if len(trees) == 1:
        header["tree"] = trees[0]
    else:
        header["trees"] = trees
    header["buffers"] = enc.spans
    return frame_chunks(header, enc.buffers, enc.spans, enc.size)


def encode_control(kind: str, step: int, **fields: Any) -> bytes:
    """An ``end`` / ``error`` / ``ping`` frame (no payload)."""
    if kind not in KINDS or kind == "batch":
        raise UsageError(f"control frame kind {kind!r} is not one of end, error, ping")
    return b"".join(frame_chunks({"kind": kind, "step": int(step), **fields}, [], [], 0))
