"""DataLoader workers started by fork, forkserver (Python 3.14's default on Linux) and spawn
yield the same batches: transforms, collates, the shared-memory ring and the service's
workers alike (NOTE [worker start methods] in shardloader/deliver/workers.py)."""

from __future__ import annotations

import os

import corpus
import pytest
from helpers import write_dataset
from test_service_support import (
    PATH_OPTIONS,
    ServerProcess,
    digest,
    local_batches,
    path_pipeline,
    server_env,
)

import shardloader as sl
from shardloader import vision
from shardloader.batching import PackedBatches, TokenBlocks
from shardloader.deliver import transport
from shardloader.pack import PackOptions, pack
from shardloader.service import RemoteLoader

METHODS = ["fork", "forkserver", "spawn"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("methods")
    corpus.class_folders(str(root / "raw"), per_class=3)
    pack(str(root / "raw"), str(root / "images"), PackOptions(shard_size=3000))
    texts = corpus.docs(40)
    corpus.jsonl(str(root / "text" / "docs.jsonl"), texts)
    tok = corpus.train_tokenizer(str(root / "tok.json"), texts)
    pack(str(root / "text"), str(root / "tar"), PackOptions(tokenizer=tok, shard_size=2000))
    options = PackOptions(format="tokens", tokenizer=tok, max_samples=10)
    pack(str(root / "text"), str(root / "tokens"), options)
    return str(root)


def pipelines(root):
    """(name, dataset factory): a seeded vision transform with the default collate, packed
    documents (PackCollate), and token rows handed over in bundles through the ring."""
    return [
        (
            "vision",
            lambda: sl.ShardedDataset(
                os.path.join(root, "images"),
                batch_size=2,
                shuffle=True,
                decoder=sl.Decoder(image="raw"),
                transform=vision.train_transform(8),
            ),
        ),
        (
            "packed",
            lambda: sl.ShardedDataset(
                os.path.join(root, "tar"),
                planner=PackedBatches(seq_len=16, rows_per_batch=2, pad_id=64),
                shuffle=True,
            ),
        ),
        (
            "ring",
            lambda: sl.ShardedDataset(
                os.path.join(root, "tokens"),
                planner=TokenBlocks(16, 2, pad_id=64),
                shuffle=True,
            ),
        ),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_every_start_method_yields_the_same_batches(packed, method, monkeypatch):
    monkeypatch.setattr(transport, "BUNDLE_BYTES", 2 * TokenBlocks(16, 2, 0).batch_bytes)
    for name, make in pipelines(packed):
        want = [digest(b) for b in sl.make_loader(make())]  # in this process
        loader = sl.make_loader(make(), num_workers=2, multiprocessing_context=method)
        assert [digest(b) for b in loader] == want, name
        if name == "ring":  # bundles came through the ring's shared slots
            assert loader.worker_init_fn.ring.received > 0


def local_transform(sample):
    return sample


def test_what_cannot_pickle_is_named_before_workers_start(tmp_path):
    data = str(tmp_path / "ds")
    write_dataset(data, [6])
    ds = sl.ShardedDataset(data, batch_size=2, transform=lambda s: s)
    with pytest.raises(sl.UsageError, match=r"by 'spawn'.*the dataset's transform.*lambda"):
        sl.make_loader(ds, num_workers=2, multiprocessing_context="spawn")

    def collate(samples):
        return samples

    fine = sl.ShardedDataset(data, batch_size=2, transform=local_transform)
    with pytest.raises(sl.UsageError, match=r"'forkserver'.*the loader's collate_fn"):
        sl.make_loader(
            fine, num_workers=1, multiprocessing_context="forkserver", collate_fn=collate
        )
    loader = sl.make_loader(ds, num_workers=1, multiprocessing_context="fork")  # inherited
    assert len(list(loader)) == 3


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("method", ["forkserver", "spawn"])  # fork: every other service test
def test_the_service_streams_the_same_batches_from_any_start_method(tmp_path, method):
    """``shardloader serve --workers 2`` whose workers start by ``method``: a RemoteLoader
    gets, byte for byte, what a local loader yields."""
    data, cache = str(tmp_path / "data"), str(tmp_path / "cache")
    write_dataset(data, [13, 2, 40, 7], compression="zstd")
    env = server_env(data, cache, SERVE_START_METHOD=method)
    args = [data, *PATH_OPTIONS, "--workers", "2", "--cache-dir", cache]
    server = ServerProcess(args, str(tmp_path), env, module="serve_start_method").wait_ready()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SERVICE_TEST_DATA", data)
            mp.setenv("SERVICE_TEST_CACHE", cache)
            want = [digest(b) for b in local_batches(path_pipeline, 1, 2, epoch=1)]
        loader = RemoteLoader(server.url, world=sl.World(1, 2))
        loader.set_epoch(1)
        assert [digest(b) for b in loader] == want
    finally:
        server.stop()
