"""shardloader: pack raw files into verified shards and stream them into PyTorch."""

from shardloader.codecs import Decoder
from shardloader.dataset import EpochReport, ShardedDataset
from shardloader.errors import (
    ChecksumError,
    DecodeError,
    IncompleteEpochError,
    InputError,
    ManifestError,
    OutputExistsError,
    ResumeError,
    ShardError,
    ShardloaderError,
    StorageError,
    UsageError,
)
from shardloader.loader import ShardLoader, make_loader
from shardloader.manifest import Manifest, read_manifest
from shardloader.monitoring import Monitor, MonitorStats, monitor
from shardloader.service.client import RemoteLoader
from shardloader.shards import ReadOptions
from shardloader.shuffle import ShuffleOptions
from shardloader.storage.cache import CacheOptions
from shardloader.storage.retry import RetryPolicy

__all__ = [
    "CacheOptions",
    "ChecksumError",
    "DecodeError",
    "Decoder",
    "EpochReport",
    "IncompleteEpochError",
    "InputError",
    "Manifest",
    "ManifestError",
    "Monitor",
    "MonitorStats",
    "OutputExistsError",
    "ReadOptions",
    "RemoteLoader",
    "ResumeError",
    "RetryPolicy",
    "ShardError",
    "ShardLoader",
    "ShardedDataset",
    "ShardloaderError",
    "ShuffleOptions",
    "StorageError",
    "UsageError",
    "make_loader",
    "monitor",
    "read_manifest",
]

__version__ = "0.1.0"
