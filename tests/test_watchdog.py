"""The hang watchdog (NOTE [stall watchdog] in shardloader/deliver/watchdog.py): a real DataLoader
worker stuck in a transform ends the pass with a StallError naming rank, worker, shard, sample
and the stuck stack, instead of hanging; a pass that rests between batches is never stalled."""

from __future__ import annotations

import signal
import threading
import time

import pytest
from helpers import write_dataset

import shardloader as sl

STUCK = "s/000050"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("watchdog"))
    write_dataset(d, [40] * 4, compression="zstd")
    return d


def hangs_on_one(sample):
    """A transform that never returns on one sample (it sleeps "forever")."""
    if sample["__key__"] == STUCK:
        time.sleep(3600)
    return sample


def deaf_on_one(sample):
    """Stuck where no signal reaches (C code that blocks them): the worker cannot be
    interrupted, only ended."""
    if sample["__key__"] == STUCK:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGRTMIN + 5})
        time.sleep(3600)
    return sample


def keys(samples):
    return [s["__key__"] for s in samples]


def dataset(data, transform=None, **read):
    return sl.ShardedDataset(
        data,
        batch_size=4,
        transform=transform,
        collate_fn=keys,
        read=sl.ReadOptions(cache=sl.CacheOptions(dir=f"{data}/_cache"), **read),
    )


@pytest.mark.slow
@pytest.mark.timeout(90)  # the bound: a hang fails the test instead of passing it
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stuck_worker_ends_the_pass_with_its_shard_sample_and_stack(data, workers):
    ds = dataset(data, hangs_on_one, stall_timeout=1.5)
    got = []
    with pytest.raises(sl.StallError) as caught:
        for batch in sl.make_loader(ds, num_workers=workers):
            got += batch
    message = str(caught.value)
    assert STUCK not in got
    worker = 50 // 4 % workers if workers else 0
    assert f"worker {worker}/{max(workers, 1)}" in message and "rank 0/1" in message
    assert "shard-00001.tar.zst" in message and f"sample {STUCK!r}" in message
    assert "stall_timeout" in message
    # the stuck thread's Python stack, as faulthandler dumps it: down to the sleeping transform
    assert "most recent call first" in message and "in hangs_on_one" in message
    assert isinstance(caught.value, sl.ShardloaderError) and isinstance(caught.value, TimeoutError)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_that_cannot_be_interrupted_exits_and_the_loop_gets_the_stall_error(data):
    ds = dataset(data, deaf_on_one, stall_timeout=1)
    with pytest.raises(sl.StallError) as caught:
        for _ in sl.make_loader(ds, num_workers=2):
            pass
    message = str(caught.value)
    assert f"sample {STUCK!r}" in message and "shard-00001.tar.zst" in message
    assert "in deaf_on_one" in message and "could not be interrupted" in message
    assert isinstance(caught.value.__cause__, RuntimeError)  # torch's "worker ... exited"


@pytest.mark.slow
def test_a_pass_that_rests_between_batches_is_not_stalled(data):
    """Only the time the pass is asked for a batch counts: a slow training step is no stall."""
    ds = dataset(data, stall_timeout=0.5)
    seen = []
    for batch in sl.make_loader(ds, num_workers=1):
        seen += batch
        if len(seen) <= 12:
            time.sleep(1.2)  # the consumer is slow; the worker waits with full queues
    assert len(seen) == 160


def test_the_signal_handler_is_the_callers_again_after_the_pass(data):
    number = signal.SIGRTMIN + 5
    before = signal.getsignal(number)
    assert len(list(sl.make_loader(dataset(data, stall_timeout=30), num_workers=0))) == 40
    assert signal.getsignal(number) == before
    assert not [t for t in threading.enumerate() if t.name == "shardloader-watchdog"]


@pytest.mark.parametrize("value", [0, -1, float("nan"), "5", True])
def test_a_bad_stall_timeout_is_refused(value):
    with pytest.raises(sl.UsageError, match="stall_timeout"):
        sl.ReadOptions(stall_timeout=value)
