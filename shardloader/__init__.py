"""shardloader: pack raw files into verified shards and stream them into PyTorch.

NOTE [lazy public names]: ``import shardloader`` imports nothing heavy (no torch, numpy,
pyarrow): every public name resolves on first use through ``_EXPORTS`` (PEP 562), so the
``shardloader`` command answers ``--help`` and usage errors without paying for torch.  The
``TYPE_CHECKING`` block below names the same objects for mypy and IDEs;
tests/test_public_api.py checks the table, ``__all__`` and that block agree.
"""

import importlib as _importlib
import typing as _typing

from shardloader.errors import (
    ChecksumError,
    DecodeError,
    IncompleteEpochError,
    InputError,
    ManifestError,
    MissingFieldError,
    ObjectNotFoundError,
    OutputExistsError,
    ResumeError,
    ShardError,
    ShardloaderError,
    StallError,
    StorageError,
    TransformError,
    TruncatedBodyError,
    UsageError,
)

if _typing.TYPE_CHECKING:
    from shardloader.batching.blocks import TokenBlocks
    from shardloader.batching.fixed import FixedBatches
    from shardloader.batching.packed import PackCollate, PackedBatches
    from shardloader.batching.padded import BucketBatches, PadCollate, TokenBudgetBatches
    from shardloader.batching.raw import ByteColumn, RawBatch, RawCollate
    from shardloader.codecs.allowlist import Decoder
    from shardloader.dataset import ShardedDataset
    from shardloader.deliver.loader import ShardLoader, make_loader
    from shardloader.deliver.monitor import Monitor, MonitorStats, monitor
    from shardloader.manifest import Manifest, read_manifest
    from shardloader.mixture import Mixture
    from shardloader.plan.epoch import EpochReport
    from shardloader.plan.partition import Partition
    from shardloader.plan.shuffle import ShuffleOptions
    from shardloader.read.shardset import ReadOptions
    from shardloader.service.client import RemoteLoader
    from shardloader.storage.cache import CacheOptions
    from shardloader.storage.retry import RetryPolicy
    from shardloader.vision.collate import DetectionCollate

# public name -> the module that defines it (imported on first access)
_EXPORTS = {
    "TokenBlocks": "shardloader.batching.blocks",
    "FixedBatches": "shardloader.batching.fixed",
    "PackCollate": "shardloader.batching.packed",
    "PackedBatches": "shardloader.batching.packed",
    "BucketBatches": "shardloader.batching.padded",
    "PadCollate": "shardloader.batching.padded",
    "TokenBudgetBatches": "shardloader.batching.padded",
    "ByteColumn": "shardloader.batching.raw",
    "RawBatch": "shardloader.batching.raw",
    "RawCollate": "shardloader.batching.raw",
    "Decoder": "shardloader.codecs.allowlist",
    "ShardedDataset": "shardloader.dataset",
    "EpochReport": "shardloader.plan.epoch",
    "ShardLoader": "shardloader.deliver.loader",
    "make_loader": "shardloader.deliver.loader",
    "Manifest": "shardloader.manifest",
    "read_manifest": "shardloader.manifest",
    "Mixture": "shardloader.mixture",
    "Monitor": "shardloader.deliver.monitor",
    "MonitorStats": "shardloader.deliver.monitor",
    "monitor": "shardloader.deliver.monitor",
    "RemoteLoader": "shardloader.service.client",
    "ReadOptions": "shardloader.read.shardset",
    "ShuffleOptions": "shardloader.plan.shuffle",
    "Partition": "shardloader.plan.partition",
    "CacheOptions": "shardloader.storage.cache",
    "RetryPolicy": "shardloader.storage.retry",
    "DetectionCollate": "shardloader.vision.collate",
}

# submodules reachable as attributes (``shardloader.collate.PadCollate``) without an import
_SUBMODULES = (
    "batching",
    "bench",
    "codecs",
    "collate",
    "deliver",
    "errors",
    "manifest",
    "plan",
    "read",
    "service",
    "storage",
    "vision",
)

__all__ = [
    "BucketBatches",
    "ByteColumn",
    "CacheOptions",
    "ChecksumError",
    "DecodeError",
    "Decoder",
    "DetectionCollate",
    "EpochReport",
    "FixedBatches",
    "IncompleteEpochError",
    "InputError",
    "Manifest",
    "ManifestError",
    "MissingFieldError",
    "Mixture",
    "Monitor",
    "MonitorStats",
    "ObjectNotFoundError",
    "OutputExistsError",
    "PackCollate",
    "PackedBatches",
    "PadCollate",
    "RawBatch",
    "RawCollate",
    "ReadOptions",
    "RemoteLoader",
    "ResumeError",
    "RetryPolicy",
    "ShardError",
    "ShardLoader",
    "ShardedDataset",
    "ShardloaderError",
    "StallError",
    "ShuffleOptions",
    "Partition",
    "StorageError",
    "TokenBlocks",
    "TokenBudgetBatches",
    "TransformError",
    "TruncatedBodyError",
    "UsageError",
    "make_loader",
    "monitor",
    "read_manifest",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> _typing.Any:
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(_importlib.import_module(module), name)
    elif name in _SUBMODULES or _is_submodule(__name__, name):
        # every submodule, so each documented dotted path (shardloader.presets.DatasetPreset,
        # shardloader.pack.layouts.Layout) works after a bare `import shardloader`
        value = _importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def _submodules_on_demand(package: str) -> _typing.Callable[[str], _typing.Any]:
    """A subpackage's module ``__getattr__`` (PEP 562): its modules load on first use, so a
    documented dotted path (shardloader.read.verify.verify_dataset) works after a bare
    `import shardloader`, as the top level's do."""

    def getattr_(name: str) -> _typing.Any:
        if not _is_submodule(package, name):
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return _importlib.import_module(f"{package}.{name}")

    return getattr_


def _is_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is a module of ours (found, not imported)."""
    import importlib.util

    if not name.isidentifier() or name.startswith("__"):
        return False
    try:
        return importlib.util.find_spec(f"{package}.{name}") is not None
    except (ImportError, ValueError):
        return False


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
