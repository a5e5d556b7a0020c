"""world.py reads the job's layout from the launcher's variables, and only when they describe
this very rank; anything doubtful is "unknown" (one partition)."""

from __future__ import annotations

import pytest
from helpers import write_dataset

import shardloader as sl
from shardloader.world import detect_ranks_per_node

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
LAUNCHER_VARS = (
    *TORCHRUN,
    "GROUP_RANK",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_NODE_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
)


@pytest.fixture
def env(monkeypatch):
    for name in LAUNCHER_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def put(env, values):
    for k, v in values.items():
        env.setenv(k, v)


def test_torchrun_variables_give_the_ranks_per_node(env):
    put(env, {**TORCHRUN, "GROUP_RANK": "1"})
    assert detect_ranks_per_node(5, 8) == 4


@pytest.mark.parametrize(
    "change",
    [
        {"RANK": "4"},  # another rank's variables (a simulated world in a torchrun process)
        {"WORLD_SIZE": "16"},
        {"LOCAL_RANK": "2"},  # ranks not numbered node by node
        {"GROUP_RANK": "0"},
        {"LOCAL_WORLD_SIZE": "3"},  # does not divide the world: uneven nodes
    ],
)
def test_variables_that_do_not_describe_this_rank_are_unknown(env, change):
    put(env, {**TORCHRUN, **change})
    assert detect_ranks_per_node(5, 8) is None


def test_slurm_and_open_mpi(env):
    put(env, {"SLURM_NTASKS_PER_NODE": "4", "SLURM_LOCALID": "1", "SLURM_NODEID": "1"})
    put(env, {"SLURM_PROCID": "5", "SLURM_NTASKS": "8"})
    assert detect_ranks_per_node(5, 8) == 4
    env.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")  # Slurm's form for several nodes: unparsed
    assert detect_ranks_per_node(5, 8) is None
    put(env, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    put(env, {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8"})
    assert detect_ranks_per_node(5, 8) == 2


def test_explicit_ranks_per_node_win_and_are_checked(env):
    put(env, TORCHRUN)
    assert detect_ranks_per_node(5, 8, 2) == 2
    with pytest.raises(sl.UsageError, match="does not divide world_size=8"):
        detect_ranks_per_node(5, 8, 3)
    with pytest.raises(sl.UsageError, match="ranks_per_node must be an integer"):
        detect_ranks_per_node(5, 8, 0)


def test_the_dataset_partitions_by_what_it_detects(env, tmp_path):
    write_dataset(str(tmp_path), [20, 20, 20])
    put(env, TORCHRUN)
    ds = sl.ShardedDataset(str(tmp_path), batch_size=2, world=sl.World(5, 8))
    assert ds.partition == sl.Partition(2, 4)
    assert sl.ShardedDataset(
        str(tmp_path), batch_size=2, world=sl.World(5, 8, partition="global")
    ).partition == sl.Partition(1, 8)
    assert ds.for_rank(2, 8).partition == sl.Partition(1, 8)  # a simulated rank: unknown
    assert ds.for_rank(2, 8, ranks_per_node=2).partition == sl.Partition(4, 2)
    with pytest.raises(sl.UsageError, match="partition='nodes' is not one of"):
        sl.ShardedDataset(str(tmp_path), batch_size=2, world=sl.World(partition="nodes"))
