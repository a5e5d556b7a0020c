"""The one place that looks at the process's surroundings: distributed rank, data-parallel group,
node layout and DataLoader worker.

Everything else receives a :class:`~shardloader.plan.split.Place` as a value, so splitting stays a
pure, testable function.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from shardloader.errors import UsageError
from shardloader.plan.dataparallel import ReplicaPlace, data_parallel_dims, replica_place
from shardloader.plan.split import Place

if TYPE_CHECKING:
    from shardloader.options import World

__all__ = [
    "resolve_world",
    "detect_data_parallel",
    "detect_place",
    "detect_ranks_per_node",
]


def detect_ranks_per_node(rank: int, world_size: int, explicit: int | None = None) -> int | None:
    """Ranks on each node, for node-local partitions (NOTE [node partitions] in
    :mod:`shardloader.plan.partition`), or None when unknown.

    ``explicit`` wins (it must divide ``world_size``).  Else torchrun's ``LOCAL_WORLD_SIZE``,
    when the environment describes this very rank (``RANK`` / ``WORLD_SIZE`` equal to
    ``rank`` / ``world_size``, ``LOCAL_RANK == rank mod LOCAL_WORLD_SIZE`` and, when set,
    ``GROUP_RANK == rank // LOCAL_WORLD_SIZE``: ranks numbered node by node, as torchrun
    numbers them); else Slurm's ``SLURM_NTASKS_PER_NODE`` with ``SLURM_LOCALID`` /
    ``SLURM_NODEID``, or Open MPI's ``OMPI_COMM_WORLD_LOCAL_SIZE`` / ``_LOCAL_RANK`` /
    ``_NODE_RANK``, under the same checks.  Anything else (a simulated rank, uneven nodes, a
    launcher that numbers ranks otherwise) is None: the dataset then keeps one partition
    (:func:`~shardloader.plan.partition.choose_partition` says why).
    """
    if explicit is not None:
        if isinstance(explicit, bool) or not isinstance(explicit, int) or explicit < 1:
            raise UsageError(f"ranks_per_node must be an integer >= 1, got {explicit!r}")
        if world_size % explicit:
            raise UsageError(
                f"ranks_per_node={explicit} does not divide world_size={world_size}: every "
                "node must run the same number of ranks"
            )
        return explicit
    env = os.environ
    for size_var, local_var, node_var, rank_var, world_var in (
        ("LOCAL_WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "RANK", "WORLD_SIZE"),
        ("SLURM_NTASKS_PER_NODE", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_PROCID", "SLURM_NTASKS"),
        (
            "OMPI_COMM_WORLD_LOCAL_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_NODE_RANK",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
        ),
    ):
        try:
            per_node, local = int(env[size_var]), int(env[local_var])
            if int(env[rank_var]) != rank or int(env[world_var]) != world_size:
                continue
        except (KeyError, ValueError):  # unset, or Slurm's "8(x2),4" for uneven nodes
            continue
        if per_node < 1 or world_size % per_node or local != rank % per_node:
            continue
        if node_var in env and env[node_var] != str(rank // per_node):
            continue
        return per_node
    return None


def detect_data_parallel(group: Any, ranks_per_node: int | None = None) -> ReplicaPlace:
    """This rank's data-parallel rank, the number of replicas and replicas per node (NOTE
    [data-parallel place] in :mod:`shardloader.plan.dataparallel`).

    ``group``: a ``torch.distributed.device_mesh.DeviceMesh`` (its data-parallel dimensions,
    or a 1-D mesh such as ``mesh["dp"]``) or a ``ProcessGroup`` (Megatron's data-parallel
    group).  ``ranks_per_node``: replicas a node holds, when the launcher's layout does not
    tell (:func:`detect_ranks_per_node` of the global rank is used otherwise).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "World.of(group) needs torch.distributed initialized first (init_process_group "
            "or init_device_mesh)"
        )
    from torch.distributed.device_mesh import DeviceMesh

    me = dist.get_rank()
    if isinstance(group, DeviceMesh):
        dims = data_parallel_dims(group.mesh_dim_names, group.ndim)
        ranks = group.mesh.cpu().numpy()
    elif isinstance(group, dist.ProcessGroup):
        size = dist.get_world_size(group)
        if size < 1:
            raise UsageError(f"global rank {me} is not in the World.of() process group")
        ranks, dims = np.array([dist.get_global_rank(group, i) for i in range(size)]), (0,)
    else:
        raise UsageError(
            "World.of() takes a torch.distributed DeviceMesh (or its data-parallel "
            f"dimension, e.g. mesh['dp']) or a ProcessGroup, got {type(group).__name__}"
        )
    per_node = detect_ranks_per_node(me, dist.get_world_size())
    return replica_place(ranks, dims, me, per_node, ranks_per_node)


def resolve_world(world: World) -> tuple[int, int, int | None]:
    """(rank, world size, ranks per node) of a :class:`~shardloader.options.World`: from its
    data-parallel group, else its rank and world size (both given or neither: :class:`World`
    checks), else torch.distributed's, else ``RANK`` / ``WORLD_SIZE``, else rank 0 of 1."""
    if world.group is not None:
        place = detect_data_parallel(world.group, world.ranks_per_node)
        return place.rank, place.world_size, place.ranks_per_node
    r, w = world.rank, world.world_size
    if r is None or w is None:
        import torch.distributed as dist

        env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        elif env_rank is not None and env_world is not None:
            try:
                r, w = int(env_rank), int(env_world)
            except ValueError as err:
                raise UsageError(
                    f"RANK={env_rank!r} / WORLD_SIZE={env_world!r} are not integers"
                ) from err
        else:
            r, w = 0, 1
    Place(r, w)  # validate
    return r, w, detect_ranks_per_node(r, w, world.ranks_per_node)


def detect_place(rank: int, world_size: int) -> Place:
    """Add the DataLoader worker (``get_worker_info``) to an already known rank/world."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return Place(rank, world_size, 0, 1)
    return Place(rank, world_size, info.id, info.num_workers)
