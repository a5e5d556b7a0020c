"""The option objects a user hands the dataset, at the bottom of the package: how shards are
read (:class:`ReadOptions`), how an epoch is shuffled (:class:`ShuffleOptions`) and where this
process reads in the job (:class:`World`).

Small frozen values that import nothing of the read path, so ``help()`` on them, and the
planning that takes them, stay clear of the pass machinery.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.errors import UsageError
from shardloader.storage.cache import CacheOptions
from shardloader.storage.objectstream import PART_SIZE
from shardloader.storage.retry import DEFAULT_POLICY, RetryPolicy

if TYPE_CHECKING:
    from shardloader.storage.store import Store

__all__ = ["PARTITIONS", "ReadOptions", "ShuffleOptions", "World", "from_old_keywords"]

PARTITIONS = ("node", "rank", "global")  # NOTE [node partitions] in plan/partition.py


@dataclass(frozen=True)
class ReadOptions:
    """How shards are fetched: fsspec ``storage_options`` (explicit values win over the
    environment), the node cache, how many shards to stage ahead per worker, and the one
    retry budget for every remote request (``storage_options`` and ``retry`` make the
    :class:`~shardloader.storage.Store` of each URL: :meth:`store`).

    ``verify_samples`` (default on) checks every sample read against the checksum (XXH3-64) in
    its shard's sidecar (well under a microsecond a sample), and for sidecars without checksums
    (packed before they existed) hashes each uncompressed local shard once per node on first
    use.  Turning it off turns off exactly those two checks; the SHA-256 of compressed and
    remote shards when they are staged, and every size and structure check, stay on.

    ``part_size``: a remote shard up to this size is one GET; a larger one comes as concurrent
    byte ranges of this size (more requests, more throughput per shard).

    ``aliases``: ``{logical field: [member extensions]}`` read as one field, over the
    manifest's own (``{"image": ["jpg", "png"]}``: :mod:`shardloader.read.fields`).

    ``fields`` (default None: all): the fields a sample holds, by their (logical) names; the
    rest are not delivered, and Parquet files adopted by ``index`` read only these columns
    (:mod:`shardloader.format.parquet.reader`).

    ``stall_timeout`` (seconds, default None: off): a pass that produces no batch for this
    long while asked for one ends with a :class:`~shardloader.errors.StallError` naming rank,
    worker, shard, sample and the stuck stack (:mod:`shardloader.deliver.watchdog`).
    """

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    cache: CacheOptions = field(default_factory=CacheOptions)
    readahead: int = 2
    retry: RetryPolicy = DEFAULT_POLICY
    verify_samples: bool = True
    part_size: int = PART_SIZE
    aliases: Mapping[str, Sequence[str]] | None = None
    stall_timeout: float | None = None
    fields: Sequence[str] | None = None

    def __post_init__(self) -> None:
        value = self.stall_timeout
        if value is not None and not (_is_number(value) and math.isfinite(value) and value > 0):
            raise UsageError(
                f"ReadOptions.stall_timeout must be a positive number of seconds or None (off), "
                f"got {value!r}"
            )
        if self.fields is not None:
            names = (self.fields,) if isinstance(self.fields, str) else tuple(self.fields)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise UsageError(
                    f"ReadOptions.fields is a tuple of field names, e.g. ('image', 'label'); "
                    f"got {self.fields!r}"
                )
            object.__setattr__(self, "fields", names)
        if not isinstance(self.part_size, int) or self.part_size < 1 << 20:
            raise UsageError(
                f"ReadOptions.part_size must be at least 1 MiB, got {self.part_size!r}"
            )

    def store(self, url: str) -> Store:
        """The :class:`~shardloader.storage.Store` of ``url`` with these options and policy."""
        from shardloader.storage.store import Store

        return Store(url, self.storage_options, self.retry)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class ShuffleOptions:
    """``block``: samples permuted together (bigger mixes better, needs more cache).

    ``first_block`` (off by default): the epoch's first block holds only this many samples and
    each next one twice as many, up to ``block``.  The first batches then need the shards of a
    small block only, so they arrive after a few shards are staged rather than a whole block's
    (remote data, large shards); the price is less mixing in the first blocks of every epoch
    (tools/bench_read.py measures it).  Part of the plan signature when set.
    """

    enabled: bool = True
    block: int = 1 << 16
    first_block: int | None = None

    def __post_init__(self) -> None:
        for name in ("block", "first_block"):
            value = getattr(self, name)
            if name == "first_block" and value is None:
                continue
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise UsageError(f"shuffle {name} must be an integer >= 1 sample, got {value!r}")

    def signature(self) -> str:
        """What the plan signature records (NOTE [plan signature] in batching/base.py): without
        ``first_block`` exactly what it recorded before that option existed."""
        from shardloader.batching.base import stable_value

        text = (
            f"ShuffleOptions(enabled={stable_value(self.enabled)}, block={stable_value(self.block)}"
        )
        if self.first_block is not None:
            text += f", first_block={stable_value(self.first_block)}"
        return text + ")"

    def ramp(self, total: int) -> list[int]:
        """Starts of the ``first_block`` ramp's blocks (size, 2*size, ... below ``block``) over
        ``total`` samples, then the ramp's end (``[0]`` without a ramp): blocks of ``block``
        samples follow from there."""
        ramp, size = [0], min(self.first_block or self.block, self.block)
        while size < self.block and ramp[-1] < total:
            ramp.append(ramp[-1] + size)
            size = min(2 * size, self.block)
        return ramp

    def blocks(self, total: int) -> list[tuple[int, int]]:
        """``(start, stop)`` of each shuffle block of an epoch of ``total`` samples."""
        ramp = self.ramp(total)
        starts = ramp[:-1] + list(range(ramp[-1], total, self.block))
        return list(itertools.pairwise([*starts, total]))


@dataclass(frozen=True)
class World:
    """Where this process reads in the job: rank ``rank`` of ``world_size`` ranks,
    ``ranks_per_node`` of them on each node, and which share of an epoch a node reads.

    Built from a rank and world size (``World(rank, world_size)``), from the job's
    data-parallel group (:meth:`of`: a ``DeviceMesh``, its data-parallel dimension, or a
    process group), or left to detection: ``World()`` takes torch.distributed, then
    ``RANK``/``WORLD_SIZE``, and the node layout torchrun, Slurm or Open MPI describe
    (:mod:`shardloader.world`, the one place that looks).

    ``partition`` (NOTE [node partitions] in :mod:`shardloader.plan.partition`): ``"node"``
    (default) a span of the shuffled shards per node, so the job reads each byte about once per
    epoch; ``"rank"`` a span per rank; ``"global"`` every node reads every shard (the most
    mixing inside a batch, for a small cluster whose node caches hold the data).

    With a data-parallel group the rank and world become the replica's data-parallel rank and
    the number of replicas, so the ranks of one replica (tensor, pipeline, context parallel)
    read the same batches (NOTE [data-parallel place] in :mod:`shardloader.plan.dataparallel`);
    ``ranks_per_node`` then counts replicas a node.
    """

    rank: int | None = None
    world_size: int | None = None
    ranks_per_node: int | None = None
    partition: str = "node"
    group: Any = field(default=None, compare=False)  # DeviceMesh or ProcessGroup (see of())

    def __post_init__(self) -> None:
        if self.partition not in PARTITIONS:
            raise UsageError(f"partition={self.partition!r} is not one of {PARTITIONS}")
        if (self.rank is None) != (self.world_size is None):
            raise UsageError("pass both rank and world_size, or neither")
        if self.group is not None and self.rank is not None:
            raise UsageError("a World comes from a data-parallel group or a rank, not both")
        for name in ("rank", "world_size", "ranks_per_node"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (int, np.integer)) or isinstance(value, bool)
            ):
                raise UsageError(f"World {name} must be an integer, got {value!r}")
        if self.rank is not None and self.world_size is not None:
            if not 0 <= self.rank < self.world_size:
                raise UsageError(f"rank {self.rank} is outside world_size {self.world_size}")

    @classmethod
    def of(cls, group: Any, *, ranks_per_node: int | None = None, partition: str = "node") -> World:
        """The place of this rank's replica in the job's data-parallel ``group``: a
        ``DeviceMesh`` (``mesh["dp"]``, or a mesh with a data-parallel dimension) or a
        ``ProcessGroup`` (read when the dataset is made; torch.distributed must be up)."""
        return cls(ranks_per_node=ranks_per_node, partition=partition, group=group)


_OLD_WORLD = ("rank", "world_size", "ranks_per_node", "partition", "data_parallel")


def from_old_keywords(
    world: World | None, read: ReadOptions | None, old: Mapping[str, Any], caller: str
) -> tuple[World, ReadOptions]:
    """``world`` and ``read`` with the keywords ``caller`` took before them folded in: each
    warns once (a DeprecationWarning naming the replacement); they go in the next release."""
    unknown = sorted(set(old) - {*_OLD_WORLD, "aliases"})
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    given = [k for k in _OLD_WORLD if k in old]
    if given:
        if world is not None:
            raise UsageError(f"pass world= or {', '.join(k + '=' for k in given)}, not both")
        values = {k: old[k] for k in given}
        group = values.pop("data_parallel", None)
        if group is not None:
            new = "world=shardloader.World.of(group, ...)"
        else:
            new = f"world=shardloader.World({', '.join(f'{k}=...' for k in values)})"
        warnings.warn(
            f"{caller}({', '.join(k + '=' for k in given)}) is deprecated and goes in the next "
            f"release: pass {new}",
            DeprecationWarning,
            stacklevel=3,
        )
        world = World(**values, group=group)
    if "aliases" in old:
        warnings.warn(
            f"{caller}(aliases=...) is deprecated and goes in the next release: pass "
            "read=shardloader.ReadOptions(aliases=...)",
            DeprecationWarning,
            stacklevel=3,
        )
        read = dataclasses.replace(read or ReadOptions(), aliases=old["aliases"])
    return world or World(), read or ReadOptions()
