"""Node-local partitions as pure planning: every guarantee of the global order holds inside
them (each sample once, equal steps, the report's padding), each node reads its own span of the
shuffled shards, the spans move every epoch, and a resume may change the partitions."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.batching import PackedBatches, TokenBudgetBatches
from shardloader.batching.base import batch_ids
from shardloader.errors import UsageError
from shardloader.plan.cost import kendall_tau, node_shards, shuffle_quality
from shardloader.plan.epoch import EpochPlanner
from shardloader.plan.partition import Partition, choose_partition, spans
from shardloader.plan.shuffle import ShuffleOptions


def planning(sizes, batch=4, uneven="pad", block=64, planner=None, seed=3):
    shuffle = ShuffleOptions(True, block=block)
    if planner is not None:
        return EpochPlanner(np.asarray(sizes), seed, shuffle, uneven, planner=planner)
    return EpochPlanner(np.asarray(sizes), seed, shuffle, uneven, batch_size=batch)


def every_rank(p, part, epoch=1, start=0, lengths=None, history=()):
    """Each rank's steps: (ids, pad mask) per step, ranks in order."""
    out = []
    for rank in range(part.world_size):
        plan = p.plan(epoch, start, rank, part.world_size, lengths, history, part)
        steps = []
        for j in range(plan.slots.steps_per_rank):
            slots, seeds = plan.slots.steps(np.array([j]))
            batch = plan.batches[int(slots[0])]
            ids = batch_ids(batch)
            steps.append((batch, ids, plan.pad_mask(int(slots[0]), int(seeds[0]), len(ids))))
        out.append(steps)
    return out


def real(per_rank):
    pairs = (zip(ids, pad, strict=True) for steps in per_rank for _, ids, pad in steps)
    return [i for pair in pairs for i, p in pair if not p]


sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0)


@settings(deadline=None, max_examples=80)
@given(
    sizes_st,
    st.integers(1, 5),
    st.integers(1, 3),
    st.integers(1, 7),
    st.sampled_from(["pad", "drop"]),
    st.integers(0, 3),
)
def test_every_sample_once_and_equal_steps_in_any_partition(sizes, nodes, ranks, b, uneven, e):
    n = sum(sizes)
    part = choose_partition("node", nodes * ranks, ranks, n)
    p = planning(sizes, b, uneven)
    per_rank = every_rank(p, part, epoch=e)
    assert len({len(steps) for steps in per_rank}) == 1  # equal steps on every rank
    got = Counter(real(per_rank))
    assert all(c == 1 for c in got.values())  # never twice
    report = p.report(e, p.cluster(e, 0, part, None), None, None)
    assert len(got) == n - report.dropped_samples  # and every sample not reported dropped
    total = sum(len(ids) for steps in per_rank for _, ids, _ in steps)
    assert total - len(got) == report.padded_samples  # the padding is what the report says
    if uneven == "pad":
        assert report.dropped_samples == 0
    # the same totals as one partition: node spans cost no extra padding or drops
    one = p.report(e, p.cluster(e, 0, Partition(1, part.world_size), None), None, None)
    assert (one.padded_samples, one.dropped_samples) == (
        report.padded_samples,
        report.dropped_samples,
    )


@settings(deadline=None, max_examples=60)
@given(sizes_st, st.integers(1, 6), st.integers(0, 5))
def test_each_node_reads_its_own_span_and_shares_only_boundary_shards(sizes, nodes, e):
    p = planning(sizes, batch=2)
    part = choose_partition("node", nodes * 2, 2, sum(sizes))
    shards = node_shards(p, e, part, 2)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for node, steps in enumerate([every_rank(p, part, e)[r] for r in range(0, part.world_size, 2)]):
        # what the node's first rank reads lies in the shards node_shards says it stages
        ids = [i for _, b, _ in steps for i in b]
        read = set(np.searchsorted(starts, ids, side="right") - 1)
        assert read <= set(shards[node].tolist())
    nonempty = sum(1 for s in sizes if s)
    if part.nodes == nodes:  # (with fewer samples than nodes, one partition: nothing to save)
        assert sum(len(s) for s in shards) <= nonempty + nodes - 1  # overlaps at span ends


def test_one_partition_is_the_global_order():
    p = planning([30, 5, 17, 0, 40], batch=3)
    for rank in range(4):
        a = p.plan(2, 0, rank, 4, None)  # no partition given: the order shardloader always had
        b = p.plan(2, 0, rank, 4, None, (), Partition(1, 4))
        assert [x.tolist() for x in a.batches] == [x.tolist() for x in b.batches]
        assert a.slots == b.slots
    order = np.asarray(p.plan(2, 0, 0, 1, None).order)
    assert sorted(order.tolist()) == list(range(92))


def test_the_spans_move_every_epoch():
    p = planning([50] * 40, batch=5, block=200)
    part = Partition(4, 2)
    first = [set(s.tolist()) for s in node_shards(p, 0, part, 2)]
    second = [set(s.tolist()) for s in node_shards(p, 1, part, 2)]
    assert all(len(s) <= 11 for s in first)  # 10 shards a node, at most one shared
    assert first != second
    moved = sum(len(a - b) for a, b in zip(first, second, strict=True))
    assert moved > 20  # most shards change node between epochs


def test_spans_and_partition_choice():
    assert spans(10, 3).tolist() == [0, 4, 7, 10]
    assert choose_partition("node", 16, 8, 1000) == Partition(2, 8)
    assert choose_partition("node", 16, None, 1000) == Partition(1, 16)  # unknown: one span
    assert choose_partition("node", 12, 8, 1000) == Partition(1, 12)  # 8 does not divide 12
    assert choose_partition("rank", 4, None, 1000) == Partition(4, 1)
    assert choose_partition("global", 16, 8, 1000) == Partition(1, 16)
    assert choose_partition("node", 16, 8, 1) == Partition(1, 16)  # fewer samples than nodes
    with pytest.raises(UsageError, match="partition='nodes'"):
        choose_partition("nodes", 2, 1, 10)


def test_augmentation_seeds_are_distinct_across_the_cluster():
    p = planning([25] * 8, batch=3)
    part = Partition(3, 2)
    seeds = []
    for rank in range(6):
        plan = p.plan(0, 0, rank, 6, None, (), part)
        seeds += plan.slots.seeds.tolist()
    assert len(seeds) == len(set(seeds))


@pytest.mark.parametrize("make", ["budget", "packed"])
def test_length_aware_planners_plan_inside_partitions(make):
    rng = np.random.default_rng(4)
    sizes = [12, 30, 7, 22, 19]
    lengths = rng.integers(1, 50, sum(sizes)).astype(np.int64)
    planner = (
        TokenBudgetBatches(64, window=8, oversize="truncate")
        if make == "budget"
        else PackedBatches(16, 2, window=8)
    )
    p = planning(sizes, planner=planner)
    part = Partition(3, 2)
    per_rank = every_rank(p, part, epoch=0, lengths=lengths)
    assert len({len(s) for s in per_rank}) == 1
    covered = [np.zeros(int(x), np.int64) for x in lengths]
    for steps in per_rank:
        for batch, _, pad in steps:
            if pad.all():
                continue
            if batch.ndim == 2:
                for i, a, z in batch.tolist():
                    covered[i][a:z] += 1
            else:
                for i in batch.tolist():
                    covered[i][: min(int(lengths[i]), 64)] += 1
    assert all(int(c.max(initial=0)) == 1 for c in covered)  # every token once
    report = p.report(0, p.cluster(0, 0, part, lengths), lengths, None)
    assert report.total_tokens == int(lengths.sum())


def _resume(p, saved, world2, nodes2, batch2, steps, lengths=None):
    """What every rank of the first world read in ``steps`` steps, and every rank of the
    second world after resuming from there (with batch size ``batch2``)."""
    part1 = saved
    first = [s[:steps] for s in every_rank(p, part1, epoch=1, lengths=lengths)]
    history = ((p.batch_size, part1.nodes, steps * part1.world_size),)
    p2 = EpochPlanner(p.shard_sizes, p.seed, p.shuffle, p.uneven, batch_size=batch2)
    part2 = Partition(nodes2, world2 // nodes2)
    second = every_rank(p2, part2, epoch=1, lengths=lengths, history=history)
    return first, second, p2, part2, history


@pytest.mark.parametrize(
    "nodes2,ranks2,batch2",
    [(6, 8, 4), (4, 8, 6), (16, 8, 3), (8, 4, 6), (8, 8, 3)],
)
def test_an_8x8_state_resumes_on_other_node_counts_exactly_once(nodes2, ranks2, batch2):
    sizes = [97] * 80 + [41] * 20  # 8,580 samples in 100 shards
    p = planning(sizes, batch=3, block=512)
    first, second, p2, part2, history = _resume(
        p, Partition(8, 8), nodes2 * ranks2, nodes2, batch2, steps=7
    )
    assert len({len(s) for s in second}) == 1  # equal steps after the resume
    got = Counter(real(first) + real(second))
    assert all(c == 1 for c in got.values())
    report = p2.report(1, p2.cluster(1, 0, part2, None, history), None, None)
    assert len(got) == 8580 - report.dropped_samples
    # the global batch: 64 ranks x 3 before, kept wherever the new shape allows
    if nodes2 * ranks2 * batch2 == 192:
        assert all(len(b) == batch2 for steps in second for _, b, _ in steps)


def test_a_resume_on_another_node_count_reads_each_remaining_byte_about_once():
    sizes = [1000] * 400  # 400 shards of 1,000 samples
    p = planning(sizes, batch=16, block=4096)
    steps = 100  # 100 steps x 64 ranks x 16 = 102,400 of 400,000 samples consumed
    history = ((16, 8, steps * 64),)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for nodes2 in (6, 4, 16):
        part2 = Partition(nodes2, 8)
        plans = p.cluster(1, 0, part2, None, history)
        remaining, reads = 0, 0
        for plan in plans:  # a node stages every shard any of its batches touches, once
            ids = np.concatenate([np.asarray(b) for b in plan.batches])
            remaining += len(np.unique(ids))
            reads += len(np.unique(np.searchsorted(starts, ids, side="right") - 1))
        assert remaining == 400_000 - steps * 64 * 16
        # shard reads as samples: the rest's shards, those an old node had begun (its
        # current block: 4096 / 1000 + 1 shards each) and one a new span end
        bound = remaining / 1000 + 8 * 6 + nodes2
        assert reads <= bound, (nodes2, reads, bound)
        assert reads * 1000 <= 1.1 * remaining * 1.2  # about 1.1x, at this small scale


def test_shuffle_quality_measures():
    assert kendall_tau(np.arange(100)) == pytest.approx(1.0)
    assert kendall_tau(np.arange(100)[::-1]) == pytest.approx(-1.0)
    assert abs(kendall_tau(np.random.default_rng(0).permutation(5000))) < 0.03
    p = planning([16] * 400, batch=8, block=1024)  # tau of 400 shuffled shards: sd 0.034
    q = shuffle_quality(p, 0, Partition(4, 2), labels=np.arange(6400) // 800)
    assert abs(q.kendall_tau) < 0.12
    assert q.shards_per_rank_batch > 5 and q.shards_per_global_batch > 30
    assert q.classes_per_global_batch is not None and q.classes_per_global_batch >= 5
    unshuffled = EpochPlanner(np.asarray([100] * 64), 0, ShuffleOptions(False), "pad", 8)
    assert shuffle_quality(unshuffled, 0, Partition(1, 8)).kendall_tau > 0.99
