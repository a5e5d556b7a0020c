"""shardloader: pack raw files into verified shards and stream them into PyTorch.

NOTE [lazy public names]: ``import shardloader`` imports nothing heavy (no torch, numpy,
pyarrow): every public name resolves on first use through ``_EXPORTS`` (PEP 562, in
:mod:`shardloader._lazy`, the one place of lazy imports), so the
``shardloader`` command answers ``--help`` and usage errors without paying for torch.  The
``TYPE_CHECKING`` block below names the same objects for mypy and IDEs (``X as X``: an
explicit re-export, as ``__all__`` is built from the table and :mod:`shardloader.errors`);
tests/test_public_api.py checks the table, ``__all__`` and that block agree.
"""

import typing as _typing

from shardloader import errors as _errors
from shardloader._lazy import on_demand as _on_demand
from shardloader.errors import *  # noqa: F403  (every error: errors.__all__)

if _typing.TYPE_CHECKING:
    from shardloader.batching.blocks import TokenBlocks as TokenBlocks
    from shardloader.batching.fixed import FixedBatches as FixedBatches
    from shardloader.batching.packcollate import PackCollate as PackCollate
    from shardloader.batching.packed import PackedBatches as PackedBatches
    from shardloader.batching.padded import BucketBatches as BucketBatches
    from shardloader.batching.padded import PadCollate as PadCollate
    from shardloader.batching.padded import TokenBudgetBatches as TokenBudgetBatches
    from shardloader.batching.raw import ByteColumn as ByteColumn
    from shardloader.batching.raw import RawBatch as RawBatch
    from shardloader.batching.raw import RawCollate as RawCollate
    from shardloader.codecs.allowlist import Decoder as Decoder
    from shardloader.dataset import ShardedDataset as ShardedDataset
    from shardloader.deliver.loader import ShardLoader as ShardLoader
    from shardloader.deliver.loader import make_loader as make_loader
    from shardloader.deliver.monitor import Monitor as Monitor
    from shardloader.deliver.monitor import MonitorStats as MonitorStats
    from shardloader.deliver.monitor import monitor as monitor
    from shardloader.manifest import Manifest as Manifest
    from shardloader.manifest import read_manifest as read_manifest
    from shardloader.mixture import Mixture as Mixture
    from shardloader.options import ReadOptions as ReadOptions
    from shardloader.options import ShuffleOptions as ShuffleOptions
    from shardloader.options import World as World
    from shardloader.plan.epoch import EpochReport as EpochReport
    from shardloader.plan.partition import Partition as Partition
    from shardloader.service.client import RemoteLoader as RemoteLoader
    from shardloader.storage.cache import CacheOptions as CacheOptions
    from shardloader.storage.retry import RetryPolicy as RetryPolicy
    from shardloader.vision.collate import DetectionCollate as DetectionCollate

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

__all__ = [*_EXPORTS, *_errors.__all__]

__version__ = "0.1.0"


__getattr__ = _on_demand(__name__, globals(), _EXPORTS)


def __dir__() -> list[str]:
    """Globals, public names and the public submodules (each reachable as an attribute)."""
    import pkgutil

    found = pkgutil.iter_modules(__path__)  # noqa: F405 (the package's own, not a star import's)
    modules = {m.name for m in found if not m.name.startswith("_")}
    return sorted(set(globals()) | set(__all__) | modules)
