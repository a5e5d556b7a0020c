"""torchdata's StatefulDataLoader around a ShardedDataset resumes exactly, through the dataset's
own state_dict / load_state_dict that it calls in each worker (NOTE [worker states] in
shardloader/deliver/position.py).  Real StatefulDataLoader, real worker processes."""

from __future__ import annotations

import pytest
from helpers import write_dataset
from torchdata.stateful_dataloader import StatefulDataLoader

import shardloader as sl

SIZES = [13, 2, 40, 7]  # 62 samples, uneven: the last steps pad


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stateful"))
    write_dataset(path, SIZES)
    return path


def make(data, rank=0, world=1, **kw):
    kw.setdefault("batch_size", 4)
    return sl.ShardedDataset(data, shuffle=True, seed=3, world=sl.World(rank, world), **kw)


def seen(batch):
    return batch["__index__"].tolist(), batch["__pad__"].tolist()


def stateful(ds, workers):
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers)


def head_and_state(data, rank, world, workers, steps, epoch=1):
    ds = make(data, rank, world)
    ds.set_epoch(epoch)
    loader = stateful(ds, workers)
    if steps == 0:
        return [], loader.state_dict()
    head, state = [], None
    try:
        for step, batch in enumerate(loader):
            head.append(seen(batch))
            if step == steps - 1:
                state = loader.state_dict()
                break
    finally:
        end_workers(loader)
    return head, state


def resumed(data, rank, world, workers, state, epoch=1):
    ds = make(data, rank, world)
    loader = stateful(ds, workers)
    loader.load_state_dict(state)
    ds.set_epoch(epoch)
    try:
        return [seen(b) for b in loader]
    finally:
        end_workers(loader)


def end_workers(loader):
    """End a loader's workers now: a loop left early (or an error's traceback) keeps its
    iterator, and the garbage collector would shut them down later, inside another test."""
    shutdown = getattr(loader._iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloader_resumes_exactly(data, workers, caplog):
    """Every rank of 3, stopped after 0, 3 or all of its steps: the resumed loader yields
    exactly the batches an unbroken make_loader pass yields after them, from the dataset's
    state (torchdata does not re-read the skipped batches to fast-forward)."""
    world = 3
    for rank in range(world):
        ds = make(data, rank, world)
        ds.set_epoch(1)
        want = [seen(b) for b in sl.make_loader(ds)]
        for steps in (0, 3, len(want)):
            head, state = head_and_state(data, rank, world, workers, steps)
            assert head + resumed(data, rank, world, workers, state) == want, (rank, steps)
            inner = [state] if workers == 0 else state["_snapshot"]["_worker_snapshots"].values()
            assert all(s["dataset_state"]["seed"] == 3 for s in inner)
    assert not [r for r in caplog.records if "fast-forwarding" in r.getMessage()]


def test_without_workers_the_dataset_state_is_the_loaders(data):
    """num_workers=0: the dataset's state is make_loader's at every step but the last (and so
    resumes at another world size, as make_loader's does); after the last step it names the
    finished epoch at its end, where make_loader's names the next one."""
    ds, mine = make(data), make(data)
    ds.set_epoch(2)
    mine.set_epoch(2)
    theirs, ours = stateful(ds, 0), sl.make_loader(mine)
    steps = len(ours)
    for step, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        assert seen(a) == seen(b)
        inner, local = theirs.state_dict()["dataset_state"], ours.state_dict()
        if step < steps - 1:
            assert inner == local
    assert (local["epoch"], local["position"]) == (3, 0)  # NOTE [epoch boundaries]
    assert (inner["epoch"], inner["position"]) == (2, steps)  # epoch 2, at its end
    for world in (2, 3):  # the end of epoch 2 at any world size: nothing more of it
        again = make(data, world - 1, world)
        again.load_state_dict(inner)
        again.set_epoch(2)
        assert list(stateful(again, 0)) == []
    _, state = head_and_state(data, 0, 1, 0, 5, epoch=2)
    rest = [i for r in range(2) for i in ids(resumed(data, r, 2, 0, state, epoch=2))]
    first = ids([seen(b) for b in make_pass(data, 2)][:5])
    assert sorted(first + rest) == list(range(62))  # 1 rank -> 2 ranks: each sample once


def ids(batches):
    return [i for b, p in batches for i, pad in zip(b, p, strict=True) if not pad]


def make_pass(data, epoch):
    ds = make(data)
    ds.set_epoch(epoch)
    return sl.make_loader(ds)


@pytest.mark.slow
def test_a_worker_state_resumes_only_where_it_was_saved(data):
    _, state = head_and_state(data, 0, 1, 2, 3)
    with pytest.raises(sl.ResumeError, match="num_workers it saved at"):
        resumed(data, 0, 1, 3, state)  # 3 workers: worker 0 and 1 find another place
    with pytest.raises(sl.ResumeError, match="rank 0 of 1.*this is rank 1 of 2"):
        resumed(data, 1, 2, 2, state)
    with pytest.raises(sl.ResumeError, match=r"part-way through epoch 1.*set_epoch\(1\)"):
        resumed(data, 0, 1, 2, state, epoch=4)  # the rest of epoch 1 cannot be dropped
    ds = make(data)
    ds.set_epoch(1)
    whole = len(list(sl.make_loader(ds)))
    for steps in (whole - 1, whole):  # the last steps of epoch 1 handed out, by either worker
        head, state = head_and_state(data, 0, 1, 2, steps)
        assert resumed(data, 0, 1, 2, state) == [seen(b) for b in make_pass(data, 1)][steps:]
        # then the next epoch, from a state saved at the end of this one, in order: the
        # loader's round robin goes on at the next worker, which reads the first step
        if steps == whole:
            assert resumed(data, 0, 1, 2, state, epoch=2) == [seen(b) for b in make_pass(data, 2)]


def test_a_worker_state_is_refused_outside_its_worker(data):
    _, state = head_and_state(data, 0, 1, 0, 2)
    ds = make(data)
    with pytest.raises(sl.ResumeError, match="one DataLoader worker's"):
        ds.load_state_dict({**state["dataset_state"], "worker": {"id": 0}})
    with pytest.raises(sl.ResumeError, match="saved seed"):
        ds.load_state_dict({**state["dataset_state"], "seed": 99})
