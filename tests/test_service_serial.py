"""Streams of a ``--workers 0`` server share one process's global RNGs (NOTE [serial pipeline] in
shardloader/service/passes.py): a pipeline whose code may draw from them runs one batch at a
time, so concurrent streams still yield a local loader's batches byte for byte; a pipeline that
draws nothing from them needs no lock."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest
import torch
from helpers import write_dataset
from test_service_support import InProcessServer, Noise, digest

import shardloader as sl
from shardloader.collate import PadCollate, collate_samples
from shardloader.read.loading import pipeline_draws


class SlowNoise:
    """Draws from the global generator, sleeps, draws again: another thread's batch that
    reseeds the global RNGs in between would change the second draw."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        first = torch.randint(0, 1 << 30, (2,))
        time.sleep(0.002)  # lets the other streams' producer threads run
        out = dict(sample)
        out["noise"] = torch.cat([first, torch.randint(0, 1 << 30, (2,))])
        return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("serial"))
    write_dataset(d, [24, 24], compression="zstd")  # staged: the streams share the node cache
    return d


def dataset(data: str, **kw: Any) -> sl.ShardedDataset:
    return sl.ShardedDataset(data, batch_size=4, shuffle=True, seed=11, world=sl.World(0, 1), **kw)


@pytest.mark.parametrize("transform", [SlowNoise(), None], ids=["global-rng", "none"])
def test_concurrent_streams_equal_local_batches(data, tmp_path, transform):
    """With a transform that draws from the global RNGs (streams take turns), and without one
    (streams run in parallel, staging shards into the same cache at once)."""

    def read(folder: str) -> sl.ReadOptions:
        return sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / folder)))

    world = 3
    mine = dataset(data, transform=transform, read=read("mine"))
    want = {r: [digest(b) for b in sl.make_loader(mine.for_rank(r, world))] for r in range(world)}
    ds = dataset(data, transform=transform, read=read("served"))
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    with InProcessServer(ds, workers=0, max_inflight=1) as server:

        def stream(rank: int) -> None:
            try:
                loader = sl.RemoteLoader(server.url, world=sl.World(rank, world), prefetch=1)
                got[rank] = [digest(b) for b in loader]
            except BaseException as err:  # reported below, in the test's thread
                errors.append(err)

        readers = [threading.Thread(target=stream, args=(r,)) for r in range(world)]
        for t in readers:
            t.start()
            time.sleep(0.01)  # a stream starts while the others are mid-batch
        for t in readers:
            t.join(120)
    assert not errors, errors
    assert all(len(want[r]) == 4 for r in range(world))
    assert got == want


def needs_serial_pipeline(ds: sl.ShardedDataset) -> bool:
    """The rule a stream takes the lock by (shardloader/service/stream.py)."""
    return pipeline_draws(ds.transform, ds.decoder, ds.collate_fn)


def test_only_pipelines_with_code_that_may_draw_from_global_rngs_run_serially(data):
    assert not needs_serial_pipeline(dataset(data))
    assert not needs_serial_pipeline(dataset(data, collate_fn=PadCollate()))
    assert not needs_serial_pipeline(
        dataset(data, collate_fn=functools.partial(collate_samples, ragged="list"))
    )
    assert needs_serial_pipeline(dataset(data, transform=Noise()))
    assert needs_serial_pipeline(dataset(data, collate_fn=lambda samples: samples))
    custom = sl.Decoder(custom={"bin": bytes.upper})
    assert needs_serial_pipeline(dataset(data, decoder=custom))


def test_shardloader_transforms_alone_need_no_lock(data):
    """vision's transforms draw from the per-batch generator, so they don't serialize streams;
    a user callable wrapped in them still does."""
    from shardloader import vision

    own = vision.train_transform(8, field="bin")
    assert not needs_serial_pipeline(dataset(data, transform=own))
    wrapped = vision.ApplyTo("bin", vision.Compose([vision.RandomHorizontalFlip(), Noise()]))
    assert needs_serial_pipeline(dataset(data, transform=wrapped))
