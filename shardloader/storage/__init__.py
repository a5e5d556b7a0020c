"""Where bytes live: local paths and any fsspec URL (``s3://``, ``http(s)://``, ``file://``).

Everything above this package passes URLs as strings plus an explicit ``storage_options``
mapping; filesystems are created lazily in each process (a dataset pickles cheaply into
DataLoader workers).
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
from shardloader.storage.retry import RetryPolicy, call_with_retries

__all__ = [
    "RetryPolicy",
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
    "remove",
    "write_bytes_atomic",
]
