"""The pass a stream reads: rank r's steps J.. of the pass from position P, exactly as a local
loader yields them (padding steps included), whatever J, P, W and the worker count."""

from __future__ import annotations

import os
import pickle

import pytest
from helpers import write_dataset
from test_service_support import UNEVEN, Noise, digest

import shardloader as sl
from shardloader.service.passes import pass_dataset, steps_of_pass


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("plan"))
    write_dataset(d, UNEVEN, compression="zstd")
    return d


def make(data, **kw):
    kw.setdefault("batch_size", 8)
    cache = sl.CacheOptions(dir=os.path.join(data, "_cache"))
    return sl.ShardedDataset(
        data,
        shuffle=True,
        seed=3,
        transform=Noise(),
        read=sl.ReadOptions(cache=cache),
        world=sl.World(0, 1),
        **kw,
    )


def local(ds, epoch, position, rank, world, num_workers=0):
    loader = sl.make_loader(ds.for_rank(rank, world), num_workers=num_workers)
    loader.load_state_dict({**loader.state_dict(), "epoch": epoch, "position": position})
    return [digest(b) for b in loader]


def streamed(view, num_workers=0):
    return [digest(b) for b in sl.make_loader(view, num_workers=num_workers)]


@pytest.mark.parametrize(("world", "position"), [(1, 0), (3, 0), (3, 6), (4, 1), (7, 20)])
def test_every_start_step_continues_the_same_sequence(data, world, position):
    ds = make(data)
    for rank in range(world):
        ref = local(ds, 2, position, rank, world)
        assert steps_of_pass(ds, 2, position, world) == len(ref)
        for skip in range(len(ref) + 1):
            assert streamed(pass_dataset(ds, 2, position, rank, world, skip)) == ref[skip:]


def test_seeking_continues_the_same_sequence_padding_included(data):
    """Padding depends only on the global slot, so seeking to position + J*W mid-pass gives
    exactly the batches an uninterrupted pass gives from step J, its padding step included."""
    ds = make(data)
    ref = local(ds, 0, 0, 2, 3)  # 25 batches: rank 2's last step repeats batch 26 - 25
    view = ds.for_rank(2, 3)
    view.seek(0, 3 * 3)
    assert streamed(view) == ref[3:]
    assert streamed(pass_dataset(ds, 0, 0, 2, 3, 3)) == ref[3:]


def test_workers_and_pickling_keep_the_cut(data):
    ds = make(data)
    ref = local(ds, 1, 0, 1, 3)
    assert streamed(pass_dataset(ds, 1, 0, 1, 3, 4), num_workers=2) == ref[4:]
    assert streamed(pickle.loads(pickle.dumps(pass_dataset(ds, 1, 0, 1, 3, 4)))) == ref[4:]


def test_unbatched_samples(data):
    ds = make(data, batch_size=None)
    ref = local(ds, 0, 0, 0, 2)
    assert len(ref) == 100
    assert streamed(pass_dataset(ds, 0, 0, 0, 2, 97)) == ref[97:]
