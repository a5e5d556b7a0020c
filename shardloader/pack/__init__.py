"""``pack``: raw files → shards + sidecars → manifest last (the orchestrator: :mod:`.run`).

The face of the package: re-exports only, resolved on first use (PEP 562), so that importing a
submodule (a pack worker's writer, :mod:`.forkserver`) does not import the orchestrator.
Input layouts are in :mod:`.layouts` (one module each, one registry:
``shardloader.pack.layouts.register_layout``); options and report in :mod:`.options`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name.isidentifier() and not name.startswith("__"):
        try:  # a submodule: shardloader.pack.layouts
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module 'shardloader.pack' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'shardloader.pack' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
