"""Batches in frames (service/frames.py) between ``shardloader serve`` and
:class:`RemoteLoader`: pure, no pickle.

A batch frame's payload holds every tensor, array and bytes value of the batch, each at an
offset aligned to 64 bytes; its header carries ``tree``, the batch's structure as tagged JSON
nodes, and ``buffers``, ``[offset, nbytes]`` per raw value.  Nodes (lists, so user keys such as
``"t"`` are never ambiguous): ``["j", scalar]`` (None, bool, int, float, str),
``["J", [scalar, ...]]`` (a list of scalars), ``["l", [node...]]``, ``["u", [node...]]``
(tuple), ``["d", {str: node}]``, ``["t", buffer, dtype, shape, layout]`` (torch tensor; layout
``"c"`` contiguous or ``"cl"`` channels-last), ``["n", buffer, dtype, shape]`` (numpy array),
``["g", buffer, dtype]`` (numpy scalar), ``["b", buffer]`` (bytes).

Protocol 2 adds: ``["r", {str: node}]`` (a :class:`~shardloader.batching.raw.RawBatch`),
``["c", data, offsets, present]`` (a :class:`~shardloader.batching.raw.ByteColumn`: buffer
indices; ``offsets`` int64 ``n + 1``, ``present`` bool ``n`` or null when every sample has the
field); a batch frame may carry ``trees`` (consecutive steps ``step, step + 1, ...``, one node
each, sharing the buffers) instead of ``tree``.  Protocol 3 adds ``["x", codec, text]``: a
``datetime``/``date``/``time``/``decimal`` value as that codec's text (codecs/allowlist.py).

Only the types the layout names are encoded: anything else (objects, sets, non-string dict
keys) is a :class:`~shardloader.errors.UsageError` on the sending side, before a byte is sent.
The receiving side builds values only from the layout's tags and allowlisted dtypes, so a
stream can never make it run code; anything else is a :class:`~shardloader.errors.DecodeError`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from shardloader.batching.raw import ByteColumn, RawBatch
from shardloader.codecs.allowlist import parse_typed, typed_text
from shardloader.errors import DecodeError, UsageError
from shardloader.service.frames import SMALL_PIECE, Frame, frame_chunks

__all__ = ["decode_batches", "encode_batches"]

MAX_DEPTH = 64

TORCH_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "bool uint8 int8 int16 int32 int64 uint16 uint32 uint64 float16 bfloat16 float32 float64 "
        "complex64 complex128"
    ).split()
    if hasattr(torch, name)
}
NUMPY_KINDS = frozenset("biufc")  # bool, int, uint, float, complex: plain bytes, nothing else


def is_scalar(v: Any) -> bool:
    """Whether a ``j``/``J`` node may hold ``v`` as plain JSON (a numpy scalar is a ``g`` node)."""
    return v is None or (isinstance(v, bool | int | float | str) and not isinstance(v, np.generic))


# -- batches into frames: the sending side ----------------------------------------------------

_ALIGN = 64
_JOIN = 32  # a column of more values than this is joined before it is copied
_TORCH_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class _Encoder:
    def __init__(self) -> None:
        self.chunks: list[Any] = []  # the payload so far: small pieces joined, large ones not
        self.small = bytearray()  # the small pieces since the last large one
        self.spans: list[list[int]] = []
        self.size = 0

    def add(self, raw: memoryview | list[memoryview]) -> int:
        """A buffer (or several, end to end: one span) of the payload; its index."""
        offset = -(-self.size // _ALIGN) * _ALIGN
        nbytes = raw.nbytes if isinstance(raw, memoryview) else sum(p.nbytes for p in raw)
        self.small += bytes(offset - self.size)  # alignment padding
        for part in raw if isinstance(raw, list) else (raw,):
            if part.nbytes < SMALL_PIECE:
                self.small += part
            else:  # large values go out without a copy
                self.chunks += [bytes(self.small), part] if self.small else [part]
                self.small = bytearray()
        self.spans.append([offset, nbytes])
        self.size = offset + nbytes
        return len(self.spans) - 1

    def body(self) -> list[Any]:
        """The payload's chunks."""
        return [*self.chunks, bytes(self.small)] if self.small else self.chunks

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
        if (typed := typed_text(value)) is not None:
            return ["x", *typed]
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
            "plain values (dates and decimals too) and lists, tuples and str-keyed dicts of them "
            "(nothing is pickled); convert it in the transform or collate function"
        )

    def tensor(self, t: torch.Tensor, where: str) -> list[Any]:
        name = _TORCH_NAMES.get(t.dtype)
        if name is None or t.layout != torch.strided or t.device.type != "cpu" or t.is_quantized:
            raise UsageError(
                f"batch tensor at {where} ({t.dtype}, {t.layout}, {t.device}) cannot be sent: "
                f"only dense CPU tensors of {', '.join(TORCH_DTYPES)}"
            )
        t = t.detach()
        shape, layout = list(t.shape), "c"  # the shape sent is always NCHW's
        if (
            t.dim() == 4
            and not t.is_contiguous()
            and t.is_contiguous(memory_format=torch.channels_last)
        ):
            t, layout = t.permute(0, 2, 3, 1), "cl"  # NHWC order: a contiguous view, no copy
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


def encode_batches(step: int, batches: list[Any]) -> list[Any]:
    """Encode consecutive batches (steps ``step, step + 1, ...``) as one frame.

    The chunks alias the batches' tensors (no copy); keep the batches alive until they are
    sent.
    """
    enc = _Encoder()
    trees = [enc.node(b, f"batch (step {step + i})", 0) for i, b in enumerate(batches)]
    key, value = ("tree", trees[0]) if len(trees) == 1 else ("trees", trees)
    header = {"kind": "batch", "step": int(step), key: value, "buffers": enc.spans}
    return frame_chunks(header, enc.body(), enc.size)


# -- frames back into batches: the receiving side ---------------------------------------------


class _Decoder:
    def __init__(self, frame: Frame) -> None:
        # every tensor and array is a view of one tensor over the payload (a plain numpy slice
        # would keep only the payload's base alive)
        self.payload = np.frombuffer(frame.payload, np.uint8)
        self.base = torch.from_numpy(self.payload)
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
            off, n = self.span(args[0])
            return self.payload[off : off + n].tobytes()
        if tag == "c" and len(args) == 3:
            return self.column(*args)
        if tag == "x" and len(args) == 2 and all(isinstance(a, str) for a in args):
            return parse_typed(*args)
        if tag == "t" and len(args) == 4:
            return self.tensor(*args)
        if tag in ("n", "g") and len(args) == (3 if tag == "n" else 2):
            arr = self.array(args[0], args[1], args[2] if tag == "n" else [])
            return arr if tag == "n" else arr[()]
        raise DecodeError(f"malformed frame node {str(node)[:80]}")

    def values(self, index: Any, dims: list[int], itemsize: int, what: str) -> torch.Tensor:
        """Buffer ``index`` as bytes, checked to hold ``dims`` values of ``itemsize`` bytes
        each, aligned to them (``what`` names the value in errors)."""
        off, n = self.span(index)
        if math.prod(dims) * itemsize != n:
            raise DecodeError(f"frame {what} {dims} does not fill its {n} B buffer")
        if off % itemsize:
            raise DecodeError(f"frame {what} buffer at {off} is not aligned to its dtype")
        return self.base[off : off + n]

    def tensor(self, index: Any, dtype_name: Any, shape: Any, layout: Any) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            raise DecodeError(f"frame tensor has dtype {dtype_name!r}, not one of the allowlist")
        dims = _shape(shape)
        if layout not in ("c", "cl") or (layout == "cl" and len(dims) != 4):
            raise DecodeError(f"frame tensor layout {layout!r} does not fit shape {shape!r}")
        what = f"tensor of {dtype_name}"
        flat = self.values(index, dims, dtype.itemsize, what).view(dtype)
        if layout == "cl":
            b, c, h, w = dims
            return flat.view(b, h, w, c).permute(0, 3, 1, 2)
        return flat.view(dims)

    def array(self, index: Any, dtype_name: Any, shape: Any) -> np.ndarray:
        try:
            dtype = np.dtype(dtype_name) if isinstance(dtype_name, str) else None
        except TypeError:
            dtype = None
        if dtype is None or dtype.kind not in NUMPY_KINDS or dtype.fields is not None:
            raise DecodeError(f"frame array has dtype {dtype_name!r}, not one of the allowlist")
        dims = _shape(shape)
        raw = self.values(index, dims, dtype.itemsize, f"array of {dtype_name}")
        return raw.numpy().view(dtype).reshape(dims)

    def column(self, data: Any, offsets: Any, present: Any) -> ByteColumn:
        """A ByteColumn over the payload (its values come out as bytes when read)."""
        d_off, d_n = self.span(data)
        raw = self.base[d_off : d_off + d_n].numpy().data.toreadonly()
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


def _shape(shape: Any) -> list[int]:
    if (
        not isinstance(shape, list)
        or len(shape) > 32
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise DecodeError(f"malformed frame shape {shape!r}")
    return shape


def decode_batches(frame: Frame) -> list[Any]:
    """The batches (consecutive steps from the header's ``step``) a ``batch`` frame carries;
    their tensors share the frame's payload."""
    header = frame.header
    if frame.kind != "batch" or ("tree" in header) == ("trees" in header):
        raise DecodeError(f"a {frame.kind!r} frame carries no batch")
    trees = [header["tree"]] if "tree" in header else header["trees"]
    if not isinstance(trees, list) or not trees:
        raise DecodeError("a batch frame's trees are not a non-empty list")
    decoder = _Decoder(frame)
    return [decoder.node(tree, 0) for tree in trees]
