"""shardloader: pack raw files into verified shards and stream them into PyTorch.

NOTE [lazy public names]: ``import shardloader`` imports nothing heavy (no torch, numpy,
pyarrow): every public name resolves on first use through ``_EXPORTS`` (PEP 562, in
:mod:`shardloader._lazy`, the one place of lazy imports), so the
``shardloader`` command answers ``--help`` and usage errors without paying for torch.  The
``TYPE_CHECKING`` block below names the same objects for mypy and IDEs;
tests/test_public_api.py checks the table, ``__all__`` and that block agree.
"""

import typing as _typing

from shardloader._lazy import on_demand as _on_demand
from shardloader.errors import (
    ChecksumError,
    DecodeError,
    IncompleteEpochError,
    InputError,
    ManifestError,
    MissingFieldError,
    ObjectChangedError,
    ObjectNotFoundError,
    OutputExistsError,
    OutputLockedError,
    ResumeError,
    ShardChangedError,
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
    from shardloader.batching.packcollate import PackCollate
    from shardloader.batching.packed import PackedBatches
    from shardloader.batching.padded import BucketBatches, PadCollate, TokenBudgetBatches
    from shardloader.batching.raw import ByteColumn, RawBatch, RawCollate
    from shardloader.codecs.allowlist import Decoder
    from shardloader.dataset import ShardedDataset
    from shardloader.deliver.loader import ShardLoader, make_loader
    from shardloader.deliver.monitor import Monitor, MonitorStats, monitor
    from shardloader.manifest import Manifest, read_manifest
    from shardloader.mixture import Mixture
    from shardloader.options import ReadOptions, ShuffleOptions, World
    from shardloader.plan.epoch import EpochReport
    from shardloader.plan.partition import Partition
    from shardloader.service.client import RemoteLoader
    from shardloader.storage.cache import CacheOptions
    from shardloader.storage.retry import RetryPolicy
    from shardloader.vision.collate import DetectionCollate

# public name -> the module that defines it (imported on first access)
_EXPORTS = {
    "TokenBlocks": "shardloader.batching.blocks",
    "FixedBatches": "shardloader.batching.fixed",
    "PackCollate": "shardloader.batching.packcollate",
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
    "ReadOptions": "shardloader.options",
    "ShuffleOptions": "shardloader.options",
    "World": "shardloader.options",
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
    "ObjectChangedError",
    "ObjectNotFoundError",
    "OutputExistsError",
    "OutputLockedError",
    "PackCollate",
    "PackedBatches",
    "PadCollate",
    "RawBatch",
    "RawCollate",
    "ReadOptions",
    "RemoteLoader",
    "ResumeError",
    "RetryPolicy",
    "ShardChangedError",
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
    "World",
    "make_loader",
    "monitor",
    "read_manifest",
]

__version__ = "0.1.0"


__getattr__ = _on_demand(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_SUBMODULES))
