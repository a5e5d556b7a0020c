"""Read a shard's sidecar (``*.idx.arrow``) as untrusted input: bounded, hashed, then checked
against the shard's manifest entry before any of its offsets is used.

The dataset (through its node cache), ``inspect`` and ``verify`` all read sidecars this way.
"""

from __future__ import annotations

import hashlib

from shardloader.errors import ChecksumError, located
from shardloader.manifest import SampleIndex, ShardInfo
from shardloader.schema import check_sample_index, sidecar_bound
from shardloader.storage.store import Store

__all__ = ["check_digest", "load_sidecar", "parse_sidecar", "read_sidecar"]


def read_sidecar(store: Store, info: ShardInfo) -> bytes:
    """The sidecar's bytes, read no further than :func:`~shardloader.schema.sidecar_bound`."""
    return store.read_bytes(limit=sidecar_bound(info))


def check_digest(data: bytes, info: ShardInfo) -> None:
    """ChecksumError unless the sidecar's bytes hash to the manifest's ``index_sha256`` (the
    caller names the sidecar: :func:`~shardloader.errors.located`)."""
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.index_sha256:
        raise ChecksumError(
            f"hashes to {digest}, the manifest says {info.index_sha256}; re-pack or "
            "re-index the dataset"
        )


def parse_sidecar(data: bytes, url: str, fmt: str, info: ShardInfo) -> SampleIndex:
    """Parse (bounded by what the entry allows) and check against the manifest entry (the
    caller names the sidecar or its shard: :func:`~shardloader.errors.located`)."""
    index = SampleIndex.from_arrow_bytes(data, url, limit=sidecar_bound(info))
    check_sample_index(index, fmt, info)
    return index


def load_sidecar(store: Store, fmt: str, info: ShardInfo) -> SampleIndex:
    """Read, hash-check and parse the sidecar at ``store`` (its manifest entry ``info``)."""
    data = read_sidecar(store, info)
    with located(f"sample index {store.url}"):
        check_digest(data, info)
        return parse_sidecar(data, store.url, fmt, info)
