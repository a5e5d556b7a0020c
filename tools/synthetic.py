"""Datasets written straight through the format writers, without ``pack``: the small synthetic
shards, sidecars and manifests that both the tests and the benchmarks need.

One home for them, so a change to what a shard entry holds is made once: tools never import
``tests/``, and the tests import this module (their ``conftest.py`` puts ``tools/`` on the
path).  Each shard is stored beside its sidecar, ``<stem>.idx.arrow``; the manifest is written
last, as ``pack`` does.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping

from shardloader.format import get_format, open_writer
from shardloader.manifest import FieldInfo, Manifest, ShardInfo

__all__ = ["listed_again", "shard_name", "write_manifest", "write_shard"]

# (key, fields) or (key, fields, length): ``length`` is what length-aware planners read
Sample = tuple[str, Mapping[str, bytes]] | tuple[str, Mapping[str, bytes], int | None]


def shard_name(n: int, fmt: str = "tar", compression: str = "none") -> str:
    """``shard-00003.tar.zst``: the name pack gives shard ``n``."""
    return f"shard-{n:05d}{get_format(fmt).suffix(compression)}"


def write_shard(
    folder: str,
    name: str,
    fmt: str,
    compression: str,
    fields: Mapping[str, FieldInfo],
    samples: Iterable[Sample],
) -> ShardInfo:
    """Write ``samples`` in order as shard ``name`` in ``folder``, and its sidecar; return the
    manifest's entry for it (the sidecar's hash included)."""
    with open(os.path.join(folder, name), "wb") as f:
        writer = open_writer(fmt, f, compression, dict(fields))
        for key, values, *length in samples:
            writer.add(key, values, length=length[0] if length else None)
        written = writer.close()
    index_name = name.split(".", 1)[0] + ".idx.arrow"
    index = written.index.to_arrow_bytes()
    with open(os.path.join(folder, index_name), "wb") as f:
        f.write(index)
    return ShardInfo(
        name,
        written.num_samples,
        written.bytes,
        written.raw_bytes,
        written.sha256,
        index_name,
        hashlib.sha256(index).hexdigest(),
    )


def write_manifest(folder: str, manifest: Manifest) -> Manifest:
    """``folder/index.json``, written after every shard it lists."""
    with open(os.path.join(folder, "index.json"), "wb") as f:
        f.write(manifest.to_json())
    return manifest


def listed_again(shard: ShardInfo, count: int) -> list[ShardInfo]:
    """``shard`` under the names of shards ``0 .. count-1`` (its own suffix kept): the entries of a
    manifest as large as a real one of that many shards, all of one shard's bytes."""
    suffix = shard.path[len(shard.path.split(".", 1)[0]) :]
    return [
        ShardInfo(
            f"shard-{i:05d}{suffix}",
            shard.num_samples,
            shard.bytes,
            shard.raw_bytes,
            shard.sha256,
            f"shard-{i:05d}.idx.arrow",
            shard.index_sha256,
        )
        for i in range(count)
    ]
