"""Who reads what: pure functions of (order, batches, start, rank, world, worker).

NOTE [rank and worker split]: batch ``i`` of a partition's batches belongs to its rank
``i mod R`` (with one partition: global batch ``i`` to rank ``i mod W``; NOTE [node partitions]
in :mod:`shardloader.plan.partition`); on a rank, its ``j``-th batch belongs to DataLoader worker
``j mod K``.  torch's DataLoader collects worker outputs round-robin in submission order, so the
batches a rank sees, and their order, do not depend on K.  Every rank gets the same number of
batches: each partition's remaining batches are padded (batches repeated from its start) or
dropped to the common number of steps, and the report says how many.  Nothing here reads torch,
the environment or a clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np

from shardloader.errors import UsageError

__all__ = [
    "UNEVEN_POLICIES",
    "Place",
    "BatchSlots",
    "FixedBatchList",
    "common_steps",
    "rank_slots",
]

UNEVEN_POLICIES = ("pad", "drop")


@dataclass(frozen=True)
class Place:
    """Where this process sits: distributed rank/world and DataLoader worker/count."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "worker", "num_workers"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise UsageError(f"{name} must be an integer, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is outside world_size {self.world_size}")
        if not 0 <= self.worker < self.num_workers:
            raise UsageError(f"worker {self.worker} is outside num_workers {self.num_workers}")

    def __str__(self) -> str:
        return f"rank {self.rank}/{self.world_size}, worker {self.worker}/{self.num_workers}"


def _check_policy(uneven: str) -> None:
    if uneven not in UNEVEN_POLICIES:
        raise UsageError(f"uneven={uneven!r} is not one of {UNEVEN_POLICIES}")


class FixedBatchList(Sequence[np.ndarray]):
    """Fixed batches of an order, not cut: batch ``i`` is read from the order when asked.

    ``order`` is an array or a lazy :class:`~shardloader.plan.order.EpochOrder` (anything with
    ``len``, slices and array indexing), so the batches of a billion-sample epoch cost nothing
    until read (NOTE [lazy order] in plan/order.py).  Batch ``i`` is positions
    ``[i * batch_size, (i + 1) * batch_size)``.  A partial last batch is never emitted (it would
    make a 1-sample BatchNorm batch possible): under ``pad`` the positions past the end wrap to
    the order's start (``np.resize``'s rule), under ``drop`` it is left out; ``padded`` and
    ``dropped`` count those samples.
    """

    def __init__(self, order: Any, batch_size: int, uneven: str) -> None:
        _check_policy(uneven)
        if batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {batch_size}")
        self.order, self.batch_size = order, int(batch_size)
        self.total = n = len(order)
        tail = n % batch_size
        self.padded = batch_size - tail if tail and uneven == "pad" and n else 0
        self.dropped = tail if tail and not self.padded else 0
        self.num_batches = (n + self.padded - self.dropped) // batch_size

    def __len__(self) -> int:
        return self.num_batches

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self.num_batches))]
        k = int(i) + (self.num_batches if i < 0 else 0)
        if not 0 <= k < self.num_batches:
            raise IndexError(f"batch {i} is outside the epoch's {self.num_batches} batches")
        lo, hi = k * self.batch_size, (k + 1) * self.batch_size
        if hi <= self.total:
            return np.asarray(self.order[lo:hi], np.int64)
        head = np.asarray(self.order[lo : self.total], np.int64)
        wrap = np.arange(hi - self.total, dtype=np.int64) % self.total  # np.resize's rule
        return np.concatenate([head, np.asarray(self.order[wrap], np.int64)])


@dataclass(frozen=True)
class BatchSlots:
    """A rank's share of the remaining batches of an epoch, as arithmetic (nothing per step).

    The batches are its partition's (NOTE [node partitions] in :mod:`shardloader.plan.partition`:
    with one partition, the epoch's): the rank's ``j``-th step is slot ``q = start + j *
    world_size + rank``, ``world_size`` and ``rank`` counted inside the partition.  ``slots[j]``
    is the index of the batch it reads (``q mod M``: ``q``, or for padding one from the start) and
    ``seeds[j] = q * nodes + node`` a number no other step of the job has, which seeds
    augmentation (``q`` itself with one partition).  :meth:`steps` gives both for any steps;
    the ``slots``/``seeds`` properties build them for the whole pass.
    """

    start: int
    rank: int
    world_size: int
    num_batches: int
    padded_batches: int
    dropped_batches: int
    steps_per_rank: int
    node: int = 0
    nodes: int = 1

    def steps(self, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slots, seeds)`` of this rank's steps ``js``."""
        q = self.start + np.asarray(js, np.int64) * self.world_size + self.rank
        slots = q % self.num_batches if self.num_batches else q  # past the end: from the start
        return slots, q * self.nodes + self.node  # q itself with one partition

    def repeats(self, seed: int) -> bool:
        """Whether the step of seed number ``seed`` repeats a batch to even out the ranks."""
        return seed // self.nodes >= self.num_batches

    def slot_of(self, j: int) -> int:
        """``steps([j])[0][0]`` as a plain int (one step, no arrays)."""
        q = self.start + j * self.world_size + self.rank
        return q % self.num_batches if self.num_batches else q

    def worker_steps(self, worker: int, num_workers: int) -> range:
        """The rank steps DataLoader worker ``worker`` of ``num_workers`` reads (``j mod K``)."""
        return range(worker, self.steps_per_rank, num_workers)

    def of_rank(self, rank: int) -> BatchSlots:
        """The same pass as read by another rank of the same partition."""
        return dataclasses.replace(self, rank=int(rank))

    @property
    def slots(self) -> np.ndarray:
        return self.steps(np.arange(self.steps_per_rank, dtype=np.int64))[0]

    @property
    def seeds(self) -> np.ndarray:
        return self.steps(np.arange(self.steps_per_rank, dtype=np.int64))[1]


def common_steps(counts: Sequence[int], start: int, world_size: int, uneven: str) -> int:
    """Steps every rank takes when each partition of ``world_size`` ranks holds ``counts[n]``
    batches and ``start`` of them are consumed: the longest partition's under ``pad`` (the
    others repeat batches), the shortest's under ``drop`` (the others leave batches out)."""
    _check_policy(uneven)
    longest = max(counts, default=0)
    if not 0 <= start < longest + world_size:  # past the end only by the padding
        raise UsageError(
            f"resume position {start} is outside the epoch's {longest} batches "
            f"(at world size {world_size})"
        )
    if uneven == "pad":
        return -(-max(longest - start, 0) // world_size)
    return max(min(counts) - start, 0) // world_size


def rank_slots(
    num_batches: int,
    start: int,
    rank: int,
    world_size: int,
    uneven: str,
    *,
    steps: int | None = None,
    node: int = 0,
    nodes: int = 1,
) -> BatchSlots:
    """Assign batches ``start..num_batches-1`` to ``rank`` of ``world_size``.

    Slot ``q`` (counted from the epoch's start) holds batch ``q``; slots past the end, which even
    out the ranks under ``pad``, repeat the epoch's batches from its beginning: ``q mod M``.
    Padding therefore depends only on the slot, so a run resumed at ``start`` sees exactly the
    batches an uninterrupted run would.  A ``start`` past the last batch leaves nothing to do.
    ``steps`` (:func:`common_steps` over every partition, for partition ``node`` of ``nodes``)
    replaces the steps this partition's batches alone would give.
    """
    if steps is None:
        steps = common_steps([num_batches], start, world_size, uneven)
    remaining = max(num_batches - start, 0)
    total = steps * world_size
    return BatchSlots(
        start=int(start),
        rank=int(rank),
        world_size=int(world_size),
        num_batches=int(num_batches),
        padded_batches=max(total - remaining, 0),
        dropped_batches=max(remaining - total, 0),
        steps_per_rank=int(steps),
        node=int(node),
        nodes=int(nodes),
    )
