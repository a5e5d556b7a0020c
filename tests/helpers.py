"""Small test utilities: write a dataset with exact shard sizes, collect loader output."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from shardloader.format import open_writer, shard_suffix
from shardloader.manifest import FieldInfo, Manifest, ShardInfo


def payload(i: int) -> bytes:
    """Deterministic, sample-specific bytes of varying size."""
    return hashlib.sha256(str(i).encode()).digest() * (1 + i % 5)


def write_dataset(
    out: str,
    shard_sizes: Sequence[int],
    fmt: str = "tar",
    compression: str = "none",
    classes: int = 0,
) -> Manifest:
    """Samples ``0..N-1`` keyed ``s/000123`` with fields ``bin`` (payload) and ``cls``."""
    os.makedirs(out, exist_ok=True)
    fields = {"bin": FieldInfo("bytes"), "cls": FieldInfo("int")}
    shards = []
    gid = 0
    for n, size in enumerate(shard_sizes):
        name = f"shard-{n:05d}{shard_suffix(fmt, compression)}"
        with open(os.path.join(out, name), "wb") as f:
            writer = open_writer(fmt, f, compression, fields)
            for _ in range(size):
                label = gid * max(classes, 1) // max(sum(shard_sizes), 1) if classes else gid % 3
                writer.add(
                    f"s/{gid:06d}",
                    {"bin": payload(gid), "cls": str(label).encode()},
                    length=len(payload(gid)),
                )
                gid += 1
            written = writer.close()
        index_name = f"shard-{n:05d}.idx.arrow"
        index_bytes = written.index.to_arrow_bytes()
        with open(os.path.join(out, index_name), "wb") as f:
            f.write(index_bytes)
        shards.append(
            ShardInfo(
                name,
                written.num_samples,
                written.bytes,
                written.raw_bytes,
                written.sha256,
                index_name,
                hashlib.sha256(index_bytes).hexdigest(),
            )
        )
    manifest = Manifest(fmt, compression, fields, shards, length_field="bin")
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(manifest.to_json())
    return manifest


def batch_ids(batch: dict) -> list[int]:
    return [int(i) for i in batch["__index__"]]
