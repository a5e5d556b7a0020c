"""``fetch_shard``: the verified download of shardloader 0.1, now :meth:`Store.fetch`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy
from shardloader.storage.store import CHUNK_SIZE, Store

__all__ = ["fetch_shard", "CHUNK_SIZE"]


def fetch_shard(
    url: str,
    dst_path: str,
    *,
    sha256: str,
    size: int | None,
    policy: RetryPolicy | None = None,
    storage_options: Mapping[str, Any] | None = None,
    chunk_size: int = CHUNK_SIZE,
) -> None:
    """``Store(url, storage_options, policy).fetch(dst_path, sha256=..., size=...)``."""
    store = Store(url, storage_options or {}, policy or DEFAULT_POLICY)
    store.fetch(dst_path, sha256=sha256, size=size, chunk_size=chunk_size)
