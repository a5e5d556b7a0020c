"""The data-parallel place: which replica a rank reads for, and how many replicas share a node.

The arithmetic is pure (NOTE [data-parallel place] in shardloader/plan/dataparallel.py); the
errors are checked against a real DeviceMesh of a one-rank gloo group.  The 4-rank runs are in
tests/test_stack_dist.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import write_dataset

import shardloader as sl
from shardloader.plan.dataparallel import data_parallel_dims, replica_place, replicas_per_node
from shardloader.plan.partition import choose_partition


@pytest.mark.parametrize(
    ("names", "want"),
    [
        (("dp", "tp"), (0,)),
        (("pp", "dp_replicate", "dp_shard", "cp", "tp"), (1, 2)),  # torchtitan's HSDP mesh
        (("dp",), (0,)),
        (None, (0,)),  # a 1-D mesh without names: all of it splits the data
        (("replica",), (0,)),  # a 1-D mesh the user cut out, whatever its name
    ],
)
def test_data_parallel_dimensions_are_found_by_name(names, want):
    assert data_parallel_dims(names, len(names) if names else 1) == want


@pytest.mark.parametrize("names", [("tp",), ("pp", "tp"), ("dp_shard_cp",), None])
def test_a_mesh_without_a_data_parallel_dimension_is_refused_naming_it(names):
    ndim = 2 if names is None else len(names)
    with pytest.raises(sl.UsageError, match="none of them data parallel") as err:
        data_parallel_dims(names, ndim)
    if names:
        assert all(repr(n) in str(err.value) for n in names)


def test_each_rank_of_a_replica_gets_the_replicas_place():
    mesh = np.arange(4).reshape(2, 2)  # dp x tp, tp inner (as init_device_mesh lays it out)
    places = [replica_place(mesh, (0,), g, None) for g in range(4)]
    assert [(p.rank, p.world_size) for p in places] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    hsdp = np.arange(16).reshape(2, 2, 2, 2)  # dp_replicate x dp_shard x cp x tp
    got = [replica_place(hsdp, (0, 1), g, None).rank for g in range(16)]
    assert got == [g // 4 for g in range(16)]  # 4 replicas, each of 4 ranks (cp x tp)


def test_replicas_per_node_count_in_data_parallel_ranks():
    # 2 nodes of 8 GPUs, tensor parallel 2 inside a node: 4 replicas a node, 2 partitions
    place = replica_place(np.arange(16).reshape(8, 2), (0,), 5, 8)
    assert (place.rank, place.world_size, place.ranks_per_node) == (2, 8, 4)
    assert choose_partition("node", 8, place.ranks_per_node, 1000).nodes == 2
    # pipeline stages on other nodes: pp x dp x tp = 2 x 4 x 8, a node per (stage, replica)
    place = replica_place(np.arange(64).reshape(2, 4, 8), (1,), 45, 8)
    assert (place.rank, place.world_size, place.ranks_per_node) == (1, 4, 1)
    # tensor parallel across the nodes' halves (tp outer): every node holds every replica
    place = replica_place(np.arange(16).reshape(2, 8), (1,), 9, 8)
    assert (place.rank, place.ranks_per_node) == (1, 8)
    assert choose_partition("node", 8, place.ranks_per_node, 1000).nodes == 1


@pytest.mark.parametrize(
    "group",
    [
        [0, 2, 1, 3],  # nodes 0, 1, 0, 1: a node's replicas not consecutive
        [0, 2, 4],  # nodes of 3 ranks, tp 2: two replicas on node 0, one on node 1
    ],
)
def test_an_irregular_layout_is_unknown(group):
    per_node = 2 if len(group) == 4 else 3
    assert replicas_per_node(group, per_node) is None
    place = replica_place(np.array(group), (0,), group[0], per_node)
    assert place.ranks_per_node is None  # one partition
    assert choose_partition("node", place.world_size, None, 1000).nodes == 1


def test_every_group_of_a_mesh_must_agree():
    mesh = np.array([[0, 1, 4, 5], [2, 6, 3, 7]])  # tp x dp, a hand-made rank order
    assert replicas_per_node(mesh[0], 4) == 2  # alone, this group looks regular
    assert replicas_per_node(mesh[1], 4) is None
    # rank 0 and rank 2 form one replica: both must plan one partition
    assert replica_place(mesh, (1,), 0, 4).ranks_per_node is None
    assert replica_place(mesh, (1,), 2, 4).ranks_per_node is None


def test_explicit_replicas_per_node_win_and_are_checked():
    mesh = np.arange(8).reshape(4, 2)
    assert replica_place(mesh, (0,), 3, None, explicit_per_node=2).ranks_per_node == 2
    with pytest.raises(sl.UsageError, match="divisor of the 4 data-parallel ranks"):
        replica_place(mesh, (0,), 3, None, explicit_per_node=3)
    with pytest.raises(sl.UsageError, match="global rank 9 is not in"):
        replica_place(mesh, (0,), 9, None)


@pytest.fixture
def one_rank_group(tmp_path):
    """A real one-rank gloo group (file rendezvous), torn down after the test."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.slow  # the gloo group's set-up: about 2 s
def test_a_real_mesh_without_data_parallel_dimension_is_refused(one_rank_group, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh

    data = str(tmp_path / "ds")
    write_dataset(data, [5, 5])
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "tp"))
    with pytest.raises(sl.UsageError, match=r"dimensions \('pp', 'tp'\), none of them data"):
        sl.ShardedDataset(data, batch_size=2, world=sl.World.of(mesh))
    with pytest.raises(sl.UsageError, match=r"dimensions \('tp',\)"):
        sl.ShardedDataset(data, batch_size=2).set_world(sl.World.of(mesh["tp"]))
    with pytest.raises(sl.UsageError, match="takes a torch.distributed DeviceMesh"):
        sl.ShardedDataset(data, batch_size=2, world=sl.World.of("dp"))
    with pytest.raises(sl.UsageError, match="from a data-parallel group or a rank, not both"):
        sl.ShardedDataset(data, batch_size=2, world=sl.World(0, 1, group=mesh))
    dp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    ds = sl.ShardedDataset(data, batch_size=2, world=sl.World.of(dp))
    assert (ds.rank, ds.world_size) == (0, 1) and len(list(sl.make_loader(ds))) == 5


def test_data_parallel_needs_an_initialized_group(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [4])
    with pytest.raises(sl.UsageError, match="needs torch.distributed initialized"):
        sl.ShardedDataset(data, batch_size=2, world=sl.World.of(object()))
