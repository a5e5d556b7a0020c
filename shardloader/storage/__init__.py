"""Where bytes live: local paths and any fsspec URL (``s3://``, ``http(s)://``, ``file://``).

Everything above this package holds a :class:`Store` (URL + fsspec options + retry policy):
small, frozen, picklable; filesystems are created lazily in each process.  Per-protocol defaults
(timeouts, which errors are worth a retry, a fast client) are in ``protocols.py``; shard bytes
travel through the fast clients (``clients.py``: what they share; ``httpclient.py``,
``s3client.py``) as one pass over each object (``objectstream.py``); the node-local shard cache
is in ``cache.py``; background uploads in ``uploads.py``.
"""

from shardloader.storage.protocols import ProtocolDefaults, register_protocol
from shardloader.storage.retry import RetryPolicy, call_with_retries
from shardloader.storage.store import Store

__all__ = [
    "ProtocolDefaults",
    "RetryPolicy",
    "Store",
    "call_with_retries",
    "register_protocol",
]
