"""The pass a stream reads, as pure planning over the dataset, and the rule for when streams
must take turns (NOTE [serial pipeline]).

Every replica plans the same pass from the same request (NOTE [what a stream is] in
:mod:`shardloader.service.stream`), so these are plain functions of the dataset and the
request's numbers; the server uses them to answer ``/v1/info``, to warm up, and to start each
stream's pipeline.
"""

from __future__ import annotations

import threading

from shardloader.dataset import ShardedDataset
from shardloader.deliver.loader import make_loader

__all__ = [
    "SERIAL_PIPELINE",
    "pass_dataset",
    "steps_of_pass",
    "warm_up",
]

# NOTE [serial pipeline]: ShardedDataset seeds torch's, numpy's and random's *global* generators
# from (seed, epoch, global batch) before each batch, for transforms that draw from them
# (DESIGN.md, "Order and split" 6).  With --workers 0 every stream's pipeline runs in a producer
# thread of this one process: a stream that reseeds between another stream's seeding and its
# draws changes that stream's batch, which then differs from a local loader's.  Such pipelines
# take one batch at a time (seed, load, transform, collate under this lock; the loader's first
# step, which draws its base seed from torch's global generator, included).  Pipelines whose
# code draws nothing from the global generators (read.loading.pipeline_draws) run streams in
# parallel; with workers > 0 each stream's pipeline runs in its own worker processes, and
# nothing is shared.  tests/test_service_serial.py runs concurrent streams both ways.
SERIAL_PIPELINE = threading.Lock()


def pass_dataset(
    dataset: ShardedDataset,
    epoch: int,
    position: int,
    rank: int,
    world_size: int,
    skip: int = 0,
    ranks_per_node: int | None = None,
) -> ShardedDataset:
    """A copy of ``dataset`` reading rank ``rank``'s steps ``skip..`` of the pass from ``position``.

    Batch for batch what a local loader at (epoch, position) yields from its ``skip``-th step,
    padding repeats included: rank ``r``'s step ``j`` of that pass follows ``position + j *
    world_size`` global batches, and padding depends only on the slot; ``ranks_per_node`` (as
    the client detected them) gives the same partitions as the client's local loader.
    """
    view = dataset.for_rank(rank, world_size, ranks_per_node)
    view.seek(epoch, position + skip * world_size)
    return view


def warm_up(dataset: ShardedDataset) -> None:
    """Read one batch here, before any stream forks workers.

    Lazy imports of the read path (arrow, codecs, image libraries) then happen once in this
    process instead of in every worker of every stream, the first shards are staged, and a
    broken pipeline fails at start, not in a client's epoch.
    """
    view = pass_dataset(dataset, 0, 0, 0, 1)
    if len(view) == 0:
        return
    batches = iter(make_loader(view, num_workers=0))
    try:  # no lock: no stream runs yet
        next(batches)
    finally:
        batches.close()  # type: ignore[attr-defined]


def steps_of_pass(
    dataset: ShardedDataset,
    epoch: int,
    position: int,
    world_size: int,
    ranks_per_node: int | None = None,
) -> int:
    """Steps per rank of the pass of ``epoch`` that begins after ``position`` global batches."""
    return len(pass_dataset(dataset, epoch, position, 0, world_size, 0, ranks_per_node))
