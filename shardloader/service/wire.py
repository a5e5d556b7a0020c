"""Frames on the wire between ``shardloader serve`` and :class:`RemoteLoader`: pure, no pickle.

NOTE [frame layout, protocol 1]: a batch stream is a sequence of frames::

    prefix   16 bytes   b"SLF1" | header length (uint32 LE) | payload length (uint64 LE)
    header   UTF-8 JSON {"kind": "batch"|"end"|"error"|"ping", "step": int, ...}
    payload  raw bytes: every tensor, array and bytes value of the batch, each at an offset
             aligned to 64 bytes

A batch header carries ``tree``, the batch's structure as tagged JSON nodes, and ``buffers``,
``[offset, nbytes]`` per raw value.  Nodes (lists, so user keys such as ``"t"`` are never
ambiguous): ``["j", scalar]`` (None, bool, int, float, str), ``["J", [scalar, ...]]`` (a list
of scalars), ``["l", [node...]]``, ``["u", [node...]]`` (tuple), ``["d", {str: node}]``,
``["t", buffer, dtype, shape, layout]`` (torch tensor; layout ``"c"`` contiguous or ``"cl"``
channels-last), ``["n", buffer, dtype, shape]`` (numpy array), ``["g", buffer, dtype]`` (numpy
scalar), ``["b", buffer]`` (bytes).  dtypes come from an allowlist; the decoder builds values
only from these tags, so a stream can never make the receiver run code.  Anything else in a
batch (objects, sets, non-string dict keys) is a :class:`UsageError` on the sending side.

Protocol 2 adds: ``["r", {str: node}]`` (a :class:`~shardloader.batching.raw.RawBatch`),
``["c", data, offsets, present]`` (a :class:`~shardloader.batching.raw.ByteColumn`: buffer
indices; ``offsets`` int64 ``n + 1``, ``present`` bool ``n`` or null when every sample has the
field); a batch frame may carry ``trees`` (consecutive steps ``step, step + 1, ...``, one node
each, sharing the buffers) instead of ``tree``.

The protocol lives in three modules: :mod:`~shardloader.service.wireframes` (the prefix, limits
and allowlists; reading frames), :mod:`~shardloader.service.wireencode` (batches into frames)
and :mod:`~shardloader.service.wiredecode` (frames into batches).  This module is their one
documented face.
"""

from __future__ import annotations

from shardloader.service.wiredecode import decode_batch, decode_batches
from shardloader.service.wireencode import (
    encode_batch,
    encode_batches,
    encode_control,
)
from shardloader.service.wireframes import (
    MAGIC,
    PROTOCOL,
    Frame,
    frame_size,
    iter_frames,
    read_frame,
)

__all__ = [
    "MAGIC",
    "PROTOCOL",
    "Frame",
    "encode_batch",
    "encode_control",
    "decode_batch",
    "decode_batches",
    "encode_batches",
    "read_frame",
    "iter_frames",
    "frame_size",
]
