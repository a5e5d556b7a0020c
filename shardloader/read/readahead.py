"""Read-ahead: which shards this node needs next, in plan order, shared by its processes.

NOTE [node-wide read-ahead]: every DataLoader worker of every local rank computes the same
schedule, a pure function of the epoch plan and the ranks on this node: each shard once, at the
first rank step at which any local rank needs it (steps in order, local ranks in turn within a
step). A worker at rank step ``t`` asks its :class:`~shardloader.read.shardset.ShardSet` to stage
every entry due by ``t``, then (once those are in) the next ``depth`` entries, where ``depth`` is
``readahead`` for each process on the node. Staging goes through the node cache's per-shard lock
without waiting: a shard another process is staging is skipped, one already staged costs a
``stat``. So the node's processes split the downloads between them, ahead of the steps that read
them, overlapping decoding, and no shard is fetched twice, whether workers and ranks need the
same shards (stream order) or different ones (shuffled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from shardloader.batching.base import batch_ids
from shardloader.plan.steps import is_lazy, node_windows

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan
    from shardloader.plan.partition import Partition
    from shardloader.plan.split import Place
    from shardloader.read.shardset import ShardSet

__all__ = ["ReadAhead", "node_schedule", "block_schedule", "pass_readahead"]


def node_schedule(
    batch_shards: Sequence[np.ndarray], steps: Sequence[np.ndarray]
) -> list[tuple[int, int]]:
    """``(rank step, shard)`` of every shard the node needs, at its first need, in order.

    ``batch_shards[i]`` / ``steps[i]``: the shard of each sample read by local rank ``i``
    (its batches concatenated) and the rank step of each of those samples.
    """
    ranks = len(batch_shards)
    if not ranks:
        return []
    shard = np.concatenate([np.asarray(s, np.int64) for s in batch_shards])
    step = np.concatenate([np.asarray(t, np.int64) for t in steps])
    local = np.concatenate([np.full(len(s), i, np.int64) for i, s in enumerate(batch_shards)])
    order = np.argsort(step * ranks + local, kind="stable")  # steps in order, ranks in turn
    return list(block_schedule([(step[order], shard[order])]))  # the whole plan: one window


def block_schedule(windows: Iterable[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[int, int]]:
    """:func:`node_schedule` of a lazy order (NOTE [lazy order] in plan/order.py), as walked.

    ``windows`` yields ``(rank step, shard)`` pairs, step by step in order (local ranks in turn
    within a step), a window of steps at a time (:func:`shardloader.plan.steps.node_windows`: the
    first steps' shards exact, later ones those of the shuffle blocks the steps reach).  Each
    shard once, at its first need; generated only as far as a worker has walked.
    """
    seen: set[int] = set()
    for steps, shards in windows:
        if not len(shards):
            continue
        _, first = np.unique(shards, return_index=True)
        first.sort()
        for step, shard in zip(steps[first].tolist(), shards[first].tolist(), strict=True):
            if shard not in seen:
                seen.add(shard)
                yield step, shard


class ReadAhead:
    """Walks a node schedule for one worker, staging ahead through its ShardSet.

    The schedule (a list, or an iterator: :func:`block_schedule`) is pulled only as far as the
    worker's steps and its read-ahead depth need."""

    def __init__(self, shards: ShardSet, schedule: Iterable[tuple[int, int]], depth: int) -> None:
        self.shards = shards
        self._source: Iterator[tuple[int, int]] | None = iter(schedule)
        self.schedule: list[tuple[int, int]] = []  # the entries pulled so far
        self.depth = depth
        self._due = 0  # entries needed by the steps reached so far
        self._late: list[int] = []  # shards due now that read-ahead had not asked for
        self._submitted = 0  # entries handed to the ShardSet so far

    def advance(self, step: int) -> None:
        """The worker reached rank step ``step``: stage what is due, and ``depth`` more."""
        self._pull(lambda: bool(self.schedule) and self.schedule[-1][0] > step)
        while self._due < len(self.schedule) and self.schedule[self._due][0] <= step:
            self._due += 1
        if self._due > self._submitted:  # needed now and not read ahead: first, on their own
            self._late = [s for _, s in self.schedule[self._submitted : self._due]]
            self.shards.prefetch(self._late)
            self._submitted = self._due
        # Shards needed now that were not read ahead (the first step, or read-ahead fell behind)
        # get the bandwidth to themselves while they arrive: read-ahead sharing it would delay
        # this step by as much as it gains later.  Shards read ahead hold nothing back.
        if self._late and self.shards.staging(self._late):
            return
        self._late = []
        self._pull(lambda: len(self.schedule) >= self._due + self.depth)
        target = min(len(self.schedule), self._due + self.depth)
        if target > self._submitted:
            self.shards.prefetch(s for _, s in self.schedule[self._submitted : target])
            self._submitted = target

    def _pull(self, enough: Callable[[], bool]) -> None:
        """Take entries from a lazy schedule until ``enough()`` or it ends."""
        while self._source is not None and not enough():
            entry = next(self._source, None)
            if entry is None:
                self._source = None
            else:
                self.schedule.append(entry)


def pass_readahead(
    shards: ShardSet,
    plan: EpochPlan,
    place: Place,
    depth: int,
    partition: Partition,
    ranks_per_node: int | None,
    shard_of: Callable[[np.ndarray], np.ndarray] | None = None,
) -> ReadAhead:
    """This node's read-ahead schedule for a pass (NOTE [node-wide read-ahead] above), walked by
    the worker at ``place`` through ``shards``; ``depth`` is ``ReadOptions.readahead``.  The
    node's ranks are its partition's (NOTE [node partitions] in :mod:`shardloader.plan.partition`),
    or with one partition the ``ranks_per_node`` the dataset resolved its world with
    (:func:`~shardloader.world.resolve_world`; None, unknown: this rank alone).  ``shard_of``:
    the shard of each unit the plan batches (default: of each sample id, ``shards.locate``)."""
    if shard_of is None:
        shard_of = lambda ids: shards.locate(ids)[0]  # noqa: E731
    if shards.in_place or depth <= 0:
        return ReadAhead(shards, [], 0)
    per_node = partition.ranks
    if partition.nodes == 1:
        per_node = ranks_per_node or 1
    first = place.rank - place.rank % per_node
    ranks = list(range(first, first + per_node))
    per_rank = [plan.slots.of_rank(partition.local_rank(r)) for r in ranks]
    if is_lazy(plan):  # walked lazily: the first steps exact, then by block (plan/steps.py)
        lazy = block_schedule(node_windows(plan, per_rank, shard_of))
        return ReadAhead(shards, lazy, depth * len(ranks) * place.num_workers)
    reads = [batch_ids(b) for b in plan.batches]
    shard_ids, steps = [], []
    for slots in per_rank:
        parts = [reads[int(s)] for s in slots.slots]
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        shard_ids.append(shard_of(ids))
        steps.append(np.repeat(np.arange(len(parts)), [len(p) for p in parts]))
    schedule = node_schedule(shard_ids, steps)
    return ReadAhead(shards, schedule, depth * len(ranks) * place.num_workers)
