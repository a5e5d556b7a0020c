"""Shard formats: one :class:`Format` object per format, looked up by name in a registry.

``format/base.py`` says what a format is, ``format/registry.py`` maps names to formats, and
each format has a folder of its own: ``format/<name>/format.py`` (the format object, which
registers it) beside its writer, reader and stream (``tar/`` also holds the numpy layout of a
batch's members and the ``index`` scan of shards other tools wrote; ``arrow/`` the bounded IPC
reading; ``tokens/`` the token shard's layout).  What formats share: compression
(``compress.py``), the index carried in a zstd frame (``embedded.py``), mapped shard files
(``mapped.py``), safe sample keys (``format/keys.py``), a batch's samples as readers hand them
over (``rows.py``).  Adding a format is one folder and one
registration.  This file only re-exports.
"""

from shardloader.format.base import (
    Format,
    Sample,
    ScannedShard,
    ShardReader,
    ShardWriter,
    WrittenShard,
)
from shardloader.format.registry import (
    COMPRESSIONS,
    get_format,
    known_formats,
    open_writer,
    register_format,
    unregister_format,
)

__all__ = [
    "COMPRESSIONS",
    "Format",
    "Sample",
    "ScannedShard",
    "ShardReader",
    "ShardWriter",
    "WrittenShard",
    "get_format",
    "known_formats",
    "open_writer",
    "register_format",
    "unregister_format",
]
