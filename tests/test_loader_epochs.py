"""Epoch boundaries of ShardLoader: a checkpoint after the last batch continues with the next
epoch, and a pass that ends short of its planned steps raises (real DataLoader workers)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import batch_ids, workers_left, write_dataset

import shardloader as sl

TESTS = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("epochs"))
    write_dataset(d, [13, 30, 7], compression="zstd")  # 50 samples
    return d


def make(data, **kw):
    cache = sl.CacheOptions(dir=os.path.join(data, "_cache"))
    return sl.ShardedDataset(
        data, batch_size=4, shuffle=True, seed=7, read=sl.ReadOptions(cache=cache), **kw
    )


def epochs_from(data, state, num_epochs, num_workers=2):
    """The README loop, resumed from ``state``: {epoch: [batch ids, ...]}."""
    ds = make(data)
    loader = sl.make_loader(ds, num_workers=num_workers)
    start = 0
    if state is not None:
        loader.load_state_dict(state)
        start = state["epoch"]
    seen = {}
    for epoch in range(start, num_epochs):
        ds.set_epoch(epoch)
        seen[epoch] = [batch_ids(b) for b in loader]
    return seen


@pytest.mark.parametrize("where", ["inside the loop", "after the loop"])
def test_a_checkpoint_after_the_last_batch_continues_with_the_next_epoch(data, where):
    reference = epochs_from(data, None, 3)
    ds = make(data)
    loader = sl.make_loader(ds, num_workers=2)
    ds.set_epoch(0)
    state = None
    for step, _ in enumerate(loader):
        if where == "inside the loop" and step == len(loader) - 1:
            state = loader.state_dict()  # right after the last step, before the loop ends
    if where == "after the loop":
        state = loader.state_dict()
    assert state["epoch"] == 1 and state["position"] == 0
    resumed = epochs_from(data, state, 3)
    assert sorted(resumed) == [1, 2]  # nothing more of epoch 0
    assert resumed[1] == reference[1] and resumed[2] == reference[2]


def test_a_checkpoint_one_step_before_the_end_keeps_the_epoch(data):
    ds = make(data)
    loader = sl.make_loader(ds, num_workers=2)
    ds.set_epoch(4)
    batches = []
    for batch in loader:
        batches.append(batch_ids(batch))
        if len(batches) == len(loader) - 1:
            state = loader.state_dict()
            break  # an early exit is not an error
    assert state["epoch"] == 4
    resumed = epochs_from(data, state, 5)
    assert resumed[4] == [batch_ids(b) for b in list(loader)][-1:]


def test_the_resume_point_and_global_batches_are_public(data):
    """The loader reaches the dataset's state through public methods only."""
    ds = make(data)
    loader = sl.make_loader(ds)
    assert ds.resume_point() == (0, 0) and ds.position == 0
    loader.load_state_dict({**loader.state_dict(), "epoch": 2, "position": 5})
    assert ds.resume_point() == (2, 5) and ds.position == 5 and ds.epoch == 2
    planned = ds.global_batches(2)
    assert [b.tolist() for b in planned] == [b.tolist() for b in ds.global_batches()]
    assert [batch_ids(b) for b in loader] == [b.tolist() for b in planned[5:]]
    assert ds.resume_point() == (2, 0)  # the pass is over: a re-run starts the epoch afresh
    assert sum(len(b) for b in planned) == 52  # 50 samples, the last batch filled up


class LockedBatch:
    """A collate whose batches hold a lock: a user error that torch's worker queue reports only
    as a traceback on stderr, dropping the batch."""

    def __call__(self, samples):
        return {"ids": [int(s["__index__"]) for s in samples], "lock": threading.Lock()}


@pytest.mark.slow
def test_a_pass_whose_batches_are_lost_raises(tmp_path):
    write_dataset(str(tmp_path), [20])
    ds = sl.ShardedDataset(str(tmp_path), batch_size=4, collate_fn=LockedBatch())
    loader = sl.make_loader(ds, num_workers=2)  # 5 steps: all requested before any arrives
    assert len(loader) == 5
    gc.disable()  # the workers end with the pass, not when the collector finds the traceback
    try:
        with pytest.raises(sl.IncompleteEpochError) as err:
            list(loader)
        assert not workers_left()
    finally:
        gc.enable()
    for part in ("yielded 0 of the 5 planned steps", "epoch 0", "rank 0/1", "num_workers=2"):
        assert part in str(err.value)


DEEP_TMPDIR = textwrap.dedent(
    """
    import sys
    import shardloader as sl
    ds = sl.ShardedDataset(sys.argv[1], batch_size=4)
    loader = sl.make_loader(ds, num_workers=2)
    try:
        n = sum(1 for _ in loader)
    except sl.UsageError as err:
        print("raised:", err, flush=True)
        sys.exit(3)
    print("yielded", n, "of", len(loader), flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_tmpdir_too_deep_for_worker_sockets_fails_at_start(tmp_path, data):
    """With TMPDIR deeper than an AF_UNIX socket path allows, torch cannot share a batch's
    tensors: each worker's queue drops the batch with a traceback on stderr, and the pass
    used to end early with exit code 0 (or hang, when it has more steps than are prefetched)."""
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    env = {
        **os.environ,
        "TMPDIR": str(deep),
        "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", DEEP_TMPDIR, data],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3, (proc.stdout, proc.stderr[-2000:])
    message = proc.stdout.split("raised:", 1)[1]
    for part in ("TMPDIR", str(deep), "AF_UNIX", "107"):
        assert part in message, message
