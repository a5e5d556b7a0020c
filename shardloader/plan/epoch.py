"""The epoch plan: which batches an epoch has and which of them a rank reads.

A pure function of (manifest shard sizes, seed, shuffle, planner or batch size, ``uneven``,
epoch, resume position, rank, world size and its partition), so every rank and worker plans
alike without talking (DESIGN.md "Order and split"; NOTE [node partitions] in
:mod:`shardloader.plan.partition`); the dataset only composes it, and hands in the sidecar
lengths a planner needs (:func:`shardloader.read.lengths.load_lengths`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching.accounting import TokenShares
from shardloader.batching.base import PlanReport, batch_ids, signature_of, stable_value
from shardloader.batching.fixed import FixedBatches, account_fixed
from shardloader.errors import UsageError
from shardloader.options import ShuffleOptions
from shardloader.plan.elastic import normalise, replan
from shardloader.plan.lists import node_lists, node_order, units_of
from shardloader.plan.order import EpochOrder
from shardloader.plan.partition import Partition
from shardloader.plan.rowmix import epoch_tokens
from shardloader.plan.split import BatchSlots, common_steps, rank_slots

__all__ = ["EpochReport", "EpochPlan", "EpochPlanner"]


@dataclass(frozen=True)
class EpochReport(TokenShares):
    """What one epoch looks like for this world size: steps per rank, what was evened out, and
    where every token of the epoch goes.

    Samples: ``padded_samples`` are repeats added so every batch and rank is full (flagged
    ``__pad__``); ``dropped_samples`` are left out entirely and ``truncated_samples`` in part, by
    any policy (the planner's tail, oversize and long-document rules, ``uneven="drop"``, a
    PadCollate's ``max_length`` with fixed batches).  Tokens count the manifest's length field
    (``None`` without one): ``tokens`` delivered, each once; ``truncated_tokens`` and
    ``dropped_tokens`` cut from truncated and dropped samples, so the three add up to
    ``total_tokens``, every token of the epoch; ``repeated_tokens`` delivered again in repeats;
    ``token_slots`` the positions all steps of all ranks allocate (``pad_fraction``: the share
    of them that is padding).
    """

    epoch: int
    num_samples: int
    steps_per_rank: int
    padded_samples: int  # duplicates added so every batch and rank is full
    dropped_samples: int  # samples of which nothing is delivered
    truncated_samples: int = 0  # samples of which only a part is delivered
    tokens: int | None = None
    truncated_tokens: int | None = None
    dropped_tokens: int | None = None
    repeated_tokens: int | None = None
    token_slots: int | None = None
    # packed rows: per-step rank cost, balanced and not (plan/cost.py's RankBalance)
    rank_balance: Any = None


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's batches of this rank's partition and the rank's slots in them (from
    ``start`` on; NOTE [node partitions] in :mod:`shardloader.plan.partition`: with one partition,
    the epoch's global batches).

    With fixed batches ``order`` is a lazy :class:`~shardloader.plan.order.EpochOrder` and
    ``batches`` a :class:`~shardloader.plan.split.FixedBatchList` over it (NOTE [lazy order]): the
    plan holds no per-sample array; ``np.asarray(plan.order)`` materialises the order."""

    order: np.ndarray | EpochOrder
    batches: Sequence[np.ndarray]
    slots: BatchSlots
    pad_in_last: int  # padding samples at the end of the last batch
    dropped: int  # samples cut from a partial last batch
    num_batches: int
    start: int  # first batch of this (possibly resumed) pass, counted in the partition
    # after batch-shape or partition changes: (planning, batches it delivered, every
    # partition's) per earlier link (NOTE [reshape history] in shardloader/plan/elastic.py)
    earlier: tuple[tuple[Any, list[np.ndarray]], ...] = ()

    @property
    def delivered_before(self) -> list[np.ndarray]:
        """Every batch the earlier links of the reshape history delivered, in link order (a new
        list)."""
        return [b for _, taken in self.earlier for b in taken]

    @property
    def seed_offset(self) -> int:
        """Added to the step numbers that seed augmentation: after a batch-shape change the
        rest's steps count from 0 again, and must not draw what earlier batches drew."""
        return len(self.earlier) << 32

    def pad_mask(self, slot: int, seed_index: int, n: int) -> np.ndarray:
        """Which of the ``n`` samples of the step (batch ``slot``, dealt as ``seed_index``)
        are padding: all of a repeated batch, the tail of a filled-up last one."""
        mask = np.zeros(n, bool)
        if self.slots.repeats(seed_index):  # a repeated batch that evens out the ranks
            mask[:] = True
        elif slot == self.num_batches - 1 and self.pad_in_last:
            mask[n - self.pad_in_last :] = True
        return mask

    def kept(self) -> list[np.ndarray]:
        """The partition's batches its steps deliver, up to those ``uneven="drop"`` leaves out."""
        return list(self.batches[: self.num_batches - self.slots.dropped_batches])

    def repeats(self) -> list[np.ndarray]:
        """The batches repeated from the partition's start so every rank has the same number
        of steps (``uneven="pad"``)."""
        n = self.num_batches
        return [self.batches[i % n] for i in range(self.slots.padded_batches)] if n else []

    def delivered(self) -> tuple[list[np.ndarray], int]:
        """The batches all of the partition's steps deliver (:meth:`kept`, then
        :meth:`repeats`) and the padded sample count."""
        repeats = self.repeats()
        padded = self.pad_in_last + sum(len(batch_ids(b)) for b in repeats)
        return self.kept() + repeats, padded


@dataclass(frozen=True)
class EpochPlanner:
    """The dataset's planning options; :meth:`plan` is pure, so every process plans alike."""

    shard_sizes: np.ndarray
    seed: int
    shuffle: ShuffleOptions
    uneven: str
    batch_size: int | None = None
    planner: Any = None
    order_source: Any = None  # ``partitioned(epoch, nodes)`` and ``signature()``: a blend

    def signature(self) -> str:
        """What must stay equal for a saved position to mean the same samples (NOTE [plan
        signature] in :mod:`shardloader.batching.base`); ``fixed(N)`` is ``batch_size=N``.
        The partition is not part of it: a resume may change it, like the world size (NOTE
        [reshape history] in :mod:`shardloader.plan.elastic`)."""
        if self.planner is not None:
            plan = signature_of(self.planner)
        else:
            plan = f"fixed({stable_value(self.batch_size)})"
        mix = "" if self.order_source is None else f";{self.order_source.signature()}"
        return f"{plan};shuffle={self.shuffle.signature()};uneven={self.uneven}{mix}"

    def node_orders(self, epoch: int, nodes: int, lengths: np.ndarray | None) -> list[np.ndarray]:
        """Every partition's order of the epoch, materialised (a mixture's blend split by
        partition, else each span of the shuffled stream; rows for TokenBlocks).  Every
        planning path after a resume starts here."""
        if self.order_source is not None:
            ids, node_of = self.order_source.partitioned(epoch, nodes)
            return [ids[node_of == n] for n in range(nodes)]
        units = units_of(self, lengths)
        return [
            np.asarray(node_order(self.seed, self.shuffle, epoch, nodes, n, units))
            for n in range(nodes)
        ]

    def plan(
        self,
        epoch: int,
        start: int,
        rank: int,
        world: int,
        lengths: np.ndarray | None,
        history: Sequence[Any] = (),
        partition: Partition | None = None,
    ) -> EpochPlan:
        """Rank ``rank``'s plan of the pass of ``epoch`` that begins after ``start`` global
        batches (every rank's steps together), in a world cut as ``partition`` (default one
        partition)."""
        part = partition or Partition(1, world)
        if part.world_size != world:
            raise UsageError(f"{part} does not make a world of {world} ranks")
        return self.cluster(epoch, start, part, lengths, history, rank)[0]

    def cluster(
        self,
        epoch: int,
        start: int,
        partition: Partition,
        lengths: np.ndarray | None,
        history: Sequence[Any] = (),
        rank: int | None = None,
    ) -> list[EpochPlan]:
        """Every partition's plan as its first rank reads it (what the report and the ledger
        count), or only ``rank``'s (its partition's batches alone are cut where they can be);
        after batch-shape or partition changes, the chain's rest
        (:func:`~shardloader.plan.elastic.replan`)."""
        if start % partition.nodes:
            raise UsageError(
                f"position {start} is not a step boundary of {partition}: a position counts the "
                f"global batches of whole steps, a multiple of the {partition.world_size} ranks"
            )
        nodes, ranks = partition.nodes, partition.ranks
        only = None if rank is None else partition.node_of(rank)
        if history:
            lists = replan(self, epoch, lengths, normalise(history), nodes)
        else:
            lists = node_lists(self, epoch, nodes, lengths, only)
        k0 = start // nodes  # each partition's batches consumed
        steps = common_steps(lists.counts, k0, ranks, self.uneven)
        local, earlier = 0 if rank is None else partition.local_rank(rank), lists.earlier
        plans = []
        for node in range(nodes) if only is None else [only]:
            got, n = lists.lists[node], lists.counts[node]
            slots = rank_slots(
                n, k0, local, ranks, self.uneven, steps=steps, node=node, nodes=nodes
            )
            plans.append(
                EpochPlan(
                    got.order, got.batches, slots, got.pad_in_last, got.dropped, n, k0, earlier
                )
            )
        return plans

    def report(
        self,
        epoch: int,
        plans: EpochPlan | Sequence[EpochPlan],
        lengths: np.ndarray | None,
        collate_fn: Any,
    ) -> EpochReport:
        """Steps, padding and where every token goes, for all ranks together (``plans``: every
        partition's, :meth:`cluster`)."""
        plans = [plans] if isinstance(plans, EpochPlan) else list(plans)
        first = plans[0]
        total = int(np.sum(self.shard_sizes))
        steps = first.slots.steps_per_rank
        if self.planner is not None and self.planner.units == "rows":  # batching/blocks.py
            counts = epoch_tokens(self.planner, self.shard_sizes, lengths, plans)
            return EpochReport(epoch, total, steps, **counts)
        lazy = all(isinstance(p.order, EpochOrder) for p in plans) and self.planner is None
        if lazy and lengths is None and not first.earlier:  # arithmetic: nothing materialised
            size = self.batch_size or 1
            padded = sum(p.pad_in_last + p.slots.padded_batches * size for p in plans)
            dropped = sum(p.dropped + p.slots.dropped_batches * size for p in plans)
            return EpochReport(epoch, total, steps, padded, dropped)
        order, batches, acc = self.accounted(epoch, plans, lengths, collate_fn)
        padded = sum(p.delivered()[1] for p in plans)
        if first.earlier and acc.padded_tokens is not None:  # slots as each link allocated
            links = [*first.earlier, (self, batches[len(first.delivered_before) :])]
            slots = sum(
                p._account(order, b, lengths, collate_fn).padded_tokens or 0 for p, b in links
            )
            acc = dataclasses.replace(acc, padded_tokens=slots)
        return EpochReport(
            epoch,
            total,
            steps,
            padded,
            len(acc.dropped),
            len(acc.truncated),
            acc.tokens,
            acc.truncated_tokens,
            acc.dropped_tokens,
            acc.repeated_tokens,
            acc.padded_tokens,
        )

    def accounted(
        self, epoch: int, plans: Sequence[EpochPlan], lengths: np.ndarray | None, collate_fn: Any
    ) -> tuple[np.ndarray, list[np.ndarray], PlanReport]:
        """The epoch's whole order, every batch its steps deliver (earlier links' first) and
        their accounting: what :meth:`report` and the ledger count."""
        first = plans[0]
        batches = first.delivered_before + [b for p in plans for b in p.delivered()[0]]
        if first.earlier:  # the plans hold only the rest: the epoch's whole order, planned
            order = self.node_orders(epoch, 1, lengths)[0]
        else:
            order = np.concatenate([np.asarray(p.order) for p in plans])
        return order, batches, self._account(order, batches, lengths, collate_fn)

    def _account(
        self,
        order: np.ndarray,
        batches: Sequence[np.ndarray],
        lengths: np.ndarray | None,
        collate_fn: Any,
    ) -> PlanReport:
        if self.planner is not None and not isinstance(self.planner, FixedBatches):
            return self.planner.report(order, lengths, batches)
        return account_fixed(order, lengths, batches, collate_fn)  # the collate pads
