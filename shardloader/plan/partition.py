"""Node-local partitions: which share of an epoch each node's ranks read (pure arithmetic).

NOTE [node partitions]
    Every rank of a job must agree, without talking, on which samples each node reads.  The
    epoch's stream (shards permuted from ``(seed, epoch)``, their samples end to end: NOTE [the
    epoch order] in :mod:`shardloader.plan.shuffle`) is cut into ``nodes`` contiguous spans whose
    lengths differ by at most one sample (:func:`spans`), so a node reads the shards of its own
    span and shares only the one or two shards cut by its span's ends.  Each span is shuffled
    in blocks on its own (NOTE [node spans]), cut into the node's batches, and the node's
    ``ranks`` consecutive ranks take its batches in turn (node batch ``k`` to local rank
    ``k mod ranks``), like ranks take global batches with one partition.  The shard
    permutation is drawn anew every epoch, so which shards a node reads changes every epoch
    and samples from everywhere meet over epochs.  One partition (``nodes == 1``) is exactly
    the order and split shardloader always had: the global shuffle.

    A rank's ``j``-th step reads node batch ``k0 + j * ranks + local`` of its node, where ``k0``
    is the node batches already consumed: every node consumes the same number per step, so a
    position of ``P`` global batches (all ranks' steps together) is ``P / nodes`` on each node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardloader.errors import UsageError

__all__ = ["PARTITIONS", "Partition", "choose_partition", "spans"]

# "node": a span per node (ranks per node detected by world.py, or given); "rank": a span per
# rank; "global": one span for the whole job (every node reads every shard)
from shardloader.options import PARTITIONS  # noqa: E402  (the one list, with World)


@dataclass(frozen=True)
class Partition:
    """A world cut into ``nodes`` partitions of ``ranks`` consecutive ranks each."""

    nodes: int = 1
    ranks: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.ranks < 1:
            raise UsageError(f"a partition needs nodes >= 1 and ranks >= 1, got {self}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks

    def node_of(self, rank: int) -> int:
        return rank // self.ranks

    def local_rank(self, rank: int) -> int:
        return rank % self.ranks

    def __str__(self) -> str:
        return f"{self.nodes} partition(s) x {self.ranks} rank(s)"


def choose_partition(
    mode: str, world_size: int, ranks_per_node: int | None, num_samples: int
) -> Partition:
    """The partition of a world of ``world_size`` ranks under ``mode`` (:data:`PARTITIONS`).

    ``"node"`` with ranks per node unknown (or not dividing the world) falls back to one
    partition, the global order: what every launcher we know of for several nodes says is
    detected (:func:`shardloader.world.detect_ranks_per_node`), so an unknown layout is
    nearly always one machine (``mp.spawn``, a simulated world), where every rank shares one
    node cache, splitting saves no byte, and one partition mixes best.  A dataset with fewer
    samples than partitions has one partition too (there is nothing to save).
    """
    if mode not in PARTITIONS:
        raise UsageError(f"partition={mode!r} is not one of {PARTITIONS}")
    if mode == "rank":
        chosen = Partition(world_size, 1)
    elif mode == "node" and ranks_per_node is not None and world_size % ranks_per_node == 0:
        chosen = Partition(world_size // ranks_per_node, ranks_per_node)
    else:  # "global", or the layout unknown
        return Partition(1, world_size)
    return chosen if chosen.nodes <= num_samples else Partition(1, world_size)


def spans(total: int, nodes: int) -> np.ndarray:
    """Bounds ``[0, ..., total]`` of ``nodes`` contiguous spans, the first ``total % nodes``
    one sample longer (int64, ``nodes + 1`` entries)."""
    base, extra = divmod(int(total), int(nodes))
    k = np.arange(nodes + 1, dtype=np.int64)  # bound k: k spans of base, min(k, extra) longer
    return k * base + np.minimum(k, extra)
