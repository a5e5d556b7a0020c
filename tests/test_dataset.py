"""ShardedDataset through real torch DataLoaders with worker processes."""

from __future__ import annotations

import inspect
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import batch_ids, payload, write_dataset

import shardloader as sl
from shardloader.batching import BatchPlanner

UNEVEN_SIZES = [1, 120, 3, 0, 17, 59]  # wildly uneven, one empty shard: 200 samples


def make(path, **kw):
    kw.setdefault("read", sl.ReadOptions(cache=sl.CacheOptions(dir=os.path.join(path, "_cache"))))
    return sl.ShardedDataset(path, **kw)


def run_epoch(ds, num_workers=0, **kw):
    loader = sl.make_loader(ds, num_workers=num_workers, **kw)
    return [b for b in loader]


def real_ids(batches):
    pairs = (zip(batch_ids(b), b["__pad__"].tolist(), strict=True) for b in batches)
    return [i for pair in pairs for i, p in pair if not p]


@pytest.fixture(scope="module")
def uneven_zstd(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("uneven"))
    write_dataset(d, UNEVEN_SIZES, compression="zstd")
    return d


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 2, 4])
def test_exactly_once_equal_per_rank(uneven_zstd, world, num_workers):
    seen, steps = [], set()
    for rank in range(world):
        ds = make(uneven_zstd, batch_size=8, shuffle=True, seed=5, world=sl.World(rank, world))
        batches = run_epoch(ds, num_workers)
        steps.add(len(batches))
        assert len(batches) == len(ds)
        assert all(len(batch_ids(b)) == 8 for b in batches)  # never a partial batch
        seen += real_ids(batches)
    assert len(steps) == 1  # the same number of steps on every rank: DDP cannot hang
    assert sorted(seen) == list(range(200))  # every sample once, pads excluded
    report = make(
        uneven_zstd, batch_size=8, shuffle=True, seed=5, world=sl.World(0, world)
    ).report()
    assert report.padded_samples == steps.pop() * world * 8 - 200


def test_fewer_shards_than_consumers(tmp_path):
    write_dataset(str(tmp_path), [37])  # one shard, 2 ranks x 3 workers
    seen = []
    for rank in range(2):
        seen += real_ids(run_epoch(make(str(tmp_path), batch_size=2, world=sl.World(rank, 2)), 3))
    assert sorted(seen) == list(range(37))


def test_drop_policy_reports_and_never_repeats(uneven_zstd):
    seen = []
    for rank in range(3):
        ds = make(uneven_zstd, batch_size=8, shuffle=True, uneven="drop", world=sl.World(rank, 3))
        seen += [i for b in run_epoch(ds, 2) for i in batch_ids(b)]
    report = make(uneven_zstd, batch_size=8, uneven="drop", world=sl.World(0, 3)).report()
    assert len(seen) == len(set(seen)) == 200 - report.dropped_samples
    assert report.dropped_samples == 200 - (200 // 24) * 24


def test_sequence_independent_of_num_workers_and_reproducible(uneven_zstd):
    runs = {}
    for nw in (0, 1, 3):
        ds = make(uneven_zstd, batch_size=5, shuffle=True, seed=11, world=sl.World(1, 2))
        runs[nw] = [batch_ids(b) for b in run_epoch(ds, nw)]
    assert runs[0] == runs[1] == runs[3]
    other_seed = make(uneven_zstd, batch_size=5, shuffle=True, seed=12, world=sl.World(1, 2))
    assert [batch_ids(b) for b in run_epoch(other_seed)] != runs[0]


def test_unbatched_samples_exactly_once(uneven_zstd):
    ds = make(uneven_zstd, shuffle=True, seed=1)
    samples = list(sl.make_loader(ds, num_workers=2))
    assert sorted(int(s["__index__"]) for s in samples) == list(range(200))
    for s in samples[:20]:
        assert s["bin"] == payload(int(s["__index__"]))


def test_epochs_reshuffle_with_persistent_workers(uneven_zstd):
    ds = make(uneven_zstd, batch_size=10, shuffle=True, seed=3)
    loader = sl.make_loader(ds, num_workers=2, persistent_workers=True)
    orders = []
    for epoch in range(3):
        ds.set_epoch(epoch)
        batches = list(loader)
        assert sorted(real_ids(batches)) == list(range(200))
        orders.append([batch_ids(b) for b in batches])
    assert orders[0] != orders[1] != orders[2]
    fresh = make(uneven_zstd, batch_size=10, shuffle=True, seed=3)
    fresh.set_epoch(2)
    assert [batch_ids(b) for b in run_epoch(fresh)] == orders[2]  # epoch 2 is a pure function


@pytest.mark.parametrize("w1,k1,w2,k2", [(2, 2, 3, 1), (3, 0, 1, 3), (1, 3, 2, 2)])
def test_elastic_resume(uneven_zstd, w1, k1, w2, k2):
    """Checkpoint at W1/K1 after 3 steps, resume at W2/K2: no repeats, no gaps."""
    kw = dict(batch_size=6, shuffle=True, seed=21)
    seen, states = [], []
    for rank in range(w1):
        ds = make(uneven_zstd, world=sl.World(rank, w1), **kw)
        ds.set_epoch(1)
        loader = sl.make_loader(ds, num_workers=k1)
        for step, batch in enumerate(loader):
            seen += real_ids([batch])
            if step == 2:
                states.append(loader.state_dict())
                break
    assert all(s == states[0] for s in states)  # the state is rank-agnostic
    assert states[0]["position"] == 3 * w1
    for rank in range(w2):
        ds = make(uneven_zstd, world=sl.World(rank, w2), **kw)
        loader = sl.make_loader(ds, num_workers=k2)
        loader.load_state_dict(states[0])
        ds.set_epoch(1)  # the usual loop calls set_epoch again: the position must survive
        seen += real_ids(list(loader))
    assert Counter(seen) == Counter(range(200))


def test_resume_at_90_percent_reads_only_what_is_left(tmp_path):
    d = str(tmp_path / "ds")
    write_dataset(d, [20] * 20, compression="zstd")  # 400 samples, 20 shards
    cache = str(tmp_path / "cache")
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=cache), readahead=0)
    ds = sl.ShardedDataset(d, batch_size=10, read=read)  # unshuffled: shards in order
    loader = sl.make_loader(ds)
    loader.load_state_dict({**loader.state_dict(), "position": 36})  # 90 % consumed
    batches = list(loader)
    assert sorted(real_ids(batches)) == list(range(360, 400))
    staged = [
        f for f in os.listdir(os.path.join(cache, ds.manifest.fingerprint)) if f.endswith(".raw")
    ]
    assert sorted(staged) == ["shard-00018.tar.zst.raw", "shard-00019.tar.zst.raw"]


def test_resume_rejects_a_different_dataset_or_plan(uneven_zstd, tmp_path):
    loader = sl.make_loader(make(uneven_zstd, batch_size=4, seed=1))
    state = loader.state_dict()
    with pytest.raises(sl.ResumeError, match="seed"):
        sl.make_loader(make(uneven_zstd, batch_size=4, seed=2)).load_state_dict(state)
    with pytest.raises(sl.ResumeError, match="plan"):  # the batch size alone may change
        sl.make_loader(make(uneven_zstd, batch_size=5, seed=1, uneven="drop")).load_state_dict(
            state
        )
    write_dataset(str(tmp_path), [5, 5])
    with pytest.raises(sl.ResumeError, match="fingerprint"):
        sl.make_loader(make(str(tmp_path), batch_size=4, seed=1)).load_state_dict(state)


# a state saved by shardloader before plan signatures were derived from declared options
SAVED_BEFORE = {
    "version": 1,
    "epoch": 0,
    "position": 8,
    "seed": 1,
    "plan": "fixed(4);shuffle=ShuffleOptions(enabled=True, block=65536);uneven=pad",
}


def test_plan_signature_comes_from_declared_options_not_repr(uneven_zstd):
    """NOTE [plan signature]: numpy 2 prints ``np.int64(4)``; a custom repr prints anything."""

    class Shouting(sl.FixedBatches):
        def __repr__(self) -> str:
            return "FIXED!"

    def signature(**kw):
        return make(uneven_zstd, seed=1, shuffle=True, **kw).plan_signature

    plain = signature(planner=sl.FixedBatches(4))
    assert plain == (
        "FixedBatches(batch_size=4, drop_last=False);"
        "shuffle=ShuffleOptions(enabled=True, block=65536);uneven=pad"
    )
    assert signature(planner=sl.FixedBatches(np.int64(4))) == plain
    assert signature(planner=Shouting(4)) == plain.replace("FixedBatches", "Shouting")
    assert signature(planner=sl.FixedBatches(4, drop_last=True)) != plain
    assert signature(batch_size=np.int64(4)) == SAVED_BEFORE["plan"]


def test_a_state_saved_before_plan_signatures_still_loads(uneven_zstd):
    ds = make(uneven_zstd, batch_size=4, shuffle=True, seed=1)
    state = {**SAVED_BEFORE, "fingerprint": ds.manifest.fingerprint}
    loader = sl.make_loader(ds)
    loader.load_state_dict(state)
    resumed = real_ids(list(loader))
    full = real_ids(run_epoch(make(uneven_zstd, batch_size=4, shuffle=True, seed=1)))
    assert resumed == full[8 * 4 :]


def test_a_planner_without_declared_options_is_refused(uneven_zstd):
    class Opaque(BatchPlanner):
        def plan(self, order, lengths, rng):
            return [order[i : i + 4] for i in range(0, len(order), 4)]

    with pytest.raises(sl.UsageError, match="Opaque has no signature.*signature"):
        make(uneven_zstd, planner=Opaque())

    class Declared(Opaque):
        def signature(self) -> str:
            return "Declared(4)"

    assert make(uneven_zstd, planner=Declared()).plan_signature.startswith("Declared(4);")


def test_a_planner_says_what_it_lacks(uneven_zstd):
    """The core calls the members BatchPlanner declares and probes for none: a planner that is
    no BatchPlanner, or one without plan(), is refused when made, naming what is missing."""

    class Duck:
        needs_lengths = False

        def plan(self, order, lengths, rng):
            return [order]

        def signature(self) -> str:
            return "Duck()"

    with pytest.raises(sl.UsageError, match="Duck.*not a shardloader.batching.BatchPlanner"):
        make(uneven_zstd, planner=Duck())

    class NoPlan(BatchPlanner):
        def signature(self) -> str:
            return "NoPlan()"

    with pytest.raises(sl.UsageError, match="NoPlan does not define plan.*plan\\(order"):
        NoPlan()

    # one that defines only plan() gets every other member's default: a real epoch through
    # workers, a report, a ledger, no reshape
    class Fours(BatchPlanner):
        def plan(self, order, lengths, rng):
            return [order[i : i + 4] for i in range(0, len(order), 4)]

        def signature(self) -> str:
            return "Fours()"

    ds = make(uneven_zstd, planner=Fours())
    ids = real_ids(run_epoch(ds, 2))
    assert sorted(ids) == list(range(ds.manifest.num_samples))
    assert ds.report().steps_per_rank == -(-ds.manifest.num_samples // 4)
    assert ds.elastic_option is None and ds.ledger().entries == ()


class RecordRandomness:
    """A transform that uses all three global generators, as user augmentations do."""

    def __call__(self, sample):
        sample["torch"] = float(torch.rand(()))
        sample["numpy"] = float(np.random.rand())
        sample["random"] = random.random()
        return sample


def test_augmentation_seeded_per_step_whatever_num_workers(uneven_zstd):
    def draws(nw, epoch):
        ds = make(uneven_zstd, batch_size=4, shuffle=True, seed=9, transform=RecordRandomness())
        ds.set_epoch(epoch)
        return [
            (batch_ids(b), b["torch"].tolist(), b["numpy"].tolist(), b["random"].tolist())
            for b in run_epoch(ds, nw)
        ]

    a, b = draws(0, 0), draws(2, 0)
    assert a == b  # same draws for the same samples with 0 or 2 workers: reruns repeat exactly
    values = [v for step in a for v in step[1]]
    assert len(set(values)) == len(values)  # no two samples share an augmentation draw
    c = draws(2, 1)
    assert {v for s in c for v in s[1]}.isdisjoint(values)  # a new epoch draws anew


@pytest.mark.slow
def test_fields_decode_through_the_allowlist(tmp_path):
    import io

    from PIL import Image
    from synthetic import write_manifest, write_shard

    from shardloader.manifest import FieldInfo, Manifest

    buf = io.BytesIO()
    Image.new("RGB", (6, 4), (255, 0, 0)).save(buf, format="PNG")
    arr = io.BytesIO()
    np.save(arr, np.arange(3, dtype=np.int16), allow_pickle=False)
    fields = {
        "png": FieldInfo("image"),
        "npy": FieldInfo("npy"),
        "json": FieldInfo("json"),
        "pth": FieldInfo("opaque"),
        "tokens": FieldInfo("tokens", "uint16"),
    }
    values = {
        "png": buf.getvalue(),
        "npy": arr.getvalue(),
        "json": b'{"a": 1}',
        "pth": b"\x80\x04K\x01.",
        "tokens": np.array([1, 2, 65535], "<u2").tobytes(),
    }
    shard = write_shard(str(tmp_path), "s.tar", "tar", "none", fields, [("k/0", values)])
    write_manifest(str(tmp_path), Manifest("tar", "none", fields, [shard]))
    dec = sl.Decoder(custom={"pth": lambda b: len(b)})
    sample = next(iter(sl.ShardedDataset(str(tmp_path), decoder=dec)))
    assert sample["png"].dtype == torch.uint8 and tuple(sample["png"].shape) == (3, 4, 6)
    assert sample["png"][0].eq(255).all() and sample["png"][1].eq(0).all()
    assert sample["npy"].tolist() == [0, 1, 2] and sample["json"] == {"a": 1}
    assert sample["tokens"].tolist() == [1, 2, 65535] and sample["pth"] == 5
    # without a user decoder, pickled data is refused, and the error crosses the worker boundary
    with pytest.raises(sl.DecodeError, match=r"never unpickles.*Decoder\(custom="):
        list(sl.make_loader(sl.ShardedDataset(str(tmp_path)), num_workers=1))


@pytest.mark.slow
def test_truncated_shard_names_shard_and_worker(tmp_path):
    write_dataset(str(tmp_path), [10, 10])
    path = tmp_path / "shard-00001.tar"
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(sl.ShardError, match=r"shard-00001\.tar .*rank 0/1, worker 0/1.*truncated"):
        list(sl.make_loader(sl.ShardedDataset(str(tmp_path), batch_size=5), num_workers=1))


@pytest.mark.slow
def test_checksum_mismatch_and_skip(tmp_path):
    d = tmp_path / "ds"
    write_dataset(str(d), [10, 10, 10, 10], compression="zstd")
    shard = d / "shard-00001.tar.zst"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "c")))
    with pytest.raises(sl.ChecksumError, match=r"shard-00001\.tar\.zst.*sha256"):
        list(sl.make_loader(sl.ShardedDataset(str(d), batch_size=5, read=read), num_workers=1))
    ds = sl.ShardedDataset(str(d), batch_size=8, shuffle=True, read=read, on_error="skip")
    batches = list(sl.make_loader(ds, num_workers=2))
    assert len(batches) == 5 and all(len(batch_ids(b)) == 8 for b in batches)  # shapes kept
    assert sorted(real_ids(batches)) == list(range(10)) + list(range(20, 40))


@pytest.mark.slow
def test_memory_does_not_grow_across_epochs(uneven_zstd):
    psutil = pytest.importorskip("psutil")
    ds = make(uneven_zstd, batch_size=4, shuffle=True)
    loader = sl.make_loader(ds, num_workers=2, persistent_workers=True)

    def workers_rss():
        kids = psutil.Process().children(recursive=True)
        return sum(p.memory_info().rss for p in kids)

    for epoch in range(3):
        ds.set_epoch(epoch)
        list(loader)
    base = workers_rss()
    for epoch in range(3, 23):
        ds.set_epoch(epoch)
        list(loader)
    grown = workers_rss() - base
    assert grown < 8 << 20, f"workers grew by {grown / 2**20:.1f} MiB over 20 epochs"


def test_cache_limit_too_small_fails_at_start_and_bounded_cache_evicts(tmp_path):
    d = str(tmp_path / "ds")
    write_dataset(d, [30] * 8, compression="zstd")
    cache_dir = str(tmp_path / "cache")
    tiny = sl.ReadOptions(cache=sl.CacheOptions(dir=cache_dir, max_bytes=1000))
    with pytest.raises(sl.UsageError, match=r"cache limit 1,000 bytes is below"):
        next(iter(sl.ShardedDataset(d, batch_size=4, read=tiny)))
    manifest = sl.read_manifest(d)[0]
    shard_raw = max(s.raw_bytes for s in manifest.shards)
    # room for the unshuffled working set (2 shards + 1 ahead) but not the whole dataset
    bounded = sl.ReadOptions(
        cache=sl.CacheOptions(dir=cache_dir, max_bytes=4 * shard_raw), readahead=1
    )
    ds = sl.ShardedDataset(d, batch_size=4, read=bounded)
    assert sorted(real_ids(run_epoch(ds, 2))) == list(range(240))
    folder = os.path.join(cache_dir, manifest.fingerprint)
    staged = [f for f in os.listdir(folder) if f.endswith(".raw")]
    assert 0 < len(staged) <= 4  # evicted as it went, never above the limit
    assert os.path.exists(os.path.join(folder, ".shardloader-cache"))


def test_works_inside_a_users_own_dataloader(uneven_zstd):
    from torch.utils.data import DataLoader

    ds = make(uneven_zstd, shuffle=True, seed=4)  # unbatched: the user's loader batches
    loader = DataLoader(ds, batch_size=8, num_workers=3, persistent_workers=True)
    for epoch in range(2):
        ds.set_epoch(epoch)  # reaches persistent workers through the shared control block
        ids = [int(i) for b in loader for i in b["__index__"]]
        assert sorted(ids) == list(range(200))
    batched = make(uneven_zstd, batch_size=8, shuffle=True, seed=4)
    mine = [batch_ids(b) for b in DataLoader(batched, batch_size=None, num_workers=2)]
    assert mine == [batch_ids(b) for b in run_epoch(batched, 0)]


def test_where_am_i_is_one_value_and_the_old_keywords_warn(uneven_zstd, tmp_path):
    """rank/world_size/ranks_per_node/partition and aliases still work for a release, each
    with a DeprecationWarning naming its replacement, and plan exactly as the new values."""
    new = make(uneven_zstd, batch_size=4, shuffle=True, world=sl.World(1, 3, partition="rank"))
    with pytest.warns(
        DeprecationWarning, match=r"partition=\) is deprecated.*World\(rank=\.\.\., world_size"
    ):
        old = make(uneven_zstd, batch_size=4, shuffle=True, rank=1, world_size=3, partition="rank")
    assert (old.rank, old.world_size, old.partition) == (new.rank, new.world_size, new.partition)
    assert [b.tolist() for b in old.plan().batches] == [b.tolist() for b in new.plan().batches]
    with pytest.warns(DeprecationWarning, match=r"aliases=.*ReadOptions\(aliases="):
        make(uneven_zstd, aliases={"blob": ("bin",)})
    with pytest.warns(DeprecationWarning, match=r"World\.of\(group"):
        with pytest.raises(sl.UsageError, match="needs torch.distributed initialized"):
            make(uneven_zstd, data_parallel=object())
    with pytest.raises(sl.UsageError, match="pass world= or rank=, world_size=, not both"):
        make(uneven_zstd, rank=0, world_size=1, world=sl.World(0, 1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'ranks'"):
        make(uneven_zstd, ranks=2)
    assert len(inspect.signature(sl.ShardedDataset).parameters) - 1 <= 12  # **deprecated
