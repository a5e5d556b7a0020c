"""Crafted inputs for the hostile-input tests: bombs and lying manifests, made on the fly."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Callable, Sequence
from typing import Any

import pyarrow as pa
import zstandard

GIB = 1 << 30
# How much the process tree's resident memory may grow while it handles a bomb of >= 1 GiB.
MEMORY_BOUND = 200 << 20


def tar_header(name: str, size: int) -> bytes:
    """One tar header (GNU format: long names and sizes past 8 GiB fit)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    return info.tobuf(format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape")


def tar_bytes(members: Sequence[tuple[str, bytes]]) -> bytes:
    """A whole tar holding ``members`` in order, with its end-of-archive marker."""
    parts = []
    for name, data in members:
        parts += [tar_header(name, len(data)), data, bytes(-len(data) % 512)]
    return b"".join(parts) + bytes(1024)


def write_zstd_bomb(path: str, member_bytes: int, name: str = "b/0000.bin") -> int:
    """A .tar.zst whose one member is ``member_bytes`` zeros, streamed through zstandard.

    A GiB of zeros compresses to about 32 KiB; return the stored size.
    """
    zeros = memoryview(bytes(16 << 20))
    with open(path, "wb") as f:
        with zstandard.ZstdCompressor(level=1).stream_writer(f, closefd=False) as w:
            w.write(tar_header(name, member_bytes))
            left = member_bytes
            while left:
                n = min(left, len(zeros))
                w.write(zeros[:n])
                left -= n
            w.write(bytes(-member_bytes % 512 + 1024))
        return f.tell()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def sidecar(
    keys: Sequence[str],
    offsets: Sequence[int],
    sizes: Sequence[int],
    checksums: Sequence[int] | None = None,
) -> bytes:
    """Sidecar bytes as pack writes them (built with pyarrow, whatever they may say)."""
    columns = {
        "key": pa.array(list(keys), pa.string()),
        "offset": pa.array(offsets, pa.uint64()),
        "size": pa.array(sizes, pa.uint64()),
    }
    if checksums is not None:
        columns["xxh3_64"] = pa.array(checksums, pa.uint64())
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def edit_sidecar(out: str, shard: int, edit: Callable[[pa.Table], pa.Table]) -> pa.Table:
    """Replace shard ``shard``'s sidecar in the dataset at ``out`` by ``edit`` of its table
    (schema metadata kept) and its ``index_sha256`` in the manifest with it, so every hash still
    agrees and only what the edit changed can be noticed; returns the new table."""
    with open(os.path.join(out, "index.json")) as f:
        raw = json.load(f)
    entry = raw["shards"][shard]
    path = os.path.join(out, entry["index_path"])
    with open(path, "rb") as f:
        table = edit(pa.ipc.open_file(pa.py_buffer(f.read())).read_all())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    with open(path, "wb") as f:
        f.write(data)
    entry["index_sha256"] = hashlib.sha256(data).hexdigest()
    with open(os.path.join(out, "index.json"), "w") as f:
        json.dump(raw, f)
    return table


def shard_entry(folder: str, name: str, index: bytes, **override: Any) -> dict[str, Any]:
    """A manifest shard entry for ``folder/name`` (true sizes and digests unless overridden);
    writes the sidecar next to the shard."""
    path = os.path.join(folder, name)
    index_name = name.split(".", 1)[0] + ".idx.arrow"
    with open(os.path.join(folder, index_name), "wb") as f:
        f.write(index)
    size = os.path.getsize(path)
    entry = {
        "path": name,
        "num_samples": pa.ipc.open_file(pa.py_buffer(index)).read_all().num_rows,
        "bytes": size,
        "raw_bytes": size,
        "sha256": override.pop("sha256", None) or sha256_file(path),
        "index_path": index_name,
        "index_sha256": hashlib.sha256(index).hexdigest(),
    }
    entry.update(override)
    return entry


def write_manifest(
    folder: str,
    fmt: str,
    compression: str,
    shards: list[dict[str, Any]],
    fields: dict[str, Any] | None = None,
    **top: Any,
) -> dict[str, Any]:
    """Write ``index.json`` as given (its totals follow the entries unless overridden)."""
    raw: dict[str, Any] = {
        "format_version": 1,
        "format": fmt,
        "compression": compression,
        "layout": "",
        "fields": fields or {"bin": {"codec": "bytes"}},
        "classes": [],
        "length_field": None,
        "extra": {},
        "shards": shards,
        "num_samples": sum(s["num_samples"] for s in shards if isinstance(s, dict)),
    }
    raw.update(top)
    with open(os.path.join(folder, "index.json"), "w") as f:
        json.dump(raw, f)
    return raw
