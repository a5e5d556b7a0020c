"""What packed steps cost each rank, predicted from the plan alone: the figure
``ds.report().rank_balance`` and ``shardloader plan --balance`` give.

A step waits for its slowest rank, so the figure is each step's largest rank cost over its
mean rank cost (1.0: every rank busy the whole step), averaged over the epoch's steps, for the
plan with ``balance="attention"`` and without (NOTE [balanced steps] in
:mod:`shardloader.batching.balance`).  A rank's cost is its batch's ``sum(L**2) + c *
sum(L)`` over its segments.  Only the recorded lengths are read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.batching.balance import batch_costs, step_imbalance
from shardloader.batching.packed import PackedBatches

if TYPE_CHECKING:
    from shardloader.plan.partition import Partition

__all__ = ["RankBalance", "rank_balance", "with_rank_balance"]


@dataclass(frozen=True)
class RankBalance:
    """Per step, the dearest rank's cost over the mean rank cost, averaged over an epoch's
    steps (``balanced``: with ``balance="attention"``; ``unbalanced``: without) and at the
    worst step; ``ranks``: the ranks that share a step (one partition's), ``balance_c`` the
    cost's ``c``.  ``planned_for``: the ``ranks`` the planner balanced for (None: it does not
    balance; ``balanced`` is then what it would give), which a resume at another world size
    keeps (those steps dealt onto this world's ranks)."""

    ranks: int
    balance_c: float
    steps: int
    balanced: float
    unbalanced: float
    worst_balanced: float
    worst_unbalanced: float
    planned_for: int | None = None


def _figures(planning: Any, epoch: int, part: Partition, lengths: np.ndarray, c: float) -> Any:
    ratios = []
    for plan in planning.cluster(epoch, 0, part, lengths):
        batches = list(plan.batches[: plan.num_batches])
        ratios.append(step_imbalance(batch_costs(batches, c), part.ranks))
    got = np.concatenate(ratios) if ratios else np.ones(1)
    return (float(got.mean()), float(got.max()), len(got)) if got.size else (1.0, 1.0, 0)


def rank_balance(
    planning: Any, epoch: int, partition: Partition, lengths: np.ndarray | None
) -> RankBalance | None:
    """The epoch's predicted per-step imbalance, balanced and not, for a
    :class:`~shardloader.batching.packed.PackedBatches` planning (``planning``: the dataset's
    :class:`~shardloader.plan.epoch.EpochPlanner`); None for other planners or without
    lengths."""
    planner = planning.planner
    if not isinstance(planner, PackedBatches) or lengths is None:
        return None
    c = float(planner.balance_c)
    ranks = planner.ranks if planner.balance is not None else None
    on = planner if ranks else dataclasses.replace(
        planner, balance="attention", ranks=partition.ranks
    )  # fmt: skip
    off = dataclasses.replace(planner, balance=None, ranks=None)
    bal = _figures(dataclasses.replace(planning, planner=on), epoch, partition, lengths, c)
    unbal = _figures(dataclasses.replace(planning, planner=off), epoch, partition, lengths, c)
    return RankBalance(partition.ranks, c, bal[2], bal[0], unbal[0], bal[1], unbal[1], ranks)


def with_rank_balance(
    report: Any, planning: Any, epoch: int, partition: Partition, lengths: np.ndarray | None
) -> Any:
    """``report`` (an :class:`~shardloader.plan.epoch.EpochReport`) with its ``rank_balance``
    filled in where :func:`rank_balance` has one."""
    got = rank_balance(planning, epoch, partition, lengths)
    return report if got is None else dataclasses.replace(report, rank_balance=got)
