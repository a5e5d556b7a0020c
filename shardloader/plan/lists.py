"""Each partition's order and batches for one epoch: what :mod:`shardloader.plan.epoch` deals.

Pure functions of the planning options, the epoch and the partition (NOTE [node partitions] in
:mod:`shardloader.plan.partition`).  Fixed batches stay lazy: a partition's order is an
:class:`~shardloader.plan.order.EpochOrder` over its span and its batch count is arithmetic, so a
rank builds its own partition only.  Planners that look at every sample (length-aware,
packing, a mixture's blend, token rows) get the orders materialised and cut each partition's
order on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.options import ShuffleOptions
from shardloader.plan.order import EpochOrder, count_blocks
from shardloader.plan.partition import spans
from shardloader.plan.shuffle import plan_rng
from shardloader.plan.split import FixedBatchList

__all__ = ["NodeLists", "node_lists", "node_order", "cut", "units_of"]

EpochPlanner = Any  # shardloader.plan.epoch's, which imports this module


@dataclass(frozen=True)
class NodeList:
    """One partition's order and its batches (``pad_in_last`` / ``dropped``: samples its
    last batch repeats or its partial tail leaves out, fixed batches only)."""

    order: Any  # EpochOrder (lazy) or int64 array; segments for packing after a resume
    batches: Sequence[np.ndarray]
    pad_in_last: int = 0
    dropped: int = 0


@dataclass(frozen=True)
class NodeLists:
    """Every partition's batch count, and the lists of those built (all, or one rank's)."""

    counts: tuple[int, ...]
    lists: dict[int, NodeList]
    # after a resume changed the batch shape or the partition: (planning, batches it
    # delivered) per earlier link (NOTE [reshape history] in shardloader/plan/elastic.py)
    earlier: tuple[tuple[Any, list[np.ndarray]], ...] = field(default=())


def units_of(planning: EpochPlanner, lengths: np.ndarray | None) -> np.ndarray:
    """What the epoch orders per shard: samples, or for TokenBlocks the shard's rows."""
    if planning.planner is None:
        return np.asarray(planning.shard_sizes, np.int64)
    return planning.planner.units_per_shard(planning.shard_sizes, lengths)


def node_order(
    seed: int, shuffle: ShuffleOptions, epoch: int, nodes: int, node: int, units: np.ndarray
) -> EpochOrder:
    """Partition ``node``'s order of ``nodes``: its span of the epoch's stream, shuffled in
    blocks numbered after the previous spans' (NOTE [node spans] in plan/order.py); with one
    partition exactly the epoch order."""
    bounds = spans(int(np.sum(units)), nodes)
    short, extra = divmod(int(bounds[-1]), nodes)
    longer = min(node, extra)  # spans before this one that are one sample longer
    first = longer * count_blocks(short + 1, shuffle) + (node - longer) * count_blocks(
        short, shuffle
    )
    span = (int(bounds[node]), int(bounds[node + 1]))
    return EpochOrder(units, seed, epoch, shuffle, span=span, first_block=first)


def cut(
    planning: EpochPlanner,
    order: Any,
    lengths: np.ndarray | None,
    epoch: int,
    node: int,
    nodes: int,
) -> NodeList:
    """A partition's batches of ``order`` under ``planning`` (ids, or segments ``[n, 3]``);
    fixed batches of a lazy order are read from it when asked (:class:`FixedBatchList`)."""
    planner = planning.planner
    if planner is None:
        batches = FixedBatchList(order, planning.batch_size or 1, planning.uneven)
        got = batches if isinstance(order, EpochOrder) else list(batches)
        return NodeList(order, got, batches.padded, batches.dropped)
    rng = plan_rng(planning.seed, epoch, node, nodes)
    order = np.asarray(order)
    if order.ndim == 2:  # segments left by an earlier link (packing, after a resume)
        return NodeList(order, list(planner.plan_segments(order, rng)))
    return NodeList(order, list(planner.plan(order, lengths, rng)))


def node_lists(
    planning: EpochPlanner,
    epoch: int,
    nodes: int,
    lengths: np.ndarray | None,
    only: int | None = None,
) -> NodeLists:
    """Every partition's batch count for the epoch's first link, with the lists of partition
    ``only`` (or of all).  Fixed batches and token rows count by arithmetic, so a rank plans
    its own partition only; other planners plan every partition (as much work as planning
    the whole epoch once) and every partition's lists come back."""
    planner = planning.planner
    order_of: Callable[[int], Any]
    if planning.order_source is not None:  # a mixture's blend: each partition's positions
        orders = planning.node_orders(epoch, nodes, lengths)
        sizes = [len(o) for o in orders]
        order_of = orders.__getitem__
    else:  # each partition's span of the shuffled stream, lazy
        units = units_of(planning, lengths)
        sizes = np.diff(spans(int(np.sum(units)), nodes)).tolist()

        def order_of(n: int) -> Any:
            return node_order(planning.seed, planning.shuffle, epoch, nodes, n, units)

    # other planners must cut every partition to count its batches
    counted = planner is None or planner.units == "rows"
    wanted = [only] if counted and only is not None else range(nodes)
    lists = {n: cut(planning, order_of(n), lengths, epoch, n, nodes) for n in wanted}
    if planner is None:
        size = planning.batch_size or 1
        counts = tuple(len(FixedBatchList(range(s), size, planning.uneven)) for s in sizes)
    elif planner.units == "rows":
        counts = tuple(planner.count_rows(s) for s in sizes)
    else:
        counts = tuple(len(lists[n].batches) for n in range(nodes))
    return NodeLists(counts, lists)
