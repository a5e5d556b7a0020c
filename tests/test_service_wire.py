"""Frames: every batch value round-trips exactly; nothing else is sent; broken frames are
clear errors, never a crash or code run on the receiving side."""

from __future__ import annotations

import datetime
import decimal
import io
import json
import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardloader.errors import DecodeError, TruncatedBodyError, UsageError
from shardloader.service import frames as framing
from shardloader.service import wire

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
NUMPY_DTYPES = [
    "bool",
    "uint8",
    "int16",
    "int64",
    "uint32",
    "float16",
    "float32",
    "float64",
    "complex128",
]


def encode_batch(step, value):
    """One batch as one frame's chunks."""
    return wire.encode_batches(step, [value])


def iter_frames(data):
    """The frames of a complete byte string."""
    readinto = io.BytesIO(data).readinto
    while (frame := framing.read_frame(readinto)) is not None:
        yield frame


def decode_batch(frame):
    """The one batch a frame carries."""
    (batch,) = wire.decode_batches(frame)
    return batch


def roundtrip(value, step=3):
    data = b"".join(bytes(c) for c in encode_batch(step, value))
    (frame,) = list(iter_frames(data))
    assert frame.kind == "batch" and frame.header["step"] == step
    return decode_batch(frame)


def assert_same(a, b):
    """Equal in type, dtype, shape, strides class and every byte (NaN, -0.0 included)."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        cl = torch.channels_last
        assert a.is_contiguous() == b.is_contiguous() or (
            a.is_contiguous(memory_format=cl) == b.is_contiguous(memory_format=cl)
        )
        raw = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
        assert torch.equal(raw[0], raw[1])
    elif isinstance(a, np.ndarray | np.generic):
        assert a.dtype == b.dtype and np.shape(a) == np.shape(b)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    elif isinstance(a, datetime.date | datetime.time | decimal.Decimal):
        assert str(a) == str(b)  # the offset and every digit (-0.0000 too), not only ==
    else:
        assert a == b


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=4))
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.tensor(list(draw(st.binary(min_size=n, max_size=n))), dtype=torch.uint8)
    t = raw.view(dtype).reshape(shape) if dtype != torch.bool else (raw % 2).bool().reshape(shape)
    layout = draw(st.sampled_from(["plain", "transposed", "channels_last", "grad"]))
    if layout == "transposed" and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif layout == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    elif (
        layout == "grad" and t.is_floating_point() and dtype not in (torch.float16, torch.bfloat16)
    ):
        t = t.clone().requires_grad_(True)
    return t


@st.composite
def arrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    n = math.prod(shape) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), np.uint8)
    arr = (raw % 2).astype(bool) if dtype.kind == "b" else raw.view(dtype)
    arr = arr.reshape(shape)
    if draw(st.booleans()) and arr.size:
        return arr.reshape(-1)[0]  # a numpy scalar
    return arr


scalars = (
    st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats() | st.text(max_size=20)
)
# what Parquet timestamp, date, time and decimal columns decode to (codecs/arrowcells.py)
offsets = st.none() | st.integers(-23 * 60, 23 * 60).map(
    lambda m: datetime.timezone(datetime.timedelta(minutes=m))
)
texts = (
    st.datetimes(timezones=offsets)
    | st.dates()
    | st.times()
    | st.decimals(allow_nan=False, allow_infinity=False, places=4)
)
leaves = scalars | texts | st.binary(max_size=64) | tensors() | arrays()
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@SETTINGS
@given(values)
def test_any_batch_value_round_trips_exactly(value):
    assert_same(value, roundtrip(value))


@SETTINGS
@given(st.lists(values, min_size=1, max_size=4), st.integers(0, 2**40))
def test_a_stream_of_frames_keeps_order_and_steps(batches, first):
    data = b"".join(bytes(c) for i, b in enumerate(batches) for c in encode_batch(first + i, b))
    data += framing.encode_control("end", first + len(batches), steps=len(batches))
    frames = list(iter_frames(data))
    assert [f.kind for f in frames] == ["batch"] * len(batches) + ["end"]
    assert [f.header["step"] for f in frames] == list(range(first, first + len(batches) + 1))
    for frame, value in zip(frames, batches, strict=False):
        assert_same(value, decode_batch(frame))


def test_a_default_collated_batch():
    batch = {
        "__key__": ["a/1", "b/2"],
        "__index__": torch.tensor([4, 9]),
        "__pad__": torch.tensor([False, True]),
        "jpg": torch.zeros(2, 3, 8, 8, dtype=torch.uint8),
        "bin": [b"\x00\x01", b""],
        "json": [{"t": [1, 2.5, None]}, {"t": []}],
    }
    got = roundtrip(batch)
    assert_same(batch, got)
    assert got["jpg"].data_ptr() % 64 == got["__index__"].data_ptr() % 64  # aligned buffers


def test_channels_last_is_kept_without_a_copy():
    t = (
        torch.arange(2 * 3 * 128 * 128, dtype=torch.int32)
        .reshape(2, 3, 128, 128)
        .contiguous(memory_format=torch.channels_last)
    )
    got = roundtrip(t)
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(got, t)
    chunks = encode_batch(0, t)
    big = [c for c in chunks if isinstance(c, memoryview)]
    assert len(big) == 1 and big[0].nbytes == t.numel() * 4  # sent from the tensor's memory


class Evil:
    def __reduce__(self):  # pragma: no cover - must never be called
        raise AssertionError("pickled")


def _deep(n):
    value: list = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize(
    "value",
    [
        Evil(),
        {1: "x"},
        {"a": {2.0: 1}},
        {1, 2},
        bytearray(b"x"),
        object(),
        lambda: 0,
        np.array(["a", "b"]),
        np.array([object()]),
        np.zeros(2, dtype=">i4"),
        torch.zeros(2).to_sparse(),
        [_deep(80)],
    ],
)
def test_values_outside_the_allowlist_are_refused(value):
    with pytest.raises(UsageError, match="cannot|only|deeper|key"):
        encode_batch(0, value)


def _frame(header, payload=b""):
    head = json.dumps(header).encode()
    return struct.pack("<4sIQ", framing.MAGIC, len(head), len(payload)) + head + payload


@pytest.mark.parametrize(
    "header",
    [
        {"kind": "batch", "step": 0, "tree": ["t", 0, "object", [1], "c"], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["t", 0, "float32", [4], "c"], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["t", 0, "float32", [2], "c"], "buffers": [[4, 8]]},
        {"kind": "batch", "step": 0, "tree": ["t", 1, "float32", [2], "c"], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["t", 0, "uint8", [-8], "c"], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["t", 0, "uint8", [8], "cl"], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["n", 0, "O", [1]], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["n", 0, "V8", [1]], "buffers": [[0, 8]]},
        {"kind": "batch", "step": 0, "tree": ["p", "cos\nsystem\n(S'echo'\ntR."], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["J", [[1]]], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["x", "datetime", "yesterday"], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["x", "decimal", "1.5e"], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["x", "timedelta", "1"], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["x", "date", 20240101], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["d", {"a": "x"}], "buffers": []},
        {"kind": "batch", "step": 0, "tree": ["b", 0], "buffers": "all"},
        {"kind": "batch", "step": 0, "tree": ["l", [["l", [["l", []]]]] * 2], "buffers": [[-1, 2]]},
    ],
)
def test_malformed_frames_are_decode_errors(header):
    (frame,) = list(iter_frames(_frame(header, bytes(8))))
    with pytest.raises(DecodeError):
        decode_batch(frame)


def test_nesting_bomb_is_refused():
    tree: list = ["j", 1]
    for _ in range(200):
        tree = ["l", [tree]]
    (frame,) = list(iter_frames(_frame({"kind": "batch", "step": 0, "tree": tree, "buffers": []})))
    with pytest.raises(DecodeError):
        decode_batch(frame)


@pytest.mark.parametrize(
    "data",
    [
        b"GET / HTTP/1.1\r\n\r\n",
        struct.pack("<4sIQ", framing.MAGIC, 1 << 30, 0),
        struct.pack("<4sIQ", framing.MAGIC, 4, 0) + b"nope",
        struct.pack("<4sIQ", framing.MAGIC, 2, 0) + b"[]",
        _frame({"kind": "shell", "step": 0}),
        _frame({"kind": "end", "step": "1"}),
    ],
)
def test_bad_prefixes_and_headers_are_decode_errors(data):
    with pytest.raises(DecodeError):
        list(iter_frames(data))


@SETTINGS
@given(st.data())
def test_truncated_streams_say_so(data):
    frame = b"".join(bytes(c) for c in encode_batch(1, {"x": torch.arange(10)}))
    cut = data.draw(st.integers(1, len(frame) - 1))
    with pytest.raises(TruncatedBodyError):
        list(iter_frames(frame[:cut]))


@SETTINGS
@given(st.data())
def test_corrupted_frames_never_escape_the_error_tree(data):
    frame = bytearray(
        b"".join(
            bytes(c)
            for c in encode_batch(
                1, {"x": torch.arange(6, dtype=torch.int32), "k": ["a", "b"], "b": [b"zz"]}
            )
        )
    )
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    try:
        for f in iter_frames(bytes(frame)):
            if f.kind == "batch":
                decode_batch(f)
    except (DecodeError, TruncatedBodyError):
        pass


def test_control_frames():
    (end,) = list(iter_frames(framing.encode_control("end", 7, steps=7)))
    assert end.kind == "end" and end.header["steps"] == 7 and not end.payload
    with pytest.raises(UsageError):
        framing.encode_control("batch", 0)
    with pytest.raises(DecodeError, match="no batch"):
        decode_batch(end)


# -- protocol 2: raw batches, frames of several batches, payloads in shared memory ------------


def _raw_batch():
    from shardloader.batching.raw import ByteColumn, RawBatch

    return RawBatch(
        {
            "__key__": ["a/1", "b/2", "c/3"],
            "__index__": torch.tensor([4, 5, 6]),
            "__pad__": torch.tensor([False, False, True]),
            "jpg": ByteColumn.of([b"\xff\xd8one", b"", b"three\x00"]),
            "txt": ByteColumn.of([None, b"x", None]),  # a field some samples lack
        }
    )


def test_raw_batches_round_trip_as_raw_batches():
    from shardloader.batching.raw import ByteColumn, RawBatch

    batch = _raw_batch()
    got = roundtrip(batch)
    assert type(got) is RawBatch and list(got) == list(batch)
    assert got["__key__"] == batch["__key__"]
    assert_same(got["__index__"], batch["__index__"])
    assert_same(got["__pad__"], batch["__pad__"])
    for name in ("jpg", "txt"):
        assert isinstance(got[name], ByteColumn)
        assert got[name].tolist() == batch[name].tolist()
        assert all(v is None or type(v) is bytes for v in got[name])


def test_several_batches_share_one_frame():
    batches = [{"x": torch.arange(i + 1), "k": [f"s{i}"]} for i in range(3)]
    data = b"".join(bytes(c) for c in wire.encode_batches(7, batches))
    (frame,) = list(iter_frames(data))
    assert frame.header["step"] == 7 and len(frame.header["trees"]) == 3
    got = wire.decode_batches(frame)
    for a, b in zip(got, batches, strict=True):
        assert_same(a, b)


@pytest.mark.parametrize(
    ("offsets", "present"),
    [
        ([0, 2, 1, 3], None),  # not in order
        ([0, 1, 2, 9], None),  # past the buffer
        ([1, 2, 3, 3], None),  # does not start at 0
        ([0, 1, 2, 3], [1, 1]),  # presence of the wrong length
    ],
)
def test_malformed_columns_are_decode_errors(offsets, present):
    raw = b"abc".ljust(64, b"\0")
    off = np.asarray(offsets, "<i8").tobytes().ljust(64, b"\0")
    pres = bytes(present or []).ljust(64, b"\0")
    buffers = [[0, 3], [64, 8 * len(offsets)]]
    if present is not None:
        buffers.append([128, len(present)])
    tree = ["c", 0, 1, 2 if present is not None else None]
    header = {"kind": "batch", "step": 0, "tree": tree, "buffers": buffers}
    (frame,) = list(iter_frames(_frame(header, raw + off + pres)))
    with pytest.raises(DecodeError, match="column"):
        decode_batch(frame)
