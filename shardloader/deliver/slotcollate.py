"""Batches of fixed-shape uint8 fields (images) handed from DataLoader workers through the
loader's shared slots.

Collated the usual way, a batch's image tensor is stacked into a fresh shared-memory segment
(torch's ``default_collate`` inside a worker): created, faulted in page by page, its file
descriptor sent, mapped again by the training process and unmapped when the batch is freed.
For 64 images of 3 x 224 x 224 that is ~0.14 ms of CPU an image (measured: against ~0.01 ms
for the same stack into memory already mapped), as much as a tenth of the whole train
transform.  Here a worker stacks the images straight into a free slot of the loader's
:class:`~shardloader.deliver.transport.Ring` (mapped once by both processes, NOTE [ring slots]
there) and sends only (ring, worker, slot); the training process rebuilds the batch with the
image tensor as a view of the slot, which goes back to the worker once no tensor refers to it.

A :class:`~shardloader.deliver.loader.ShardLoader` sets this up (:func:`image_ring`) only for a
dataset with the default collate and a transform that declares the one shape of its output
field, ``fixed_output() -> (field, shape) | None`` (:func:`fixed_output`; the vision pipelines'
``ApplyTo`` does, NOTE [output shapes] in :mod:`shardloader.vision.transforms`), e.g.
``train_transform(224)``.  This module knows nothing of vision: any transform may declare it.  A
batch that does not fit (other shapes or dtypes, a short last batch is fine) or finds no free
slot (the loop holds its batches) is collated the usual way: the same batch either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from shardloader.deliver.transport import _RINGS, Ring, slot_view

__all__ = ["MAX_RING_BYTES", "SlotCollate", "fixed_output", "image_ring"]

MAX_RING_BYTES = 2 << 30  # a larger ring (huge batches) is not worth its memory: no slots


def fixed_output(transform: Any) -> tuple[str, tuple[int, ...]] | None:
    """(field, uint8 shape) that every sample's ``field`` has after ``transform``, when the
    transform declares it through a ``fixed_output()`` method, else None."""
    declared = getattr(transform, "fixed_output", None)
    return declared() if callable(declared) else None


def image_ring(dataset: Any, workers: int, prefetch_factor: int) -> Ring | None:
    """The ring a ShardLoader's ``workers`` stack ``dataset``'s image batches into, or None
    where that does not apply (a planner, a collate of the user's, no fixed image shape)."""
    if dataset.planner is not None or dataset.collate_fn is not None or not dataset.batch_size:
        return None
    out = fixed_output(dataset.transform)
    if out is None:
        return None
    slot_bytes = dataset.batch_size * math.prod(out[1])
    slots = prefetch_factor + 3  # in flight, held by the loop, one spare (as token rings)
    if workers * slots * slot_bytes > MAX_RING_BYTES:
        return None
    return Ring(workers, slots, slot_bytes)


class SlotCollate:
    """A worker's collate that stacks the ``field`` images into a free slot of ``ring`` and
    collates the other fields with ``inner``; any batch it cannot place goes to ``inner``
    whole."""

    def __init__(self, inner: Callable[[Any], Any], ring: Ring, field: str) -> None:
        self.inner, self.ring, self.field = inner, ring, field
        self.worker: int | None = None

    def __call__(self, samples: Sequence[Any]) -> Any:
        images = _images(samples, self.field)
        if images is None:
            return self.inner(samples)
        if self.worker is None:
            info = torch.utils.data.get_worker_info()
            self.worker = info.id if info is not None else -1
        field = self.field
        # the other fields first: a slot is taken only once nothing can fail any more
        rest = self.inner([{k: v for k, v in s.items() if k != field} for s in samples])
        shape = (len(images), *images[0].shape)
        taken = self.ring.take(self.worker, math.prod(shape))
        if taken is None:  # the loop still holds every slot's batch: the usual way (NOTE
            return Crossing(_collected, self.ring.id, self.inner(samples))  # [collected])
        slot, raw = taken
        torch.stack(images, out=torch.from_numpy(raw).view(shape))
        keys = list(samples[0])
        return Crossing(_arrived, self.ring.id, self.worker, slot, shape, field, keys, rest)


def _images(samples: Sequence[Any], field: str) -> list[torch.Tensor] | None:
    """The ``field`` of every sample when all are uint8 tensors of one shape and the samples
    dicts of the same keys (what the default collate stacks as it is), else None."""
    if not samples or not all(isinstance(s, Mapping) for s in samples):
        return None
    first, keys = samples[0].get(field), samples[0].keys()
    out = []
    for s in samples:  # the first sample is checked like the others (shape: against itself)
        x = s.get(field)
        if not isinstance(x, torch.Tensor) or x.dtype != torch.uint8 or x.shape != first.shape:
            return None
        if s.keys() != keys:
            return None
        out.append(x)
    return out


class Crossing:
    """A worker's batch that pickles to ``rebuild`` and its ``args``: unpickling in the
    training process calls ``rebuild(*args)``, which gives the batch dict."""

    def __init__(self, rebuild: Callable[..., Any], *args: Any) -> None:
        self.rebuild, self.args = rebuild, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.rebuild, self.args


def _collected(ring_id: str, batch: Any) -> Any:
    """NOTE [collected]: a batch collated the usual way for want of a free slot hands back, on
    arrival, the slots whose batches are gone (otherwise only a batch arriving in a slot does,
    and a loop that once held every slot would never get one back)."""
    ring = _RINGS.get(ring_id)
    if ring is not None:
        ring.collect()
    return batch


def _arrived(
    ring_id: str,
    worker: int,
    slot: int,
    shape: tuple[int, ...],
    field: str,
    keys: list[str],
    rest: dict[str, Any],
) -> dict[str, Any]:
    """A batch whose ``field`` was stacked into a ring slot: the slot's images and the rest."""
    images = slot_view(ring_id, worker, slot, math.prod(shape)).view(shape)
    return {k: images if k == field else rest[k] for k in keys}
