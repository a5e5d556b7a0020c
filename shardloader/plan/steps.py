"""A worker's steps of one pass, worked out as the worker walks them, never for the whole pass.

With the lazy order (NOTE [lazy order] in plan/order.py) a plan holds no per-sample array; this
module keeps the pass that way: a step's slot, seed and sample ids are computed when the step
(or the read-ahead just before it) asks, a window of steps at a time, so a worker's memory does
not grow with the epoch.  Pure functions of the plan, like :mod:`shardloader.plan.split`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from shardloader.batching.base import batch_ids
from shardloader.plan.order import EpochOrder
from shardloader.plan.split import BatchSlots, FixedBatchList

if TYPE_CHECKING:
    from shardloader.plan.epoch import EpochPlan

__all__ = [
    "WorkerSteps",
    "StepSeeds",
    "node_windows",
    "is_lazy",
]

_WINDOW = 4096  # steps whose slots and seeds are worked out at once
_EXACT = 16  # first steps of a pass whose read-ahead is scheduled by their batches' own shards
_KEEP = 64  # steps' sample ids kept (read-ahead asks for the next ones before they are read)


def is_lazy(plan: EpochPlan) -> bool:
    """Whether the plan reads its batches from a lazy order (fixed batches)."""
    return isinstance(plan.batches, FixedBatchList) and isinstance(plan.order, EpochOrder)


class WorkerSteps(Sequence[np.ndarray]):
    """Sample ids of each step of one worker (``steps[j]``: its ``j``-th step), from the plan
    when asked; :meth:`walk` gives ``(j, slot, seed index)`` a window at a time."""

    def __init__(self, plan: EpochPlan, worker: int, num_workers: int, bundle: int = 1) -> None:
        self.plan = plan
        # the rank steps this worker serves: step j, or with bundles of several batches
        # (NOTE [bundles] in deliver/transport.py) bundle j // bundle, modulo the workers
        self.mine: range | np.ndarray = plan.slots.worker_steps(worker, num_workers)
        if bundle > 1:
            j = np.arange(plan.slots.steps_per_rank, dtype=np.int64)
            self.mine = j[(j // bundle) % num_workers == worker]
        self._kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return len(self.mine)

    def window(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, seed indices)`` of this worker's steps ``lo..hi-1``."""
        r = self.mine[lo:hi]
        if isinstance(r, range):
            r = np.arange(r.start, r.stop, r.step, dtype=np.int64)
        return self.plan.slots.steps(r)

    def walk(self) -> Iterator[tuple[int, int, int]]:
        for lo in range(0, len(self), _WINDOW):
            slots, seeds = self.window(lo, lo + _WINDOW)
            yield from zip(range(lo, lo + len(slots)), slots.tolist(), seeds.tolist(), strict=True)

    def batch(self, j: int) -> np.ndarray:
        """The plan's batch of step ``j`` (ids ``[k]`` or segments ``[k, 3]``)."""
        return self._get(j)[0]

    @overload
    def __getitem__(self, j: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, j: slice) -> list[np.ndarray]: ...

    def __getitem__(self, j: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(j, slice):
            return [self._get(k)[1] for k in range(*j.indices(len(self)))]
        return self._get(j)[1]

    def _get(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._kept.get(j)
        if got is None:
            if not 0 <= j < len(self):
                raise IndexError(f"step {j} is outside this worker's {len(self)} steps")
            slot = self.plan.slots.slot_of(int(self.mine[j]))
            batch = self.plan.batches[slot]
            got = (batch, batch_ids(batch))
            if len(self._kept) >= _KEEP:
                del self._kept[next(iter(self._kept))]
            self._kept[j] = got
        return got


class StepSeeds:
    """``derive(seed indices)`` for a worker's steps, a window at a time: ``seeds[j]``."""

    def __init__(self, steps: WorkerSteps, derive: Callable[[np.ndarray], np.ndarray]) -> None:
        self.steps, self.derive = steps, derive
        self._lo, self._values = 0, []  # type: tuple[int, list[Any]]

    def __getitem__(self, j: int) -> Any:
        if not self._lo <= j < self._lo + len(self._values):
            self._lo = j - j % _WINDOW
            self._values = self.derive(self.steps.window(self._lo, self._lo + _WINDOW)[1]).tolist()
        return self._values[j - self._lo]


def node_windows(
    plan: EpochPlan, per_rank: Sequence[BatchSlots], locate: Callable[[np.ndarray], np.ndarray]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``(rank step, shard)`` of the shards the local ranks' steps read, in time order (steps
    in order, local ranks in turn), a growing window of steps at a time: what
    :func:`~shardloader.read.readahead.block_schedule` turns into the node's read-ahead schedule.

    The first :data:`_EXACT` steps: the shards their batches read (``locate``: ids to shards),
    so the first batches wait for their own shards only.  Later steps, shuffled: the shards
    under each shuffle block a step reads from, known from the batch's positions without
    generating the block's permutation (it may stage a shard of the block that no local
    rank's batch happens to read: with hundreds of a block's samples per node, rarely).
    Unshuffled: the shards the batch's positions run over, exact.
    """
    order, batches = plan.order, plan.batches
    assert isinstance(order, EpochOrder) and isinstance(batches, FixedBatchList)
    size, total, ranks = batches.batch_size, len(order), len(per_rank)
    shuffled = order.options.enabled
    unit_of = order.block_of if shuffled else order.run_of
    longest = max((s.steps_per_rank for s in per_rank), default=0)
    lo, width = 0, _EXACT
    while lo < longest:
        hi = min(lo + width, longest)
        steps, shards, times = [], [], []
        for i, slots in enumerate(per_rank):
            js = np.arange(lo, min(hi, slots.steps_per_rank), dtype=np.int64)
            if lo < _EXACT and shuffled:  # the first steps: exactly their batches' shards
                parts = [batches[q] for q in slots.steps(js)[0].tolist()]
                if parts:
                    shards.append(locate(np.concatenate(parts)))
                    j = np.repeat(js, [len(p) for p in parts])
                    steps.append(j)
                    times.append(j * ranks + i)
                continue
            first = slots.steps(js)[0] * size
            last = first + size - 1  # may pass the end: padding wraps to the start
            spans = [(js, first, np.minimum(last, total - 1))]
            wrapped = last >= total
            if wrapped.any():
                tail = np.minimum(last[wrapped] - total, total - 1)
                spans.append((js[wrapped], np.zeros(int(wrapped.sum()), np.int64), tail))
            for j, a, b in spans:
                u0, u1 = unit_of(a), unit_of(b)
                counts = u1 - u0 + 1
                at = np.repeat(np.cumsum(counts) - counts, counts)
                units = np.repeat(u0, counts) + np.arange(int(counts.sum())) - at
                j = np.repeat(j, counts)
                _, keep = np.unique(units, return_index=True)  # each unit once a window
                keep.sort()
                for step, unit in zip(j[keep].tolist(), units[keep].tolist(), strict=True):
                    under = order.block_shards(unit) if shuffled else order.run_shards(unit)
                    shards.append(under)
                    steps.append(np.full(len(under), step, np.int64))
                    times.append(np.full(len(under), step * ranks + i, np.int64))
        if times:
            by_time = np.argsort(np.concatenate(times), kind="stable")
            yield np.concatenate(steps)[by_time], np.concatenate(shards)[by_time]
        lo, width = hi, min(2 * width, _WINDOW)
