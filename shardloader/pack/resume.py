"""What a resumed pack checks before keeping a finished shard.

NOTE [resume]: every sidecar's Arrow schema metadata (key ``shardloader``) records the shard's
sha256, sizes, skipped samples and a *plan digest*: a hash of the options that change shard
bytes, the shard's global number and its planned samples (keys, field names, file paths relative
to SRC and sizes, record bytes).  A resumed run keeps a finished shard only if its plan digest is
equal and the stored file still hashes to the recorded sha256.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import xxhash

from shardloader.errors import ManifestError
from shardloader.manifest import CHECKSUM_COLUMN, SampleIndex
from shardloader.pack.plan import ShardPlan
from shardloader.pack.refs import LineRun

__all__ = ["META_KEY", "plan_digest", "sidecar_bytes", "sidecar_meta"]

META_KEY = b"shardloader"
_HASH_CHUNK = 4 << 20


def plan_digest(
    options_digest: str, plan: ShardPlan, run_bytes: Sequence[bytes | None] = ()
) -> str:
    """Hash of what decides a shard's bytes; see NOTE [resume].

    ``run_bytes[i]``: the bytes read for ``plan.samples[i]`` when it is a line run (their
    XXH3-128 goes in, with the run's file, line numbers, offsets and lengths)."""
    h = hashlib.sha256()
    parts = [json.dumps([options_digest, plan.number]).encode()]
    pending = 0
    for i, sample in enumerate(plan.samples):
        if isinstance(sample, LineRun):
            data = run_bytes[i]
            assert data is not None  # the worker reads every run before it digests the plan
            parts += [
                b"\0r" + "\0".join((sample.rel, sample.kind, sample.stem)).encode(),
                sample.numbers.astype("<i8").tobytes(),
                sample.starts.astype("<i8").tobytes(),
                sample.lengths.astype("<i8").tobytes(),
                xxhash.xxh3_128_digest(data),
            ]
            continue
        parts.append(b"\0k" + sample.key.encode())
        for ext, value in sample.fields:
            parts.append(b"\0e" + ext.encode())
            if isinstance(value, bytes):
                parts.append(b"\0b%d\0" % len(value))
                parts.append(value)
                pending += len(value)
            else:
                parts.append(b"\0f%d\0" % value.size + value.rel.encode())
        if pending > _HASH_CHUNK:  # few big updates instead of many small ones
            h.update(b"".join(parts))
            parts, pending = [], 0
    h.update(b"".join(parts))
    return h.hexdigest()


def sidecar_meta(data: bytes, where: str) -> dict[str, Any]:
    """The resume record stored in a sidecar written by ``pack`` ({} if there is none)."""
    try:
        schema = pa.ipc.open_file(pa.py_buffer(data)).schema
        raw = (schema.metadata or {}).get(META_KEY)
        return json.loads(raw) if raw else {}
    except (pa.ArrowInvalid, ValueError) as err:
        raise ManifestError(f"{where} is not a valid sample index: {err}") from err


def sidecar_bytes(index: SampleIndex, meta: Mapping[str, Any]) -> bytes:
    """The sidecar: the table :meth:`SampleIndex.to_arrow_bytes` holds, plus the resume record
    as schema metadata, with zstd buffers.

    Built from the numpy buffers directly (``pa.Array.from_buffers``): ``pa.array`` imports
    pandas on first use when it is installed, a second or more of every pack worker's start.
    The bytes are those of the ``pa.array`` route (tests/test_pack_repro.py compares them).
    """
    n = len(index)
    keys = [k.encode("utf-8") for k in index.keys]
    ends = np.zeros(n + 1, np.int32)
    np.cumsum([len(k) for k in keys], out=ends[1:])
    names = ["key", "offset", "size"]
    arrays = [
        pa.Array.from_buffers(
            pa.string(), n, [None, pa.py_buffer(ends), pa.py_buffer(b"".join(keys))]
        ),
        _column(index.offsets, "<u8", pa.uint64()),
        _column(index.sizes, "<u8", pa.uint64()),
    ]
    if index.lengths is not None:
        names.append("length")
        arrays.append(_column(index.lengths, "<u4", pa.uint32()))
    if index.checksums is not None:
        names.append(CHECKSUM_COLUMN)
        arrays.append(_column(index.checksums, "<u8", pa.uint64()))
    batch = pa.RecordBatch.from_arrays(arrays, names=names)
    schema = batch.schema.with_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    sink = pa.BufferOutputStream()
    # zstd buffers: keys and offsets are regular, so the sidecar shrinks ~5x (it is ~45 bytes a
    # sample raw, a noticeable share of a text shard); readers decompress transparently.
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, schema, options=options) as writer:
        if n:
            writer.write_batch(batch.replace_schema_metadata(schema.metadata))
    return sink.getvalue().to_pybytes()


def _column(values: np.ndarray, dtype: str, typ: pa.DataType) -> pa.Array:
    """A null-free Arrow column of ``values`` cast to ``dtype`` (as ``pa.array`` would: the
    values fit, the writers only store non-negative offsets, sizes and lengths)."""
    data = np.ascontiguousarray(values, dtype=dtype)
    return pa.Array.from_buffers(typ, len(data), [None, pa.py_buffer(data)])
