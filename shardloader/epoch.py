"""The epoch plan: which global batches an epoch has and which of them a rank reads.

A pure function of (manifest shard sizes, seed, shuffle, planner or batch size, ``uneven``,
epoch, resume position, rank, world size), so every rank and worker plans alike without
talking (DESIGN.md "Order and split"); the dataset only composes it.  The sidecar lengths a
planner needs are the one thing read (:func:`load_lengths`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching.base import PlanReport, batch_ids, signature_of, stable_value
from shardloader.batching.fixed import FixedBatches, account_fixed
from shardloader.elastic import replan
from shardloader.manifest import Manifest
from shardloader.shards import ReadOptions
from shardloader.shuffle import EpochOrder, ShuffleOptions, plan_rng
from shardloader.split import BatchSlots, FixedBatchList, rank_slots

__all__ = ["EpochReport", "EpochPlan", "EpochPlanner", "load_lengths"]


@dataclass(frozen=True)
class EpochReport:
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

    @property
    def total_tokens(self) -> int | None:
        """Every token of the epoch's samples: delivered + truncated + dropped."""
        if self.tokens is None:
            return None
        return self.tokens + (self.truncated_tokens or 0) + (self.dropped_tokens or 0)

    @property
    def pad_fraction(self) -> float | None:
        """Share of the allocated token slots that is padding."""
        if self.tokens is None or not self.token_slots:
            return None
        return 1.0 - (self.tokens + (self.repeated_tokens or 0)) / self.token_slots


@dataclass(frozen=True)
class EpochPlan:
    """One epoch's global batches and this rank's slots in them (from ``start`` on).

    With fixed batches ``order`` is a lazy :class:`~shardloader.shuffle.EpochOrder` and
    ``batches`` a :class:`~shardloader.split.FixedBatchList` over it (NOTE [lazy order]): the
    plan holds no per-sample array; ``np.asarray(plan.order)`` materialises the order."""

    order: np.ndarray | EpochOrder
    batches: Sequence[np.ndarray]
    slots: BatchSlots
    pad_in_last: int  # padding samples at the end of the last global batch
    dropped: int  # samples cut from a partial last batch
    num_batches: int
    start: int  # first global batch of this (possibly resumed) pass
    # after batch-shape changes: (planning, batches it delivered) per earlier link, and
    # ``batches`` plan what they left (NOTE [reshape history] in shardloader/elastic.py)
    earlier: tuple[tuple[Any, list[np.ndarray]], ...] = ()

    @property
    def seed_offset(self) -> int:
        """Added to the step numbers that seed augmentation: after a batch-shape change the
        rest's steps count from 0 again, and must not draw what earlier batches drew."""
        return len(self.earlier) << 32

    def pad_mask(self, slot: int, seed_index: int, n: int) -> np.ndarray:
        """Which of the ``n`` samples of the step (global batch ``slot``, dealt as
        ``seed_index``) are padding: all of a repeated batch, the tail of a filled-up last one."""
        mask = np.zeros(n, bool)
        if seed_index >= self.num_batches:  # a repeated batch that evens out the ranks
            mask[:] = True
        elif slot == self.num_batches - 1 and self.pad_in_last:
            mask[n - self.pad_in_last :] = True
        return mask

    def delivered(self) -> tuple[list[np.ndarray], int]:
        """The batches all ranks' steps deliver (up to those ``uneven="drop"`` leaves out, plus
        those repeated from the epoch's start under ``"pad"``) and the padded sample count."""
        s, n = self.slots, self.num_batches
        repeats = [self.batches[i % n] for i in range(s.padded_batches)] if n else []
        padded = self.pad_in_last + sum(len(batch_ids(b)) for b in repeats)
        return list(self.batches[: n - s.dropped_batches]) + repeats, padded


@dataclass(frozen=True)
class EpochPlanner:
    """The dataset's planning options; :meth:`plan` is pure, so every process plans alike."""

    shard_sizes: np.ndarray
    seed: int
    shuffle: ShuffleOptions
    uneven: str
    batch_size: int | None = None
    planner: Any = None
    order_source: Any = None  # ``order(epoch)`` and ``signature()``: a mixture's blend

    def signature(self) -> str:
        """What must stay equal for a saved position to mean the same samples (NOTE [plan
        signature] in :mod:`shardloader.batching.base`); ``fixed(N)`` is ``batch_size=N``."""
        if self.planner is not None:
            plan = signature_of(self.planner)
        else:
            plan = f"fixed({stable_value(self.batch_size)})"
        text = f"{plan};shuffle={signature_of(self.shuffle)};uneven={self.uneven}"
        if self.order_source is not None:
            text += f";{self.order_source.signature()}"
        return text

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's sample order: a mixture's blend, else the shuffled shards' samples.
        Every planning path (a first plan, a re-cut after a reshape) starts here."""
        if self.order_source is not None:
            return np.asarray(self.order_source.order(epoch))
        return np.asarray(EpochOrder(self.shard_sizes, self.seed, epoch, self.shuffle))

    def plan(
        self,
        epoch: int,
        start: int,
        rank: int,
        world: int,
        lengths: np.ndarray | None,
        history: Sequence[tuple[int, int]] = (),
    ) -> EpochPlan:
        if history:  # the batch shape changed at a resume (shardloader/elastic.py)
            again = replan(self, epoch, lengths, history)
            n = len(again.batches)
            slots = rank_slots(n, start, rank, world, self.uneven)
            return EpochPlan(
                again.order,
                again.batches,
                slots,
                again.pad_in_last,
                again.dropped,
                n,
                start,
                again.earlier,
            )
        pad_in_last = dropped = 0
        stream = getattr(self.planner, "plan_stream", None)
        if stream is not None:  # rows of token streams, not samples (batching/blocks.py)
            rows, blocks = stream(self.shard_sizes, lengths, self.seed, epoch, self.shuffle)
            slots = rank_slots(len(blocks), start, rank, world, self.uneven)
            return EpochPlan(rows, blocks, slots, 0, 0, len(blocks), start)
        order: np.ndarray | EpochOrder
        if self.order_source is not None:  # a mixture's blend
            order = np.asarray(self.order_source.order(epoch))
        else:
            order = EpochOrder(self.shard_sizes, self.seed, epoch, self.shuffle)
        batches: Sequence[np.ndarray]
        if self.planner is not None:  # planners look at every sample: the order, whole
            order = np.asarray(order)
            batches = list(self.planner.plan(order, lengths, plan_rng(self.seed, epoch)))
        else:  # nothing per sample until a batch is read (NOTE [lazy order] in shuffle.py)
            batches = FixedBatchList(order, self.batch_size or 1, self.uneven)
            pad_in_last, dropped = batches.padded, batches.dropped
        slots = rank_slots(len(batches), start, rank, world, self.uneven)
        return EpochPlan(order, batches, slots, pad_in_last, dropped, len(batches), start)

    def report(
        self, epoch: int, plan: EpochPlan, lengths: np.ndarray | None, collate_fn: Any
    ) -> EpochReport:
        """Steps, padding and where every token goes, for all ranks together."""
        stream = getattr(self.planner, "report_stream", None)
        if stream is not None:  # rows of token streams (batching/blocks.py)
            s, n = plan.slots, plan.num_batches
            repeats = [plan.batches[i % n] for i in range(s.padded_batches)] if n else []
            earlier = [b for _, taken in plan.earlier for b in taken]
            counts = stream(
                self.shard_sizes,
                lengths,
                earlier + list(plan.batches[: n - s.dropped_batches]),
                repeats,
            )
            for link, taken in plan.earlier:  # slots of rows delivered with another shape
                per_batch = self.planner.seq_len * (
                    link.planner.rows_per_batch - self.planner.rows_per_batch
                )
                counts["token_slots"] += len(taken) * per_batch
            return EpochReport(epoch, int(np.sum(self.shard_sizes)), s.steps_per_rank, **counts)
        batches = plan.batches
        lazy = isinstance(batches, FixedBatchList) and self.planner is None
        if lazy and lengths is None and not plan.earlier:  # arithmetic: nothing materialised
            assert isinstance(batches, FixedBatchList)
            return self._fixed_report(epoch, plan, batches.batch_size)
        delivered, padded = plan.delivered()
        acc = self._account(np.asarray(plan.order), delivered, lengths, collate_fn)
        if plan.earlier:  # resumed with another batch shape: count what earlier links gave
            acc = self._with_earlier(plan, delivered, lengths, collate_fn)
        return EpochReport(
            epoch,
            int(np.sum(self.shard_sizes)),
            plan.slots.steps_per_rank,
            padded,
            len(acc.dropped),
            len(acc.truncated),
            acc.tokens,
            acc.truncated_tokens,
            acc.dropped_tokens,
            acc.repeated_tokens,
            acc.padded_tokens,
        )

    def _with_earlier(
        self,
        plan: EpochPlan,
        delivered: list[np.ndarray],
        lengths: np.ndarray | None,
        collate_fn: Any,
    ) -> PlanReport:
        """The epoch's accounting over every link: samples and tokens over all delivered
        batches, token slots as each link's planner allocated them."""
        earlier = [b for _, taken in plan.earlier for b in taken]
        acc = self._account(np.asarray(plan.order), earlier + delivered, lengths, collate_fn)
        if acc.padded_tokens is None:
            return acc
        slots = (
            self._account(np.asarray(plan.order), delivered, lengths, collate_fn).padded_tokens or 0
        )
        for link, taken in plan.earlier:
            slots += (
                link._account(np.asarray(plan.order), taken, lengths, collate_fn).padded_tokens or 0
            )
        return dataclasses.replace(acc, padded_tokens=slots)

    def _fixed_report(self, epoch: int, plan: EpochPlan, size: int) -> EpochReport:
        """:meth:`report` of fixed batches without lengths, by arithmetic (the lazy plan is
        never materialised): repeats are whole batches from the epoch's start and the padded
        tail, drops the cut tail and the batches ``uneven="drop"`` leaves out; never both."""
        s = plan.slots
        return EpochReport(
            epoch,
            int(np.sum(self.shard_sizes)),
            s.steps_per_rank,
            plan.pad_in_last + s.padded_batches * size,
            plan.dropped + s.dropped_batches * size,
        )

    def _account(
        self,
        order: np.ndarray,
        batches: Sequence[np.ndarray],
        lengths: np.ndarray | None,
        collate_fn: Any,
    ) -> PlanReport:
        report = getattr(self.planner, "report", None)
        if report is not None and not isinstance(self.planner, FixedBatches):
            return report(order, lengths, batches)  # type: ignore[no-any-return]
        return account_fixed(order, lengths, batches, collate_fn)  # the collate pads


def load_lengths(
    manifest: Manifest, base: str, read: ReadOptions, *, required: bool = True
) -> np.ndarray | None:
    """Every sample's recorded length (the manifest's length field), by global id, from the
    sidecars' length columns, mapped from the node cache (:mod:`shardloader.lengths`);
    ``None`` (or, when ``required``, a UsageError) if a shard records none."""
    from shardloader.lengths import load_lengths as shared

    return shared(manifest, base, read, required=required)
