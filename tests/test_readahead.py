"""Node-wide read-ahead (read/readahead.py): one schedule of the shards this node needs, in plan
order, shared by its workers and local ranks."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from helpers import batch_ids, write_dataset

import shardloader as sl
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


def test_a_rank_stages_what_its_node_neighbour_needs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 of 2 on one node (torchrun's variables): batches are whole shards, so rank 0
    reads the even shards only; its read-ahead stages the odd ones for rank 1 too.  Without
    the variables it stages only its own."""
    write_dataset(str(tmp_path / "ds"), [4] * 8, compression="zstd")

    def staged_after_rank0(cache: str) -> set[int]:
        read = sl.ReadOptions(cache=sl.CacheOptions(dir=cache), readahead=2)
        ds = sl.ShardedDataset(
            str(tmp_path / "ds"), batch_size=4, decoder=None, read=read, world=sl.World(0, 2)
        )
        ids = [i for batch in ds for i in batch_ids(batch)]
        assert sorted(ids) == [i for s in (0, 2, 4, 6) for i in range(4 * s, 4 * s + 4)]
        return {int(p.name[6:11]) for p in Path(cache).rglob("shard-*.tar.zst.raw")}

    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    for name in torchrun:
        monkeypatch.delenv(name, raising=False)
    assert staged_after_rank0(str(tmp_path / "alone")) == {0, 2, 4, 6}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    staged = staged_after_rank0(str(tmp_path / "node"))
    assert {0, 2, 4, 6} <= staged and staged & {1, 3, 5}  # the neighbour's, ahead of it
