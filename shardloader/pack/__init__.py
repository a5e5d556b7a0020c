"""``pack``: raw files → shards + sidecars → manifest last (the orchestrator: :mod:`.run`).

The face of the package: re-exports only.  Input layouts are in :mod:`.layouts` (one module
each, one registry: ``shardloader.pack.layouts.register_layout``); options and report in
:mod:`.options`.
"""

from shardloader.pack.options import (
    DEFAULT_SHARD_SIZE,
    PACKER_VERSION,
    PackOptions,
    PackProgress,
    PackReport,
)
from shardloader.pack.run import pack

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PACKER_VERSION",
    "PackOptions",
    "PackProgress",
    "PackReport",
    "pack",
]
