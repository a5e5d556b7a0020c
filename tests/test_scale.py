"""At scale: the lazy epoch order (NOTE [lazy order] in plan/shuffle.py), exactness at 1,024 ranks x
16 workers by simulation of the pure assignment, and start-up cost that does not grow with the
number of ranks."""

from __future__ import annotations

import hashlib
import json
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from fault_proxy import FaultProxy
from helpers import batch_ids, write_dataset
from hypothesis import given, settings
from hypothesis import strategies as st

import shardloader as sl
from shardloader.plan.epoch import EpochPlanner
from shardloader.plan.order import EpochOrder, epoch_order
from shardloader.plan.shuffle import ShuffleOptions
from shardloader.plan.split import FixedBatchList, rank_slots
from shardloader.plan.steps import WorkerSteps

sizes_st = st.lists(st.integers(0, 60), min_size=1, max_size=10).filter(lambda s: sum(s) > 0)
options_st = st.builds(
    ShuffleOptions,
    st.booleans(),
    st.integers(1, 80),
    st.one_of(st.none(), st.integers(1, 30)),
)


# -- the lazy order is today's order, read piece by piece ----------------------------------------


@given(sizes_st, st.integers(0, 2**40), st.integers(0, 9), options_st, st.data())
def test_lazy_order_reads_exactly_the_materialised_order(sizes, seed, epoch, options, data):
    order = EpochOrder(np.array(sizes), seed, epoch, options)
    whole = epoch_order(np.array(sizes), seed, epoch, options)
    total = sum(sizes)
    assert sorted(whole.tolist()) == list(range(total))  # a permutation
    assert [order.block_range(b) for b in range(order.num_blocks)] == options.blocks(total)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    assert np.array_equal(order[lo:hi], whole[lo:hi])
    positions = np.array(data.draw(st.lists(st.integers(0, total - 1), max_size=30)), np.int64)
    assert np.array_equal(order[positions], whole[positions])
    assert order[total - 1] == whole[-1]
    # the shards under each block, and the heaviest block, without generating a permutation
    starts = np.concatenate([[0], np.cumsum(sizes)])
    shard_of = np.searchsorted(starts, whole, side="right") - 1
    weights = np.arange(1, len(sizes) + 1, dtype=np.int64) ** 2
    peak = 0
    for b, (blo, bhi) in enumerate(options.blocks(total)):
        under = set(shard_of[blo:bhi].tolist())
        assert set(order.block_shards(b).tolist()) == under
        peak = max(peak, int(weights[sorted(under)].sum()))
    assert order.peak_block_weight(weights) == peak


@given(sizes_st, st.integers(0, 2**32), st.integers(1, 50), st.sampled_from(["pad", "drop"]))
def test_lazy_batches_are_the_cut_batches(sizes, seed, batch, uneven):
    options = ShuffleOptions(True, 16)
    whole = epoch_order(np.array(sizes), seed, 0, options)
    cut = FixedBatchList(whole, batch, uneven)  # the whole order, an array
    lazy = FixedBatchList(EpochOrder(np.array(sizes), seed, 0, options), batch, uneven)
    assert (len(lazy), lazy.padded, lazy.dropped) == (len(cut), cut.padded, cut.dropped)
    assert all(np.array_equal(a, b) for a, b in zip(lazy, cut, strict=True))


def _synthetic_manifest(folder: Path, num_samples: int, per_shard: int) -> str:
    """A manifest of ``num_samples`` samples with nothing behind it: planning reads no shard."""
    digest = hashlib.sha256(b"none").hexdigest()
    shards, left, n = [], num_samples, 0
    while left:
        count = min(per_shard, left)
        shards.append(
            {
                "path": f"shard-{n:06d}.tar",
                "num_samples": count,
                "bytes": count * 1024,
                "raw_bytes": count * 1024,
                "sha256": digest,
                "index_path": f"shard-{n:06d}.idx.arrow",
                "index_sha256": digest,
            }
        )
        left, n = left - count, n + 1
    manifest = {
        "format_version": 1,
        "format": "tar",
        "compression": "none",
        "fields": {"bin": {"codec": "bytes"}},
        "num_samples": num_samples,
        "shards": shards,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "index.json").write_text(json.dumps(manifest))
    return str(folder)


def test_planning_a_shuffled_epoch_holds_nothing_per_sample(tmp_path: Path) -> None:
    """Through the public API: opening a 10-million-sample dataset and planning its shuffled
    epoch (``len``, then this worker's first steps) allocates a few MB, as at 100,000 samples.
    The materialised order alone was 80 MB here (8 bytes a sample), its batches ~40 more."""
    peaks = {}
    for n in (100_000, 10_000_000):
        url = _synthetic_manifest(tmp_path / f"n{n}", n, 100_000)
        ds = sl.ShardedDataset(url, batch_size=32, shuffle=True, world=sl.World(0, 1))
        tracemalloc.start()
        try:
            steps = len(ds)
            planner = EpochPlanner(ds.manifest.shard_sizes, ds.seed, ds.shuffle, ds.uneven, 32)
            plan = planner.plan(ds.epoch, ds.position, ds.rank, ds.world_size, None)
            first = WorkerSteps(plan, 1, 4)[:3]  # worker 1 of 4: rank steps 1, 5, 9
            peaks[n] = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert steps == -(-n // 32)
        whole = epoch_order(ds.manifest.shard_sizes, 0, 0, ShuffleOptions())
        assert [b.tolist() for b in first] == [
            whole[32 * s : 32 * s + 32].tolist() for s in (1, 5, 9)
        ]
    assert peaks[10_000_000] < 8 << 20, peaks
    assert peaks[10_000_000] < peaks[100_000] + (2 << 20), peaks


# -- exactness at 1,024 ranks x 16 workers, by simulation ----------------------------------------


def _rank_sequence(
    planner: EpochPlanner, epoch: int, start: int, rank: int, world: int, k: int, limit=None
):
    """(sample ids, pad flags) of each step of ``rank`` (the first ``limit``), as torch's
    DataLoader hands them over: round-robin over ``k`` workers, each walking its own steps."""
    plan = planner.plan(epoch, start, rank, world, None)
    workers = [WorkerSteps(plan, w, k) for w in range(k)]
    walks = [list(steps.walk()) for steps in workers]
    out = []
    for j in range(min(plan.slots.steps_per_rank, limit or plan.slots.steps_per_rank)):
        steps, (at, slot, seed_index) = workers[j % k], walks[j % k][j // k]
        ids = steps[at]
        out.append((ids, plan.pad_mask(slot, seed_index, len(ids))))
    return out


def _check_exactly_once(sizes, batch, world, workers, uneven, block=4096, seed=5):
    total = int(np.sum(sizes))
    planner = EpochPlanner(np.array(sizes), seed, ShuffleOptions(True, block), uneven, batch)
    seqs = [_rank_sequence(planner, 0, 0, r, world, workers) for r in range(world)]
    steps = {len(s) for s in seqs}
    assert len(steps) == 1, f"ranks took different numbers of steps: {sorted(steps)}"
    real = np.concatenate([ids[~pad] for s in seqs for ids, pad in s] or [np.zeros(0, np.int64)])
    counts = np.bincount(real, minlength=total)
    report = planner.report(0, planner.plan(0, 0, 0, world, None), None, None)
    assert report.steps_per_rank == steps.pop()
    if uneven == "pad":
        assert counts.max() == 1 and counts.min() == 1  # every sample exactly once
        padded = sum(int(pad.sum()) for s in seqs for _, pad in s)
        assert padded == report.padded_samples
    else:
        assert counts.max() <= 1 and total - counts.sum() == report.dropped_samples
    return planner, seqs


SHAPES = {
    # name: (shard sizes, batch size)
    "primes": ([101, 103, 107, 109, 113] * 13 + [7919], 7),
    "fewer shards than consumers": ([12011, 11987, 12007], 3),
    "one huge shard": ([40009, 1, 2, 3], 2),
    "fewer batches than ranks": ([331, 2], 1),
    "empty shards between": ([0, 4999, 0, 0, 20011, 0], 5),
}


@pytest.mark.parametrize("uneven", ["pad", "drop"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_1024_ranks_by_16_workers_read_every_sample_exactly_once(shape, uneven) -> None:
    sizes, batch = SHAPES[shape]
    _check_exactly_once(sizes, batch, 1024, 16, uneven)


def test_a_ranks_sequence_does_not_depend_on_its_worker_count() -> None:
    sizes, batch = SHAPES["primes"]
    planner = EpochPlanner(np.array(sizes), 5, ShuffleOptions(True, 4096), "pad", batch)
    for rank in (0, 511, 1023):
        seqs = [_rank_sequence(planner, 2, 0, rank, 1024, k) for k in (1, 3, 16)]
        flat = [[ids.tolist() for ids, _ in s] for s in seqs]
        assert flat[0] == flat[1] == flat[2]


@pytest.mark.parametrize("shape", ["primes", "one huge shard"])
def test_elastic_resume_from_1024_to_768_ranks_continues_exactly(shape) -> None:
    """1,024 ranks take 2 steps each; the job comes back on 768 ranks at position 2 x 1,024:
    together every sample exactly once, the 768 ranks with equal steps."""
    sizes, batch = SHAPES[shape]
    total = int(np.sum(sizes))
    planner = EpochPlanner(np.array(sizes), 9, ShuffleOptions(True, 4096), "pad", batch)
    before = [_rank_sequence(planner, 3, 0, r, 1024, 16, limit=2) for r in range(1024)]
    position = 2 * 1024
    after = [_rank_sequence(planner, 3, position, r, 768, 16) for r in range(768)]
    assert len({len(s) for s in after}) == 1
    real = np.concatenate([ids[~pad] for s in before + after for ids, pad in s])
    assert np.array_equal(np.bincount(real, minlength=total), np.ones(total, np.int64))


def test_rank_slots_cost_nothing_per_step() -> None:
    """A rank's slots are arithmetic: a billion-batch epoch at any world size plans at once."""
    slots = rank_slots(10**12, 0, 1023, 1024, "pad")
    js = np.array([0, 1, slots.steps_per_rank - 1])
    batches, seeds = slots.steps(js)
    assert batches.tolist() == [1023, 2047, 10**12 - 1]
    assert seeds.tolist() == batches.tolist()


# -- start-up cost does not grow with the number of ranks ----------------------------------------


def _tally(proxy: FaultProxy, bucket: str) -> tuple[Counter[str], int, int]:
    """(GETs per object key, LIST requests, any other request) the proxy saw."""
    gets: Counter[str] = Counter()
    lists = other = 0
    for r in list(proxy.requests):
        parts = urlsplit(r.path)
        path = unquote(parts.path).lstrip("/")
        key = path.split("/", 1)[1] if "/" in path else ""
        if path.split("/", 1)[0] != bucket:
            other += 1
        elif r.method == "GET" and (not key or "list-type" in parts.query):
            lists += 1
        elif r.method == "GET":
            gets[key] += 1
        else:
            other += 1
    return gets, lists, other


def test_start_up_reads_the_manifest_once_and_never_lists_whatever_the_world_size(
    fault_proxy: FaultProxy, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """A process at rank r of W (given, as torchrun's variables would: no process group, so a
    collective would fail) opens an S3 dataset and reads its first batch: one GET of the
    manifest, no listing, no other request, and only GETs of shards its first steps read,
    each once: the same for W = 8 and W = 1,024."""
    write_dataset(str(tmp_path / "ds"), [16] * 8, compression="zstd")
    for path in sorted((tmp_path / "ds").iterdir()):
        s3_client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    url = f"s3://{s3_bucket}/ds"
    seen = {}
    for world in (8, 1024):
        for rank in (0, world - 1):
            fault_proxy.clear()
            read = sl.ReadOptions(
                storage_options={"endpoint_url": fault_proxy.endpoint},
                readahead=0,
                cache=sl.CacheOptions(dir=str(tmp_path / f"cache-{world}-{rank}")),
            )
            ds = sl.ShardedDataset(
                url, batch_size=4, shuffle=True, read=read, world=sl.World(rank, world)
            )
            first = next(iter(ds))
            gets, lists, other = _tally(fault_proxy, s3_bucket)
            assert lists == 0 and other == 0, (world, rank, fault_proxy.requests)
            assert gets.pop("ds/index.json") == 1
            assert all(k.startswith("ds/shard-") and n == 1 for k, n in gets.items()), gets
            shards = {i // 16 for i in batch_ids(first)}
            assert len(gets) == len(shards)  # the first batch's shards, nothing for the world
            seen[world, rank] = sum(gets.values()) + 1
    assert max(seen[1024, r] for r in (0, 1023)) <= max(seen[8, r] for r in (0, 7)) + 3


# -- lengths: mapped from the node cache, never N integers per process ---------------------------


def test_lengths_are_mapped_once_per_node_and_pickle_as_a_path(tmp_path: Path) -> None:
    import pickle

    from shardloader.manifest import read_manifest
    from shardloader.read.lengths import SharedLengths, load_lengths

    write_dataset(str(tmp_path / "ds"), [3000, 0, 4570, 2430])
    manifest, base = read_manifest(str(tmp_path / "ds"))
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    lengths = load_lengths(manifest, base, read)
    from helpers import payload

    assert isinstance(lengths, SharedLengths)
    assert lengths.tolist() == [len(payload(i)) for i in range(10_000)]
    wire = pickle.dumps(lengths)
    assert len(wire) < 8000  # a path and the manifest, not 80,000 bytes of integers
    assert np.array_equal(pickle.loads(wire), lengths)
    assert len(pickle.dumps(lengths[10:20])) > 80  # a slice travels as its values
    assert np.array_equal(pickle.loads(pickle.dumps(lengths[10:20])), lengths[10:20])
    (cached,) = (tmp_path / "cache").rglob("lengths*")
    saved = {p.name: p.read_bytes() for p in (tmp_path / "ds").glob("*.idx.arrow")}
    for name in saved:
        (tmp_path / "ds" / name).unlink()  # the next process on this node reads the cache's copy
    assert np.array_equal(load_lengths(manifest, base, read), lengths)
    # a cache entry like a shard: `cache clear` removes it; a process that finds it gone (a
    # worker started after the clear) builds it again from the sidecars
    for name, data in saved.items():
        (tmp_path / "ds" / name).write_bytes(data)
    report = sl.storage.cachedir.clear(str(tmp_path / "cache"))
    assert report.files >= 1 and not cached.exists()
    assert np.array_equal(pickle.loads(wire), lengths) and cached.exists()


# -- the node's read-ahead schedule from a lazy order --------------------------------------------


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.integers(0, 30), min_size=1, max_size=12).filter(lambda s: sum(s) > 0),
    options_st,
    st.integers(1, 9),
    st.integers(1, 6),
    st.data(),
)
def test_lazy_read_ahead_schedules_every_shard_by_its_first_need(
    sizes, options, batch, world, data
):
    """The schedule walked from a lazy plan (readahead.block_schedule over steps.node_windows)
    names every shard the node's ranks read at or before the step that first reads it; the
    first 16 steps exactly as the materialised plan's schedule (node_schedule), and all of it
    exactly when unshuffled."""
    from shardloader.plan.steps import node_windows
    from shardloader.read.readahead import block_schedule, node_schedule

    local = sorted(set(data.draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=3))))
    planner = EpochPlanner(np.array(sizes), 3, options, "pad", batch)
    plan = planner.plan(0, 0, local[0], world, None)
    starts = np.concatenate([[0], np.cumsum(sizes)])

    def locate(ids):
        return np.searchsorted(starts, ids, side="right") - 1

    per_rank = [rank_slots(plan.num_batches, 0, r, world, "pad") for r in local]
    shard_ids, steps = [], []
    for s in per_rank:
        parts = [plan.batches[q] for q in s.slots.tolist()]
        shard_ids.append(locate(np.concatenate(parts)) if parts else np.zeros(0, np.int64))
        steps.append(np.repeat(np.arange(len(parts)), [len(p) for p in parts]))
    exact = node_schedule(shard_ids, steps)
    lazy = list(block_schedule(node_windows(plan, per_rank, locate)))
    assert len({shard for _, shard in lazy}) == len(lazy)  # each shard once
    due = dict((shard, step) for step, shard in lazy)
    assert all(shard in due and due[shard] <= step for step, shard in exact)
    if options.enabled:
        assert [e for e in lazy if e[0] < 16] == [e for e in exact if e[0] < 16]
    else:
        assert lazy == exact


@given(
    st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda s: sum(s) > 0),
    st.integers(1, 12),
    st.integers(1, 7),
    st.sampled_from(["pad", "drop"]),
    st.data(),
)
def test_fixed_report_by_arithmetic_counts_what_the_batches_deliver(
    sizes, batch, world, uneven, data
):
    """ds.report() of fixed batches without lengths never materialises the epoch; its counts
    are those of accounting every delivered batch (the general rule, batching/base.account)."""
    from shardloader.batching.fixed import account_fixed

    planner = EpochPlanner(np.array(sizes), 1, ShuffleOptions(True, 8), uneven, batch)
    num = len(planner.plan(0, 0, 0, world, None).batches)
    start = data.draw(st.integers(0, max(num - 1, 0)))
    plan = planner.plan(0, start, 0, world, None)
    report = planner.report(0, plan, None, None)
    delivered, padded = plan.delivered()
    acc = account_fixed(np.asarray(plan.order), None, delivered, None)
    assert (report.padded_samples, report.dropped_samples) == (padded, len(acc.dropped))
    assert report.truncated_samples == len(acc.truncated) == 0 and report.tokens is None


def test_spawned_workers_map_the_lengths_and_plan_alike(tmp_path: Path) -> None:
    """A length-aware planner through a real DataLoader whose workers are spawned (the
    dataset, lengths included, crosses by pickle: the lengths as their cache path): the same
    batches, in the same order, as without workers."""
    from shardloader.batching import TokenBudgetBatches

    write_dataset(str(tmp_path / "ds"), [37, 0, 61, 50])
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))

    def run(workers: int, **kw: Any) -> list[list[int]]:
        ds = sl.ShardedDataset(
            str(tmp_path / "ds"), planner=TokenBudgetBatches(600), shuffle=True, seed=4, read=read
        )
        assert len(list((tmp_path / "cache").rglob("lengths-*.npy.raw"))) == 1  # mapped from here
        return [batch_ids(b) for b in sl.make_loader(ds, num_workers=workers, **kw)]

    alone = run(0)
    assert sorted(i for b in alone for i in b) == list(range(148))
    assert run(2, multiprocessing_context="spawn") == alone
