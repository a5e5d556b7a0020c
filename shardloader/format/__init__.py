"""Shard formats: one :class:`Format` object per format, looked up by name in a registry.

``format/base.py`` says what a format is, ``format/registry.py`` maps names to formats, and
each format lives in its own modules: the format object, which registers it, beside its writer,
reader and stream (``tar.py`` with ``tarwriter.py``, ``tarreader.py``, ``tarstream.py``,
``tarindex.py`` and ``tarlayout.py``; ``arrow.py`` with ``arrowwriter.py``, ``arrowreader.py``,
``arrowstream.py`` and ``ipc.py``; ``tokens.py`` with ``tokenlayout.py`` and
``tokenstream.py``).  This file only re-exports.
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
    iter_stored,
    known_formats,
    open_reader,
    open_writer,
    register_format,
    shard_suffix,
    stage,
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
    "iter_stored",
    "known_formats",
    "open_reader",
    "open_writer",
    "register_format",
    "shard_suffix",
    "stage",
    "unregister_format",
]
