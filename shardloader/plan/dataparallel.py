"""Where a rank stands among a job's data-parallel replicas (pure arithmetic on rank numbers).

NOTE [data-parallel place]
    Jobs that train large models split each model replica over several ranks (tensor,
    pipeline, context or expert parallel) and split the data only over the replicas: every
    rank of one replica must read the same batches, byte for byte.  The dataset's "rank" and
    "world" are then the replica's data-parallel rank and the number of replicas
    (torchtitan's ``dp_rank`` / ``dp_degree``, Megatron's data-parallel rank and size), and
    nothing else changes: the plan, the split and the state never see the other dimensions.
    ``world.detect_data_parallel`` reads a ``DeviceMesh`` (its data-parallel dimensions:
    :data:`DATA_PARALLEL_DIMS`) or a process group; this module does the arithmetic.

    Node partitions (NOTE [node partitions] in :mod:`shardloader.plan.partition`) are counted in
    data-parallel ranks: a partition is the replicas whose ranks sit on one node (8 GPUs a
    node, tensor parallel 2 inside it: 4 replicas a node).  From the global ranks of each
    data-parallel group and the launcher's ranks per node (global rank ``g`` on node
    ``g // R``, as torchrun numbers them) :func:`replicas_per_node` finds, for each group, the
    data-parallel ranks each node holds; they must be consecutive and as many on every node,
    and every group of a mesh must agree, else the layout is unknown and the dataset keeps one
    partition (as :func:`~shardloader.plan.partition.choose_partition` does for an unknown layout).
    Every rank of a replica must reach the same answer without talking: from a mesh every rank
    sees every group, so they do; from a process group a rank sees only its own, which is
    enough for the layouts launchers build (ranks numbered node by node, the replica's other
    dimensions inside or outside the data-parallel one, as Megatron and ``init_device_mesh``
    lay them out).  A replica spread over several nodes (pipeline stages on other nodes) is
    fine: each of its nodes reads the replica's partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardloader.errors import UsageError

__all__ = [
    "DATA_PARALLEL_DIMS",
    "ReplicaPlace",
    "data_parallel_dims",
    "replica_place",
    "replicas_per_node",
]

# mesh dimensions that split the data (torchtitan's dp_replicate x dp_shard, their flattened
# "dp" or "batch"; Lightning's and torch's "dp", "ddp", "fsdp", "hsdp", "replicate", "shard")
DATA_PARALLEL_DIMS = (
    "dp",
    "dp_replicate",
    "dp_shard",
    "batch",
    "data_parallel",
    "ddp",
    "fsdp",
    "hsdp",
    "replicate",
    "shard",
)
# dimensions whose ranks need the same batches: a 1-D mesh named so is a mistake, not the data's
# (torchtitan's dp_shard_cp and dp_cp hold context-parallel ranks, which share their batch)
_MODEL_PARALLEL_DIMS = ("tp", "pp", "cp", "ep", "etp", "sp", "dp_shard_cp", "dp_cp")


@dataclass(frozen=True)
class ReplicaPlace:
    """A rank's data-parallel rank, the number of replicas, and replicas per node (None:
    unknown, one partition)."""

    rank: int
    world_size: int
    ranks_per_node: int | None


def data_parallel_dims(names: Sequence[str] | None, ndim: int) -> tuple[int, ...]:
    """The dimensions of a mesh with these dimension names that split the data.

    Those named in :data:`DATA_PARALLEL_DIMS`; a 1-D mesh (``mesh["dp"]``, or one without
    names) is data parallel unless it is named like a model-parallel dimension.  A mesh
    without one is a UsageError that names its dimensions.
    """
    listed = tuple(names) if names else ()
    found = tuple(i for i, n in enumerate(listed) if n in DATA_PARALLEL_DIMS)
    if found:
        return found
    if ndim == 1 and (not listed or listed[0] not in _MODEL_PARALLEL_DIMS):
        return (0,)
    shown = listed if listed else f"{ndim} unnamed dimension(s)"
    raise UsageError(
        f"the DeviceMesh passed as data_parallel= has dimensions {shown}, none of them data "
        f"parallel (named one of {DATA_PARALLEL_DIMS}): its ranks would all read the same "
        "batches. Pass the data-parallel dimension (e.g. mesh['dp']), a mesh that has one, or "
        "the data-parallel process group"
    )


def replica_place(
    mesh: np.ndarray,
    dims: Sequence[int],
    me: int,
    ranks_per_node: int | None,
    explicit_per_node: int | None = None,
) -> ReplicaPlace:
    """Global rank ``me``'s place among the replicas of ``mesh`` (global ranks, any shape)
    split along ``dims`` (data parallel, row-major: the first is the outer one).

    ``ranks_per_node``: the launcher's global ranks per node, or None (unknown).
    ``explicit_per_node``: replicas per node given by the user; wins.
    """
    grid = np.atleast_1d(np.asarray(mesh, dtype=np.int64))
    inner = [d for d in range(grid.ndim) if d not in dims]
    size = int(np.prod([grid.shape[d] for d in dims]))
    groups = np.transpose(grid, (*inner, *dims)).reshape(-1, size)  # a row per replica group
    found = np.argwhere(groups == me)
    if len(found) != 1:
        raise UsageError(
            f"global rank {me} is {'not' if not len(found) else 'more than once'} in the "
            f"data-parallel mesh {grid.tolist()}: pass this rank's mesh or group"
        )
    rank = int(found[0][1])
    if explicit_per_node is not None:
        if isinstance(explicit_per_node, bool) or explicit_per_node < 1 or size % explicit_per_node:
            raise UsageError(
                f"ranks_per_node={explicit_per_node!r} must be a positive divisor of the "
                f"{size} data-parallel ranks (with data_parallel= it counts replicas a node)"
            )
        return ReplicaPlace(rank, size, explicit_per_node)
    if ranks_per_node is None:
        return ReplicaPlace(rank, size, None)
    counts = {replicas_per_node(g, ranks_per_node) for g in groups.tolist()}
    return ReplicaPlace(rank, size, counts.pop() if len(counts) == 1 else None)


def replicas_per_node(group: Sequence[int], ranks_per_node: int) -> int | None:
    """Data-parallel ranks a node holds, for a data-parallel group of these global ranks (in
    data-parallel rank order) on nodes of ``ranks_per_node`` consecutive global ranks: the
    count when each node holds the same number of consecutive data-parallel ranks, else None.
    """
    nodes = np.asarray(group, dtype=np.int64) // int(ranks_per_node)
    if nodes.size == 0:
        return None
    starts = np.flatnonzero(np.diff(nodes, prepend=nodes[0] - 1))
    runs = np.diff(np.append(starts, nodes.size))
    if len(set(nodes[starts].tolist())) != len(starts) or len(set(runs.tolist())) != 1:
        return None  # a node's replicas not consecutive, or nodes holding different numbers
    return int(runs[0])
