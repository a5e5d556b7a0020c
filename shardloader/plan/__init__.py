"""Planning: pure functions of (manifest, seed, epoch, place), no I/O, no torch.

What every rank and worker computes alike without talking (DESIGN.md "Order and split"):

* :mod:`~shardloader.plan.shuffle`: shuffle options and every seed, derived from ``seed``;
* :mod:`~shardloader.plan.order`: the epoch's order, lazily, a span of it per partition;
* :mod:`~shardloader.plan.partition`: which share of the epoch a node's ranks read;
* :mod:`~shardloader.plan.lists`: each partition's order and batches;
* :mod:`~shardloader.plan.split`: a rank's slots and a worker's steps of them;
* :mod:`~shardloader.plan.steps`: a worker's steps worked out as it walks them;
* :mod:`~shardloader.plan.epoch`: the epoch plan, its report;
* :mod:`~shardloader.plan.elastic`: resuming with another batch shape or partitions;
* :mod:`~shardloader.plan.blend`: a mixture's sources interleaved by weight;
* :mod:`~shardloader.plan.ledger`: which samples an epoch pads, drops or truncates, and why;
* :mod:`~shardloader.plan.cost`: what an epoch costs a cluster and how well it mixes.

Where the process sits (rank, world, node, worker) is detected at the edge, in
:mod:`shardloader.world`, and handed in as values.  Batch planners live in
:mod:`shardloader.batching`.
"""

from shardloader._lazy import on_demand

__all__: list[str] = []  # its modules are the API: import them

__getattr__ = on_demand(__name__, globals())
