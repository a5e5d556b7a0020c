"""The one place that looks at the process's surroundings: distributed rank and DataLoader worker.

Everything else receives a :class:`~shardloader.split.Place` as a value, so splitting stays a
pure, testable function.
"""

from __future__ import annotations

import os

from shardloader.errors import UsageError
from shardloader.split import Place

__all__ = ["detect_world", "detect_place", "node_ranks"]


def detect_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, then torch.distributed, then RANK/WORLD_SIZE."""
    if (rank is None) != (world_size is None):
        raise UsageError("pass both rank and world_size, or neither")
    if rank is not None and world_size is not None:
        return rank, world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if env_rank is not None and env_world is not None:
        try:
            return int(env_rank), int(env_world)
        except ValueError as err:
            raise UsageError(
                f"RANK={env_rank!r} / WORLD_SIZE={env_world!r} are not integers"
            ) from err
    return 0, 1


def detect_place(rank: int, world_size: int) -> Place:
    """Add the DataLoader worker (``get_worker_info``) to an already known rank/world."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    if info is None:
        return Place(rank, world_size, 0, 1)
    return Place(rank, world_size, info.id, info.num_workers)


def node_ranks(rank: int, world_size: int) -> list[int]:
    """The ranks on this node (this one included), for node-wide read-ahead.

    From torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (ranks ``rank - LOCAL_RANK`` up to
    ``LOCAL_WORLD_SIZE`` of them); just ``[rank]`` when they are unset or do not fit the world.
    A wrong answer only changes which shards are staged ahead, never what is read.
    """
    try:
        local = int(os.environ["LOCAL_RANK"])
        count = int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return [rank]
    first = rank - local
    if not (0 <= local < count and first >= 0 and first + count <= world_size):
        return [rank]
    return list(range(first, first + count))
