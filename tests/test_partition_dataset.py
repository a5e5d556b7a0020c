"""Node-local partitions through the dataset and a real DataLoader: each node's ranks read its
own shards, the sequences do not depend on ``num_workers``, and a saved state resumes on
other node counts with every sample exactly once."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from helpers import write_dataset

import shardloader as sl

SIZES = [23, 40, 7, 31, 19, 28, 12, 36, 25, 9]  # 230 samples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("parts"))
    write_dataset(d, SIZES, compression="zstd")
    return d


def make(path, cache, **kw):
    kw.setdefault("read", sl.ReadOptions(cache=sl.CacheOptions(dir=cache)))
    return sl.ShardedDataset(path, batch_size=4, shuffle=True, seed=9, **kw)


def staged(cache):
    """The shard copies a node cache holds (locks and bookkeeping aside)."""
    names = set()
    for _root, _, files in os.walk(cache):
        names |= {f.split(".")[0] for f in files if not f.endswith(".lock") and "shard-" in f}
    return names


def run(
    path, tmp, world, per_node, workers, state=None, stop=None, epoch=1, partition="node", **kw
):
    """Every rank of a simulated world, each node with its own cache: what each rank saw
    (ids, pads), the state after ``stop`` steps, and each node's staged shards."""
    seen, states, lens = {}, [], set()
    for rank in range(world):
        cache = os.path.join(tmp, f"node{rank // per_node}")
        place = sl.World(rank, world, ranks_per_node=per_node, partition=partition)
        ds = make(path, cache, world=place, **kw)
        loader = sl.make_loader(ds, num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        ds.set_epoch(epoch)
        lens.add(len(loader))
        got = []
        for step, batch in enumerate(loader):
            got.append((batch["__index__"].tolist(), batch["__pad__"].tolist()))
            if stop is not None and step == stop - 1:
                states.append(loader.state_dict())
                break
        seen[rank] = got
    assert len(lens) == 1  # equal steps on every rank
    assert all(s == states[0] for s in states)  # the state is rank-agnostic
    nodes = {r // per_node for r in range(world)}
    shards = {n: staged(os.path.join(tmp, f"node{n}")) for n in nodes}
    return seen, (states[0] if states else None), shards


def real(seen):
    return [
        i
        for got in seen.values()
        for ids, pads in got
        for i, p in zip(ids, pads, strict=True)
        if not p
    ]


def test_each_node_reads_its_share_and_workers_change_nothing(data, tmp_path):
    a, _, shards = run(data, str(tmp_path / "a"), 6, 3, 0)  # 2 nodes x 3 ranks
    b, _, _ = run(data, str(tmp_path / "b"), 6, 3, 2)
    assert a == b  # every rank's sequence, whatever num_workers is
    assert sorted(real(a)) == list(range(230))  # every sample once across the job
    both = shards[0] | shards[1]
    assert len(both) == len(SIZES)
    assert len(shards[0] & shards[1]) <= 1  # only the shard their spans cut is shared
    g, _, whole = run(data, str(tmp_path / "g"), 6, 3, 0, partition="global")
    assert sorted(real(g)) == list(range(230))
    assert len(whole[0]) + len(whole[1]) > len(shards[0]) + len(shards[1])  # global costs more


def test_a_state_resumes_on_other_node_counts_exactly_once(data, tmp_path):
    first, state, _ = run(data, str(tmp_path / "s"), 4, 2, 2, stop=5)  # 2 nodes x 2 ranks
    assert state["version"] == 3 and state["partitions"] == 2 and state["position"] == 20
    for world, per_node in ((3, 1), (2, 2), (6, 2), (4, 4)):
        rest, _, _ = run(data, str(tmp_path / f"r{world}{per_node}"), world, per_node, 1, state)
        got = Counter(real(first) + real(rest))
        assert got == Counter(range(230)), (world, per_node)
    # and a chain: 2x2 -> 3x2 (stopped again) -> 1 node
    more, again, _ = run(data, str(tmp_path / "c"), 6, 2, 0, state, stop=3)
    assert again["reshapes"] == [[4, 2, 20]] and again["position"] == 18
    last, _, _ = run(data, str(tmp_path / "d"), 2, 2, 0, again)
    assert Counter(real(first) + real(more) + real(last)) == Counter(range(230))


def test_a_state_from_one_partition_resumes_in_several(data, tmp_path):
    first, state, _ = run(data, str(tmp_path / "g"), 2, 2, 0, stop=9)  # one node: one span
    assert state["partitions"] == 1 and state["version"] == 1
    rest, _, _ = run(data, str(tmp_path / "n"), 4, 2, 2, state)
    assert Counter(real(first) + real(rest)) == Counter(range(230))


def test_the_report_counts_every_partition(data, tmp_path):
    ds = make(data, str(tmp_path / "c"), world=sl.World(0, 6, ranks_per_node=3))
    assert ds.partition == sl.Partition(2, 3)
    report = ds.report(1)
    seen, _, _ = run(data, str(tmp_path / "x"), 6, 3, 0)
    total = sum(len(ids) for got in seen.values() for ids, _ in got)
    assert total - 230 == report.padded_samples
    assert report.steps_per_rank == len(seen[0])
    ledger = ds.ledger(1)
    assert len([e for e in ledger.entries if e.status == "padded"]) == report.padded_samples


def test_mixture_partitions_take_their_share_of_every_source(tmp_path):
    urls = {}
    for name, sizes in {"a": [30, 25, 41, 18], "b": [22, 22, 9]}.items():
        urls[name] = str(tmp_path / name)
        write_dataset(urls[name], sizes)
    mix = sl.Mixture(urls, {"a": 2, "b": 1}, epoch_samples=120, shuffle=True, batch_size=3)
    offsets = mix.offsets
    got, by_node = [], [Counter(), Counter()]
    for rank in range(4):
        view = mix.for_rank(rank, 4, ranks_per_node=2)
        plan = view.plan(0)
        for j, batch in enumerate(sl.make_loader(view)):
            pairs = zip(batch["__index__"], batch["__pad__"], strict=True)
            ids = [int(i) for i, p in pairs if not p]
            got += ids
            by_node[rank // 2].update("a" if i < offsets["b"] else "b" for i in ids)
            assert j < plan.slots.steps_per_rank
    # the blend's positions, once each (its sources' epochs dealt to the two partitions)
    assert sorted(got) == sorted(view.order(0).tolist())
    for counts in by_node:  # each node about half of each source's picks (80 a, 40 b)
        assert abs(counts["a"] - 40) <= 3 and abs(counts["b"] - 20) <= 3


def test_a_position_must_be_a_step_boundary(data, tmp_path):
    ds = make(data, str(tmp_path / "c"), world=sl.World(0, 4, ranks_per_node=2))
    ds.seek(1, 3)
    with pytest.raises(sl.UsageError, match="not a step boundary"):
        len(ds)
    loader = sl.make_loader(make(data, str(tmp_path / "c"), world=sl.World(0, 4)))
    with pytest.raises(sl.ResumeError, match="not a step boundary"):
        loader.load_state_dict(
            {
                "version": 3,
                "epoch": 0,
                "position": 3,
                "partitions": 2,
                "seed": 9,
                "fingerprint": loader.dataset.manifest.fingerprint,
                "plan": loader.dataset.plan_signature,
            }
        )
    assert np.asarray(ds.partition.nodes) == 2
