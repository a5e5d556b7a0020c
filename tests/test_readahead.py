"""Node-wide read-ahead (read/readahead.py): one schedule of the shards this node needs, in plan
order, shared by its workers and local ranks."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import batch_ids, write_dataset

import shardloader as sl
from shardloader.plan.dataparallel import ReplicaPlace, replica_place
from shardloader.read.readahead import ReadAhead, node_schedule


def test_schedule_lists_each_shard_at_its_first_need_steps_then_ranks() -> None:
    # rank A reads shards 3, 3 | 1 at steps 0, 0 | 1; rank B reads 2 | 3, 0 at steps 0 | 1, 1
    schedule = node_schedule(
        [np.array([3, 3, 1]), np.array([2, 3, 0])],
        [np.array([0, 0, 1]), np.array([0, 1, 1])],
    )
    assert schedule == [(0, 3), (0, 2), (1, 1), (1, 0)]
    assert node_schedule([], []) == []
    assert node_schedule([np.zeros(0, np.int64)], [np.zeros(0, np.int64)]) == []


class _Shards:
    """What ReadAhead asks of a ShardSet: prefetch, and whether shards are still staging."""

    def __init__(self) -> None:
        self.in_place = False
        self.options = SimpleNamespace(readahead=1)
        self.asked: list[list[int]] = []
        self.busy: set[int] = set()

    def prefetch(self, shards: Any) -> None:
        self.asked.append(list(shards))

    def staging(self, shards: Any) -> bool:
        return any(s in self.busy for s in shards)


def test_shards_due_now_go_first_and_alone() -> None:
    shards = _Shards()
    ahead = ReadAhead(shards, [(0, 10), (0, 11), (1, 12), (2, 13), (3, 14)], depth=2)  # type: ignore[arg-type]
    shards.busy = {10}
    ahead.advance(0)
    assert shards.asked == [[10, 11]]  # what step 0 needs; read-ahead waits for it
    shards.busy = set()
    ahead.advance(0)
    assert shards.asked[-1] == [12, 13]  # now two more
    ahead.advance(1)
    assert shards.asked[-1] == [14]  # step 1's shard was ahead already; the window moves on
    ahead.advance(9)
    assert sum(len(a) for a in shards.asked) == 5  # each shard asked for once


def _read_and_staged(data: str, cache: str, world: Any) -> tuple[set[int], set[int]]:
    """One pass over ``data`` (8 shards of 4 samples, batches of 4: a batch is a shard) as
    ``world``: the shards it read, and the shards staged in its cache."""
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=cache), readahead=2)
    ds = sl.ShardedDataset(data, batch_size=4, decoder=None, read=read, world=world)
    ids = [i for batch in ds for i in batch_ids(batch)]
    assert sorted(ids) == sorted(set(ids)) and len(ids) % 4 == 0
    staged = {int(p.name[6:11]) for p in Path(cache).rglob("shard-*.tar.zst.raw")}
    return {i // 4 for i in ids}, staged


def _no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """No variable of torchrun, Slurm or Open MPI: the node layout is only what World says."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(name)


def test_a_rank_stages_what_its_node_neighbour_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of 2 on one node (torchrun's variables): batches are whole shards, so rank 0
    reads the even shards only; its read-ahead stages the odd ones for rank 1 too.  Without
    the variables it stages only its own."""
    data = str(tmp_path / "ds")
    write_dataset(data, [4] * 8, compression="zstd")
    _no_launcher(monkeypatch)
    read, staged = _read_and_staged(data, str(tmp_path / "alone"), sl.World(0, 2))
    assert read == staged == {0, 2, 4, 6}
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    read, staged = _read_and_staged(data, str(tmp_path / "node"), sl.World(0, 2))
    assert read == {0, 2, 4, 6}
    assert read <= staged and staged & {1, 3, 5}  # the neighbour's, ahead of it


def _replicas_on_two_nodes(group: Any, ranks_per_node: int | None = None) -> ReplicaPlace:
    """world.detect_data_parallel without torch: global rank 2 of a (dp 4, tp 2) mesh of 8
    ranks, 4 a node (the launcher's layout), so replica 1 of 4, 2 replicas a node."""
    mesh = np.arange(8).reshape(4, 2)
    return replica_place(mesh, (0,), 2, 4, ranks_per_node)


@pytest.mark.parametrize("data_parallel", [False, True])
def test_readahead_follows_the_node_layout_the_world_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, data_parallel: bool
) -> None:
    """No launcher variables, one partition (partition="global": every rank's batches come
    from the one global order), 4 ranks, 2 a node as ``World`` resolved them: given as
    ``ranks_per_node``, or found from a data-parallel mesh (replica ranks, not the global
    rank).  Rank r reads shards r and r + 4; its read-ahead stages what its node's two ranks
    read, and nothing of the other node's."""
    data = str(tmp_path / "ds")
    write_dataset(data, [4] * 8, compression="zstd")
    _no_launcher(monkeypatch)
    if data_parallel:
        monkeypatch.setattr("shardloader.world.detect_data_parallel", _replicas_on_two_nodes)
        world = sl.World.of(object(), partition="global")
        rank, node = 1, {0, 1, 4, 5}
    else:
        world = sl.World(3, 4, ranks_per_node=2, partition="global")
        rank, node = 3, {2, 3, 6, 7}
    read, staged = _read_and_staged(data, str(tmp_path / "cache"), world)
    assert read == {rank, rank + 4}
    assert read <= staged <= node and staged - read  # its node neighbour's, ahead of it
