"""``pack``: raw files → shards + sidecars → manifest last (the orchestrator: :mod:`.run`).

The face of the package: re-exports only, resolved on first use (PEP 562), so that importing a
submodule (a pack worker's writer, :mod:`.forkserver`) does not import the orchestrator.
Input layouts are in :mod:`.layouts` (one module each, one registry:
``shardloader.pack.layouts.register_layout``); options and report in :mod:`.options`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardloader._lazy import on_demand

if TYPE_CHECKING:
    from shardloader.pack.options import (
        DEFAULT_SHARD_SIZE,
        PACKER_VERSION,
        PackOptions,
        PackProgress,
        PackReport,
    )
    from shardloader.pack.run import pack

_EXPORTS = {
    "DEFAULT_SHARD_SIZE": "shardloader.pack.options",
    "PACKER_VERSION": "shardloader.pack.options",
    "PackOptions": "shardloader.pack.options",
    "PackProgress": "shardloader.pack.options",
    "PackReport": "shardloader.pack.options",
    "pack": "shardloader.pack.run",
}

__all__ = [
    "DEFAULT_SHARD_SIZE",
    "PACKER_VERSION",
    "PackOptions",
    "PackProgress",
    "PackReport",
    "pack",
]

__getattr__ = on_demand(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
