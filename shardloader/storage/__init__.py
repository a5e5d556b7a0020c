"""Where bytes live: local paths and any fsspec URL (``s3://``, ``http(s)://``, ``file://``).

Everything above this package holds a :class:`Store` (URL + fsspec options + retry policy):
small, frozen, picklable; filesystems are created lazily in each process.  Per-protocol defaults
(timeouts, which errors are worth a retry, a fast client) are in ``protocols.py``; shard bytes
travel through the fast clients (``clients.py``, ``s3client.py``) as one pass over each object
(``objectstream.py``); the node-local shard cache is in ``cache.py``; background uploads in
``uploads.py``.  The functions below ``Store`` are the 0.1 API (URL, ``storage_options``,
``policy=``), each a thin wrapper over a ``Store``.
"""

from shardloader.storage.fetch import fetch_shard
from shardloader.storage.fs import (
    exists,
    filesystem,
    is_local,
    join,
    list_files,
    local_path,
    open_read,
    put_file,
    read_bytes,
    remove,
    write_bytes_atomic,
)
from shardloader.storage.protocols import ProtocolDefaults, register_protocol
from shardloader.storage.retry import RetryPolicy, call_with_retries
from shardloader.storage.store import Store

__all__ = [
    "ProtocolDefaults",
    "RetryPolicy",
    "Store",
    "call_with_retries",
    "fetch_shard",
    "exists",
    "filesystem",
    "is_local",
    "join",
    "list_files",
    "local_path",
    "open_read",
    "put_file",
    "read_bytes",
    "register_protocol",
    "remove",
    "write_bytes_atomic",
]
