"""Who reads what: pure functions of (order, batches, start, rank, world, worker).

NOTE [rank and worker split]: global batch ``i`` of the epoch belongs to rank ``i mod W``;
on a rank, its ``j``-th batch belongs to DataLoader worker ``j mod K``.  torch's DataLoader
collects worker outputs round-robin in submission order, so the batches a rank sees, and their
order, do not depend on K.  Every rank gets the same number of batches: the remaining batch
list is padded (batches repeated from the start of the remainder) or dropped to a multiple of W,
and the report says how many.  Nothing here reads torch, the environment or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shardloader.errors import UsageError

__all__ = ["UNEVEN_POLICIES", "Place", "BatchSlots", "cut_fixed_batches", "rank_slots"]

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


def cut_fixed_batches(
    order: np.ndarray, batch_size: int, uneven: str
) -> tuple[list[np.ndarray], int, int]:
    """Cut the epoch order into full batches; return (batches, padded samples, dropped samples).

    A partial last batch is never emitted (it would make a 1-sample BatchNorm batch possible):
    ``pad`` fills it with samples from the start of the order, ``drop`` drops it.
    """
    _check_policy(uneven)
    if batch_size < 1:
        raise UsageError(f"batch_size must be >= 1, got {batch_size}")
    n = len(order)
    tail = n % batch_size
    padded = dropped = 0
    if tail and uneven == "pad" and n:
        fill = batch_size - tail
        order = np.concatenate([order, np.resize(order, fill)])
        padded = fill
    elif tail:
        order = order[: n - tail]
        dropped = tail
    return list(order.reshape(-1, batch_size)) if len(order) else [], padded, dropped


@dataclass(frozen=True)
class BatchSlots:
    """A rank's share of the remaining batches of an epoch.

    ``slots[j]`` is the index of the global batch that is this rank's ``j``-th step (indices
    repeat for padding).  ``seeds[j]`` is a distinct per-step number used to seed augmentation.
    """

    slots: np.ndarray
    seeds: np.ndarray
    padded_batches: int
    dropped_batches: int
    steps_per_rank: int


def rank_slots(num_batches: int, start: int, rank: int, world_size: int, uneven: str) -> BatchSlots:
    """Assign global batches ``start..num_batches-1`` to ``rank`` of ``world_size``.

    Slot ``q`` (counted from the epoch's start) holds batch ``q``; slots past the end, which even
    out the ranks under ``pad``, repeat the epoch's batches from its beginning: ``q - M mod M``.
    Padding therefore depends only on the slot, so a run resumed at ``start`` sees exactly the
    batches an uninterrupted run would.  A ``start`` past the last batch leaves nothing to do.
    """
    _check_policy(uneven)
    if not 0 <= start < num_batches + world_size:  # past the end only by the padding
        raise UsageError(
            f"resume position {start} is outside the epoch's {num_batches} batches "
            f"(at world size {world_size})"
        )
    remaining = max(num_batches - start, 0)
    steps = -(-remaining // world_size) if uneven == "pad" else remaining // world_size
    total = steps * world_size
    slots = start + np.arange(steps, dtype=np.int64) * world_size + rank
    past = slots >= num_batches
    batches = slots.copy()
    if num_batches:
        batches[past] = (slots[past] - num_batches) % num_batches
    return BatchSlots(
        slots=batches,
        seeds=slots,
        padded_batches=max(total - remaining, 0),
        dropped_batches=max(remaining - total, 0),
        steps_per_rank=steps,
    )
