"""What an epoch costs a cluster, and how well it mixes: pure functions of the manifest.

``shardloader plan`` and ``tools/bench_locality.py`` answer, before a job starts: which shards
each node stages in an epoch, how many bytes and requests that is, what the cluster pulls as a
multiple of the dataset, how large a node cache must be, and how well the epoch mixes (distinct
shards in a global and in a rank batch, Kendall's tau between pack order and the order the
cluster consumes samples in).  Nothing here reads a shard: the plans are the dataset's own
(:class:`~shardloader.plan.epoch.EpochPlanner`), so the figures are what a run does.
What packed steps cost each rank (:class:`RankBalance`, ``ds.report().rank_balance`` and
``shardloader plan --balance``) is predicted the same way, from the recorded lengths alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from shardloader.batching.balance import batch_costs, step_imbalance
from shardloader.batching.packed import PackedBatches
from shardloader.manifest import Manifest
from shardloader.plan.epoch import EpochPlanner
from shardloader.plan.order import EpochOrder
from shardloader.plan.partition import Partition

__all__ = [
    "EpochCost",
    "NodeCost",
    "Quality",
    "RankBalance",
    "epoch_cost",
    "kendall_tau",
    "rank_balance",
    "shuffle_quality",
]


@dataclass(frozen=True)
class NodeCost:
    """One physical node's epoch: the shards its ranks read (each staged once: one GET),
    their stored bytes (what it downloads) and raw bytes (what the staged copies take)."""

    node: int
    shards: int
    stored_bytes: int
    raw_bytes: int
    kept_shards: int = 0  # of them, staged in the node's previous epoch too (None: first)


@dataclass(frozen=True)
class EpochCost:
    """Every physical node's :class:`NodeCost` for one epoch, and the totals."""

    epoch: int
    partition: Partition
    nodes: tuple[NodeCost, ...]
    dataset_bytes: int  # stored bytes of every shard
    working_set: int  # raw bytes of the shards a node keeps in use at once (largest block)

    @property
    def cluster_bytes(self) -> int:
        return sum(n.stored_bytes for n in self.nodes)

    @property
    def multiple(self) -> float:
        """Cluster bytes per epoch as a multiple of the dataset."""
        return self.cluster_bytes / max(self.dataset_bytes, 1)

    @property
    def gets(self) -> int:
        return sum(n.shards for n in self.nodes)

    @property
    def share_bytes(self) -> int:
        """Raw bytes of the largest node's shards: a node cache this large stages each of
        the epoch's shards once and keeps them for the epoch."""
        return max((n.raw_bytes for n in self.nodes), default=0)


def node_shards(
    planning: EpochPlanner,
    epoch: int,
    partition: Partition,
    ranks_per_node: int,
) -> list[np.ndarray]:
    """The shard ids each physical node (``ranks_per_node`` consecutive ranks) reads in the
    epoch with fixed batches: by arithmetic when a node's ranks read whole partitions (a span
    each), else by walking every shuffle block of the order (the global order over several
    nodes)."""
    nodes = max(partition.world_size // ranks_per_node, 1)
    plans = planning.cluster(epoch, 0, partition, None)
    if partition.ranks <= ranks_per_node:  # a node holds whole partitions: their spans
        per = max(ranks_per_node // partition.ranks, 1)
        under = []  # every sample of a partition's span is read
        for plan in plans:
            assert isinstance(plan.order, EpochOrder)
            total = plan.order.total
            under.append(plan.order.shards_under(0, total) if total else np.zeros(0, np.int64))
        return [np.unique(np.concatenate(under[p * per : (p + 1) * per])) for p in range(nodes)]
    seen = np.zeros((nodes, len(planning.shard_sizes)), bool)
    for n, plan in enumerate(plans):
        order, size = plan.order, planning.batch_size or 1
        assert isinstance(order, EpochOrder)
        starts = order.starts  # each shard's first sample id
        read = plan.slots.steps_per_rank * partition.ranks  # slots read, repeats included
        for b in range(order.num_blocks):
            lo, hi = order.block_range(b)
            ids = order.block(b)
            k = np.arange(lo, hi) // size
            keep = k < min(read, plan.num_batches)
            rank = n * partition.ranks + k[keep] % partition.ranks
            shard = np.searchsorted(starts, ids[keep], side="right") - 1
            seen[rank // ranks_per_node, shard] = True
        for q in range(plan.num_batches, read):  # repeats that even out the ranks
            ids = np.asarray(plan.batches[q % plan.num_batches])
            shard = np.searchsorted(starts, ids, side="right") - 1
            seen[(n * partition.ranks + q % partition.ranks) // ranks_per_node, shard] = True
    return [np.flatnonzero(row) for row in seen]


def epoch_cost(
    manifest: Manifest,
    planning: EpochPlanner,
    epoch: int,
    partition: Partition,
    ranks_per_node: int,
    previous: Sequence[np.ndarray] | None = None,
) -> tuple[EpochCost, list[np.ndarray]]:
    """The epoch's :class:`EpochCost` and each node's shards (pass them as ``previous`` to
    the next epoch's call to count what a node cache holding its share keeps)."""
    stored = np.array([s.bytes for s in manifest.shards], np.int64)
    raw = np.array([s.raw_bytes for s in manifest.shards], np.int64)
    shards = node_shards(planning, epoch, partition, ranks_per_node)
    costs = []
    for p, mine in enumerate(shards):
        kept = 0 if previous is None else int(np.isin(mine, previous[p]).sum())
        costs.append(
            NodeCost(p, int(mine.size), int(stored[mine].sum()), int(raw[mine].sum()), kept)
        )
    working = int(np.sort(raw)[-2:].sum())  # unshuffled: two neighbouring shards
    if planning.shuffle.enabled:  # the shards under a partition's largest block, at once
        working = 0
        for plan in planning.cluster(epoch, 0, partition, None):
            assert isinstance(plan.order, EpochOrder)
            working = max(working, plan.order.peak_block_weight(raw))
    cost = EpochCost(epoch, partition, tuple(costs), int(stored.sum()), working)
    return cost, shards


# ------------------------------------------------------------------------- shuffle quality


@dataclass(frozen=True)
class Quality:
    """How an epoch mixes (higher distinct counts and |tau| near 0 are better): mean distinct
    shards (and classes, when labels are known) in a global batch (every rank's batch of one
    step together) and in one rank's batch, and Kendall's tau between the samples' pack order
    and the order the cluster consumes them in."""

    shards_per_global_batch: float
    shards_per_rank_batch: float
    kendall_tau: float
    classes_per_global_batch: float | None = None
    classes_per_rank_batch: float | None = None


def shuffle_quality(
    planning: EpochPlanner,
    epoch: int,
    partition: Partition,
    labels: np.ndarray | None = None,
    steps: int = 64,
    tau_samples: int = 20_000,
) -> Quality:
    """:class:`Quality` of an epoch, from ``steps`` steps spread over it (every rank's batch
    at each); ``labels[id]`` gives distinct classes too."""
    plans = planning.cluster(epoch, 0, partition, None)
    total = plans[0].slots.steps_per_rank
    if not total:
        return Quality(0.0, 0.0, 0.0)
    picked = np.unique(np.linspace(0, total - 1, min(steps, total)).astype(np.int64))
    starts = np.concatenate([[0], np.cumsum(planning.shard_sizes)])
    batches = [  # every rank's batch of each picked step, ranks in order
        [
            np.asarray(plan.batches[plan.slots.of_rank(local).slot_of(t)], np.int64)
            for plan in plans
            for local in range(plan.slots.world_size)
        ]
        for t in picked.tolist()
    ]

    def distinct(key: Callable[[np.ndarray], np.ndarray]) -> tuple[float, float]:
        """Mean distinct ``key(ids)`` in a global batch and in a rank batch."""
        per_global = [len(np.unique(key(np.concatenate(step)))) for step in batches]
        per_rank = [len(np.unique(key(b))) for step in batches for b in step]
        return float(np.mean(per_global)), float(np.mean(per_rank))

    seq = np.concatenate([b for step in batches for b in step])
    if seq.size > tau_samples:
        seq = seq[np.linspace(0, seq.size - 1, tau_samples).astype(np.int64)]
    shards = distinct(lambda ids: np.searchsorted(starts, ids, side="right") - 1)
    classes = (None, None) if labels is None else distinct(labels.__getitem__)
    return Quality(*shards, kendall_tau(seq), *classes)


def kendall_tau(values: np.ndarray) -> float:
    """Kendall's tau-a between positions ``0..n-1`` and ``values`` (1: ``values`` in pack
    order, 0: no relation, -1: reversed); ties count as neither, by a merge sort's
    inversion count (O(n log n))."""
    v = np.asarray(values, np.int64)
    n = v.size
    if n < 2:
        return 0.0
    pairs = n * (n - 1) // 2
    _, counts = np.unique(v, return_counts=True)
    tied = int((counts * (counts - 1) // 2).sum())
    discordant = _inversions(v)
    return float((pairs - tied - 2 * discordant) / pairs)  # (concordant - discordant) / pairs


def _inversions(v: np.ndarray) -> int:
    """Pairs ``i < j`` with ``v[i] > v[j]``: bottom-up merge sort, one numpy pass a level."""
    a = v.copy()
    n, width, count = a.size, 1, 0
    while width < n:
        for lo in range(0, n, 2 * width):
            mid, hi = min(lo + width, n), min(lo + 2 * width, n)
            left, right = a[lo:mid], a[mid:hi]
            if not right.size:
                continue
            # each right element passes the left elements greater than it
            count += int((left.size - np.searchsorted(left, right, side="right")).sum())
            a[lo:hi] = np.sort(np.concatenate([left, right]), kind="mergesort")
        width *= 2
    return count


# ------------------------------------------------------------------------- rank balance


@dataclass(frozen=True)
class RankBalance:
    """Per step, the dearest rank's cost over the mean rank cost, averaged over an epoch's
    steps (``balanced``: with ``balance="attention"``; ``unbalanced``: without) and at the
    worst step; ``ranks``: the ranks that share a step (one partition's), ``balance_c`` the
    cost's ``c``.  ``planned_for``: the ``ranks`` the planner balanced for (None: it does not
    balance; ``balanced`` is then what it would give), which a resume at another world size
    keeps (those steps dealt onto this world's ranks).

    A step waits for its slowest rank, and a rank's cost is its batch's ``sum(L**2) + c *
    sum(L)`` over its segments (NOTE [balanced steps] in :mod:`shardloader.batching.balance`),
    so 1.0 means every rank is busy the whole step."""

    ranks: int
    balance_c: float
    steps: int
    balanced: float
    unbalanced: float
    worst_balanced: float
    worst_unbalanced: float
    planned_for: int | None = None


def _figures(
    planning: EpochPlanner, epoch: int, part: Partition, lengths: np.ndarray
) -> tuple[float, float, int]:
    """Mean and worst dearest-over-mean rank cost of every partition's steps, and how many."""
    c = float(planning.planner.balance_c)
    ratios = [
        step_imbalance(batch_costs(list(plan.batches[: plan.num_batches]), c), part.ranks)
        for plan in planning.cluster(epoch, 0, part, lengths)
    ]
    got = np.concatenate(ratios)
    return (float(got.mean()), float(got.max()), len(got)) if got.size else (1.0, 1.0, 0)


def rank_balance(
    planning: EpochPlanner, epoch: int, partition: Partition, lengths: np.ndarray | None
) -> RankBalance | None:
    """The epoch's predicted per-step imbalance, balanced and not, for a
    :class:`~shardloader.batching.packed.PackedBatches` planning; None for other planners or
    without lengths."""
    planner = planning.planner
    if not isinstance(planner, PackedBatches) or lengths is None:
        return None
    ranks = planner.ranks if planner.balance is not None else None
    on = planner if ranks else dataclasses.replace(
        planner, balance="attention", ranks=partition.ranks
    )  # fmt: skip
    off = dataclasses.replace(planner, balance=None, ranks=None)
    bal = _figures(dataclasses.replace(planning, planner=on), epoch, partition, lengths)
    unbal = _figures(dataclasses.replace(planning, planner=off), epoch, partition, lengths)
    c = float(planner.balance_c)
    return RankBalance(partition.ranks, c, bal[2], bal[0], unbal[0], bal[1], unbal[1], ranks)
