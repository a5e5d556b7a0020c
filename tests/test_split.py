"""Pure properties of the order and the split (hypothesis), no processes involved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardloader.errors import UsageError
from shardloader.plan.order import epoch_order
from shardloader.plan.shuffle import ShuffleOptions
from shardloader.plan.split import FixedBatchList, Place, rank_slots

sizes_st = st.lists(st.integers(0, 40), min_size=1, max_size=12).filter(lambda s: sum(s) > 0)


@given(sizes_st, st.integers(0, 2**32), st.integers(0, 5), st.integers(1, 64))
def test_epoch_order_is_a_permutation_and_blocks_stay_local(sizes, seed, epoch, block):
    order = epoch_order(np.array(sizes), seed, epoch, ShuffleOptions(True, block))
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    again = epoch_order(np.array(sizes), seed, epoch, ShuffleOptions(True, block))
    assert np.array_equal(order, again)
    # within a block, ids come from the shards laid out in that block's range: after sorting
    # each block, blocks are contiguous runs of the (shard-permuted) stream
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.searchsorted(starts, order, side="right") - 1
    for lo in range(0, len(order), block):
        touched = set(shard_of[lo : lo + block].tolist())
        assert len(touched) <= block  # a block never spans more shards than it has samples


def _order_before_first_block(sizes, seed, epoch, block):
    """epoch_order as written before ShuffleOptions.first_block existed (equal blocks)."""
    from shardloader.plan.shuffle import _BLOCK, _SHARDS, rng_for

    sizes = np.asarray(sizes, np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    total = int(sizes.sum())
    perm = rng_for(seed, epoch, _SHARDS).permutation(len(sizes))
    order = np.concatenate([np.arange(starts[s], starts[s] + sizes[s]) for s in perm])
    for b, lo in enumerate(range(0, total, block)):
        hi = min(lo + block, total)
        order[lo:hi] = order[lo:hi][rng_for(seed, epoch, _BLOCK, b).permutation(hi - lo)]
    return order


@given(sizes_st, st.integers(0, 2**32), st.integers(0, 5), st.integers(1, 64))
def test_default_order_is_unchanged_by_first_block_option(sizes, seed, epoch, block):
    """Same seed, same order as before the option existed (runs and saved positions agree)."""
    ours = epoch_order(np.array(sizes), seed, epoch, ShuffleOptions(True, block))
    assert np.array_equal(ours, _order_before_first_block(sizes, seed, epoch, block))


@given(sizes_st, st.integers(0, 2**32), st.integers(0, 5), st.integers(1, 64), st.integers(1, 64))
def test_first_block_order_is_a_pure_permutation_with_growing_blocks(
    sizes, seed, epoch, block, first
):
    options = ShuffleOptions(True, block, first_block=first)
    order = epoch_order(np.array(sizes), seed, epoch, options)
    assert sorted(order.tolist()) == list(range(sum(sizes)))  # every sample exactly once
    assert np.array_equal(order, epoch_order(np.array(sizes), seed, epoch, options))
    bounds = options.blocks(sum(sizes))
    assert bounds[0][0] == 0 and bounds[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    sizes_seen = [hi - lo for lo, hi in bounds[:-1]]
    assert sizes_seen[:1] in ([], [min(first, block)])
    assert all(b == min(2 * a, block) for a, b in zip(sizes_seen, sizes_seen[1:], strict=False))
    # a block only mixes the samples laid out in its range of the shard-permuted stream
    stream = epoch_order(np.array(sizes), seed, epoch, ShuffleOptions(True, 1))
    for lo, hi in bounds:
        assert sorted(order[lo:hi].tolist()) == sorted(stream[lo:hi].tolist())


def test_first_block_shrinks_the_first_batch_and_enters_the_signature():
    sizes = np.full(100, 50)  # 100 shards of 50 samples
    starts = np.concatenate([[0], np.cumsum(sizes)])
    wide = epoch_order(sizes, 3, 0, ShuffleOptions(True))
    ramp = epoch_order(sizes, 3, 0, ShuffleOptions(True, first_block=32))
    shards_of = lambda ids: set((np.searchsorted(starts, ids, side="right") - 1).tolist())  # noqa: E731
    assert len(shards_of(wide[:32])) > 10 and len(shards_of(ramp[:32])) <= 2
    assert ShuffleOptions(True).signature() == "ShuffleOptions(enabled=True, block=65536)"
    assert ShuffleOptions(True, 8, 2).signature() == (
        "ShuffleOptions(enabled=True, block=8, first_block=2)"
    )
    with pytest.raises(UsageError, match="first_block"):
        ShuffleOptions(True, first_block=0)


def test_epochs_differ_and_no_shuffle_is_identity():
    sizes = np.array([50, 50, 50])
    a = epoch_order(sizes, 7, 0, ShuffleOptions(True))
    b = epoch_order(sizes, 7, 1, ShuffleOptions(True))
    c = epoch_order(sizes, 8, 0, ShuffleOptions(True))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(epoch_order(sizes, 7, 3, ShuffleOptions(False)), np.arange(150))


@given(st.integers(0, 300), st.integers(1, 17), st.sampled_from(["pad", "drop"]))
def test_fixed_batches_are_full_and_cover(n, b, uneven):
    order = np.arange(n, dtype=np.int64)[::-1].copy()
    cut = FixedBatchList(order, b, uneven)
    batches, padded, dropped = list(cut), cut.padded, cut.dropped
    assert len(batches) == len(cut) and all(len(x) == b for x in batches)
    flat = np.concatenate(batches) if batches else np.zeros(0, np.int64)
    if uneven == "pad":
        assert sorted(set(flat.tolist())) == list(range(n))
        assert len(flat) == n + padded and padded < b
        assert dropped == 0
    else:
        assert len(set(flat.tolist())) == len(flat) == n - dropped and dropped < b
        assert padded == 0


@settings(max_examples=300)
@given(
    st.integers(0, 120), st.integers(0, 120), st.integers(1, 9), st.sampled_from(["pad", "drop"])
)
def test_rank_slots_exactly_once_and_equal(m, start, world, uneven):
    start = min(start, m)
    per_rank = [rank_slots(m, start, r, world, uneven) for r in range(world)]
    steps = {p.steps_per_rank for p in per_rank}
    assert len(steps) == 1 and all(len(p.slots) == p.steps_per_rank for p in per_rank)
    real = sorted(int(s) for p in per_rank for s, k in zip(p.slots, p.seeds, strict=False) if k < m)
    remaining = list(range(start, m))
    if uneven == "pad":
        assert real == remaining  # every remaining batch exactly once, plus padding
        padding = sum(int((p.seeds >= m).sum()) for p in per_rank)
        assert padding == per_rank[0].padded_batches < world
    else:
        assert (
            real == remaining[: len(real)] and len(real) == m - start - per_rank[0].dropped_batches
        )
        assert per_rank[0].dropped_batches < world
    seeds = [int(k) for p in per_rank for k in p.seeds]
    assert len(set(seeds)) == len(seeds)  # every step seeds its augmentation differently


@settings(max_examples=200)
@given(st.integers(1, 200), st.integers(1, 6), st.integers(1, 6), st.integers(0, 40))
def test_elastic_resume_covers_every_batch_once(m, w1, w2, steps_before):
    """Run k steps at world W1, then resume at W2: together every batch exactly once."""
    first = [rank_slots(m, 0, r, w1, "pad") for r in range(w1)]
    k = min(steps_before, first[0].steps_per_rank)
    seen = [int(s) for p in first for s, sd in zip(p.slots[:k], p.seeds[:k], strict=True) if sd < m]
    start = min(k * w1, m)
    second = [rank_slots(m, start, r, w2, "pad") for r in range(w2)]
    seen += [int(s) for p in second for s, sd in zip(p.slots, p.seeds, strict=False) if sd < m]
    assert sorted(seen) == list(range(m))


@given(st.integers(1, 100), st.integers(1, 8))
def test_worker_stride_reassembles_rank_order(m, k):
    """DataLoader round-robin over workers' strided shares gives back the rank's order."""
    slots = rank_slots(m, 0, 0, 1, "pad").slots.tolist()
    shares = [slots[w::k] for w in range(k)]
    merged = [shares[j % k][j // k] for j in range(len(slots))]
    assert merged == slots


def test_place_validates():
    with pytest.raises(UsageError, match="rank 2 is outside world_size 2"):
        Place(2, 2)
    with pytest.raises(UsageError, match="uneven="):
        rank_slots(4, 0, 0, 1, "wrap")
