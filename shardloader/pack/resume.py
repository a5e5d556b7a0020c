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
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from shardloader.errors import ManifestError
from shardloader.manifest import SampleIndex
from shardloader.pack.plan import ShardPlan

__all__ = ["META_KEY", "plan_digest", "sidecar_bytes", "sidecar_meta"]

META_KEY = b"shardloader"
_HASH_CHUNK = 4 << 20


def plan_digest(options_digest: str, plan: ShardPlan) -> str:
    """Hash of what decides a shard's bytes; see NOTE [resume]."""
    h = hashlib.sha256()
    parts = [json.dumps([options_digest, plan.number]).encode()]
    pending = 0
    for sample in plan.samples:
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
    """The sidecar: :meth:`SampleIndex.to_arrow_bytes` plus the resume record as metadata."""
    table = pa.ipc.open_file(pa.py_buffer(index.to_arrow_bytes())).read_all()
    table = table.replace_schema_metadata({META_KEY: json.dumps(meta, sort_keys=True)})
    sink = pa.BufferOutputStream()
    # zstd buffers: keys and offsets are regular, so the sidecar shrinks ~5x (it is ~45 bytes a
    # sample raw, a noticeable share of a text shard); readers decompress transparently.
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_file(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
