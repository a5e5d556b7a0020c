"""Elastic resume at sample granularity: a resume may change the batch shape (2 ranks x 6 ->
3 ranks x 4 keeps the global batch of 12); the rest of the epoch is re-cut for the new shape,
no sample (no token, for packed and token-budget batches) repeated or skipped.  Real
DataLoader workers; the planner chain also as a pure property test."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from helpers import batch_ids, torchrun, write_dataset
from helpers import own_cache_dataset as make
from hypothesis import given, settings
from hypothesis import strategies as st

import shardloader as sl
from shardloader.batching import PackedBatches, TokenBudgetBatches
from shardloader.plan.epoch import EpochPlanner
from shardloader.plan.shuffle import ShuffleOptions

SIZES = [1, 120, 3, 17, 59]  # 200 samples, uneven (an empty shard has no lengths)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("elastic"))
    write_dataset(d, SIZES, compression="zstd")
    return d


def real_ids(batches):
    return [
        i
        for b in batches
        for i, p in zip(batch_ids(b), b["__pad__"].tolist(), strict=True)
        if not p
    ]


def spans(samples):
    """A collate that keeps what the plan cut: (id, start, stop, pad) per segment."""
    return [(int(s["__index__"]), *s.get("__span__", (0, 0)), bool(s["__pad__"])) for s in samples]


def checkpoint(path, world, workers, steps, epoch=1, **kw):
    """Run every rank of ``world`` for ``steps`` steps; return what they saw and the state."""
    seen, states = [], []
    for rank in range(world):
        ds = make(path, world=sl.World(rank, world), **kw)
        ds.set_epoch(epoch)
        loader = sl.make_loader(ds, num_workers=workers)
        for step, batch in enumerate(loader):
            seen.append(batch)
            if step == steps - 1:
                states.append(loader.state_dict())
                break
    assert all(s == states[0] for s in states)  # the state is rank-agnostic
    return seen, states[0]


def resume(path, state, world, workers, epoch=1, stop_after=None, **kw):
    """Resume every rank of ``world`` from ``state``; what they saw, and (with
    ``stop_after``) the state after that many steps."""
    seen, states, lens = [], [], set()
    for rank in range(world):
        ds = make(path, world=sl.World(rank, world), **kw)
        loader = sl.make_loader(ds, num_workers=workers)
        loader.load_state_dict(state)
        ds.set_epoch(epoch)  # the usual loop: the loaded position and reshapes survive
        lens.add(len(loader))
        for step, batch in enumerate(loader):
            seen.append(batch)
            if stop_after is not None and step == stop_after - 1:
                states.append(loader.state_dict())
                break
    assert len(lens) == 1  # equal steps on every rank
    return seen, (states[0] if states else None)


@pytest.mark.parametrize(
    "w1,b1,k1,w2,b2,k2",
    [(2, 6, 2, 3, 4, 2), (2, 6, 0, 1, 8, 2), (3, 4, 1, 2, 5, 0), (1, 7, 2, 4, 3, 1)],
)
def test_the_batch_size_may_change_at_a_resume(data, w1, b1, k1, w2, b2, k2):
    first, state = checkpoint(data, w1, k1, 3, batch_size=b1, shuffle=True, seed=21)
    assert state["position"] == 3 * w1 and state["reshapes"] == []  # an ordinary state
    rest, _ = resume(data, state, w2, k2, batch_size=b2, shuffle=True, seed=21)
    assert all(len(batch_ids(b)) == b2 for b in rest)  # always the new, full shape
    assert Counter(real_ids(first + rest)) == Counter(range(200))  # once each, none skipped
    # the rest is the order's remainder cut anew: what an unbroken run at b1 had not reached
    order = [
        i
        for b in make(data, batch_size=b1, shuffle=True, seed=21).global_batches(1)
        for i in b.tolist()
    ]
    order = list(dict.fromkeys(order))  # without the last batch's padding
    assert sorted(real_ids(rest)) == sorted(order[3 * w1 * b1 :])


def test_shape_changes_chain_within_an_epoch(data):
    """2 x 6 -> 3 x 4 -> 4 x 3 -> 1 x 12: each resume re-cuts what is left."""
    kw = dict(shuffle=True, seed=5)
    seen, state = checkpoint(data, 2, 2, 2, batch_size=6, **kw)
    more, state = resume(data, state, 3, 1, stop_after=3, batch_size=4, **kw)
    seen += more
    assert state["version"] == 2 and state["reshapes"] == [[6, 4]] and state["position"] == 9
    more, state = resume(data, state, 4, 2, stop_after=2, batch_size=3, **kw)
    seen += more
    assert state["reshapes"] == [[6, 4], [4, 9]] and state["position"] == 8
    more, _ = resume(data, state, 1, 2, batch_size=12, **kw)
    assert Counter(real_ids(seen + more)) == Counter(range(200))
    ds = make(data, batch_size=12, **kw)
    loader = sl.make_loader(ds)
    loader.load_state_dict(state)
    report = ds.report()  # the whole epoch over every link: padding only in the last one
    left = 200 - (2 * 2 * 6 + 9 * 4 + 8 * 3)
    assert report.steps_per_rank == -(-left // 12) and report.dropped_samples == 0
    assert report.padded_samples == -left % 12


def test_a_token_budget_may_change_at_a_resume(data):
    """Samples stay whole; the rest is re-planned under the new budget."""
    kw = dict(shuffle=True, seed=2, collate_fn=spans)
    first, state = checkpoint(data, 2, 2, 2, planner=TokenBudgetBatches(600, window=32), **kw)
    rest, _ = resume(data, state, 3, 1, planner=TokenBudgetBatches(400, window=32), **kw)
    real = [i for b in first + rest for i, _, _, pad in b if not pad]
    assert Counter(real) == Counter(range(200))


def test_packed_segments_are_re_planned_token_by_token(data):
    """rows_per_batch 6 at 2 ranks -> 4 at 3 ranks: every byte of the length field once."""
    full = sl.ShardedDataset(data, decoder=None)
    lengths = {int(sample["__index__"]): len(sample["bin"]) for sample in full}
    kw = dict(shuffle=True, seed=9, collate_fn=spans)
    old = PackedBatches(seq_len=64, rows_per_batch=6, window=16, fit="best")
    new = PackedBatches(seq_len=64, rows_per_batch=4, window=16, fit="best")
    first, state = checkpoint(data, 2, 2, 3, planner=old, **kw)
    rest, _ = resume(data, state, 3, 2, planner=new, **kw)
    covered = {i: np.zeros(n, np.int64) for i, n in lengths.items()}
    for b in first + rest:
        for i, a, z, pad in b:
            if not pad:
                covered[i][a:z] += 1
    assert all((c == 1).all() for c in covered.values())  # every token once, none skipped
    ds = make(data, planner=new, **kw)
    loader = sl.make_loader(ds)
    loader.load_state_dict(state)
    report = ds.report()
    assert report.tokens == sum(lengths.values()) and report.dropped_tokens == 0


def test_only_the_elastic_option_may_change(data):
    state = checkpoint(data, 2, 0, 1, batch_size=6, shuffle=True, seed=1)[1]
    with pytest.raises(sl.ResumeError, match="only batch_size may change"):
        sl.make_loader(make(data, batch_size=4, seed=1)).load_state_dict(state)  # no shuffle
    planner = PackedBatches(seq_len=64, rows_per_batch=6)
    state = checkpoint(data, 1, 0, 1, planner=planner, collate_fn=spans)[1]
    with pytest.raises(sl.ResumeError, match="only rows_per_batch may change"):
        sl.make_loader(
            make(data, planner=PackedBatches(seq_len=32, rows_per_batch=6), collate_fn=spans)
        ).load_state_dict(state)
    bad = {**state, "version": 2, "reshapes": [[6, 10_000]]}
    loader = sl.make_loader(make(data, planner=planner, collate_fn=spans))
    with pytest.raises(sl.ResumeError, match="10000 batches consumed"):
        loader.load_state_dict(bad)
    assert loader.dataset.reshapes == () and loader.dataset.position == 0
    with pytest.raises(sl.ResumeError, match="version 99"):
        loader.load_state_dict({**state, "version": 99})


def test_a_state_saved_before_reshapes_changes_shape_too(data):
    """A version-1 state (no reshape history, before this feature) is re-cut as well."""
    ds = make(data, batch_size=4, shuffle=True, seed=1)
    old = {
        "version": 1,
        "epoch": 0,
        "position": 8,
        "seed": 1,
        "plan": "fixed(4);shuffle=ShuffleOptions(enabled=True, block=65536);uneven=pad",
        "fingerprint": ds.manifest.fingerprint,
    }
    full = [i for b in ds.global_batches(0) for i in b.tolist()]
    resumed = make(data, batch_size=8, shuffle=True, seed=1)
    loader = sl.make_loader(resumed, num_workers=2)
    loader.load_state_dict(old)
    assert sorted(real_ids(list(loader))) == sorted(full[32:])


# -- the chain, pure ---------------------------------------------------------------------------

planners_st = st.sampled_from(["fixed", "budget", "packed", "packed-best", "packed-drop"])


def _planning(kind: str, shape: int, sizes) -> EpochPlanner:
    shuffle = ShuffleOptions(True, block=64)
    if kind == "fixed":
        return EpochPlanner(np.asarray(sizes), 3, shuffle, "pad", batch_size=shape)
    if kind == "budget":
        planner = TokenBudgetBatches(40 * shape, window=16, oversize="truncate")
    else:
        long = "drop" if kind == "packed-drop" else "split"
        fit = "best" if kind == "packed-best" else "first"
        planner = PackedBatches(24, shape, window=8, long_docs=long, fit=fit)
    return EpochPlanner(np.asarray(sizes), 3, shuffle, "pad", planner=planner)


@settings(deadline=None, max_examples=60)
@given(
    planners_st,
    st.lists(st.integers(0, 40), min_size=1, max_size=5),
    st.lists(st.tuples(st.integers(1, 6), st.floats(0, 1)), min_size=1, max_size=4),
    st.integers(1, 6),
    st.integers(0, 2**31),
)
def test_a_chain_of_shapes_delivers_each_sample_and_token_once(kind, sizes, links, last, seed):
    rng = np.random.default_rng(seed)
    n = sum(sizes)
    lengths = rng.integers(0, 60, n).astype(np.int64)
    history: list[tuple[int, int]] = []
    for shape, share in links:
        plan = _planning(kind, shape, sizes).plan(1, 0, 0, 1, lengths, tuple(history))
        history.append((shape, int(share * max(plan.num_batches - 1, 0))))
    planning = _planning(kind, last, sizes)
    plan = planning.plan(1, 0, 0, 1, lengths, tuple(history))
    earlier = [b for _, taken in plan.earlier for b in taken]
    assert [len(t) for _, t in plan.earlier] == [c for _, c in history]
    report = planning.report(1, plan, lengths, None)
    batches = earlier + plan.batches
    if kind == "fixed":
        pads = plan.pad_in_last
        ids = np.concatenate(batches) if batches else np.zeros(0, np.int64)
        real = ids[: ids.size - pads]
        assert sorted(real.tolist()) == list(range(n))
        assert report.padded_samples == pads
        return
    covered = [np.zeros(int(x), np.int64) for x in lengths]
    seen = Counter()
    for b in batches:
        if b.ndim == 2:
            for i, a, z in b.tolist():
                covered[i][a:z] += 1
        else:
            for i in b.tolist():
                seen[i] += 1
                covered[i][: min(int(lengths[i]), 40 * last)] += 1
    if kind == "budget":  # whole samples: none twice, and none missing but oversize drops
        assert all(c <= 1 for c in seen.values())
        assert set(range(n)) - set(seen) == set()  # oversize="truncate" drops nothing
    assert all(int(c.max(initial=0)) <= 1 for c in covered)  # no token twice
    assert report.total_tokens == int(lengths.sum())
    delivered = sum(int(c.sum()) for c in covered)
    if kind in ("packed", "packed-best"):  # nothing cut: every token once
        assert delivered == int(lengths.sum()) == report.tokens
    if kind == "packed-drop":
        assert delivered == report.tokens


# -- a real gloo run ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["fixed", "packed"])
def test_torchrun_two_ranks_resume_at_three_with_the_global_batch_kept(data, tmp_path, mode):
    """2 ranks x 6 (packed: 6 rows) with workers, checkpoint; 3 ranks x 4 resume: gloo."""
    state_file, outs = str(tmp_path / "state.json"), []
    for world, shape in ((2, 6), (3, 4)):
        out = str(tmp_path / f"seen{world}.json")
        torchrun(
            str(tmp_path), "dist_elastic_job.py", world, data, mode, str(shape), state_file, out
        )
        with open(out) as f:
            outs.append(json.load(f))
    saw_first, saw_rest = outs
    steps = {len(r["segments"]) for r in saw_rest}
    assert len(steps) == 1 and steps == {r["len"] for r in saw_rest}  # equal steps per rank
    pieces = [
        tuple(s) for run in outs for r in run for batch in r["segments"] for s in batch if not s[3]
    ]
    if mode == "fixed":
        counts = Counter(i for i, *_ in pieces)
        assert counts == Counter(range(200)), (
            f"ids not once: {counts - Counter(range(200))}; {outs}"
        )
    else:
        lengths = saw_rest[0]["lengths"]
        covered = {int(i): np.zeros(n, np.int64) for i, n in lengths.items()}
        for i, a, z, _ in pieces:
            covered[i][a:z] += 1
        wrong = {
            i: np.flatnonzero(c != 1).tolist()[:8] for i, c in covered.items() if (c != 1).any()
        }
        assert not wrong, f"tokens not delivered exactly once (id: positions): {wrong}; {outs}"


def draw(sample):
    """A transform drawing from torch's global generator (seeded per batch)."""
    import torch

    sample["draw"] = float(torch.rand(()))
    return sample


def test_augmentation_after_a_reshape_draws_fresh_numbers(data):
    """The rest's steps count from 0 again: their seeds must not be the epoch's first ones."""
    kw = dict(shuffle=True, seed=13, transform=draw, decoder=None)
    first, state = checkpoint(data, 1, 0, 4, batch_size=6, **kw)
    rest, _ = resume(data, state, 1, 2, batch_size=4, **kw)
    again, _ = resume(data, state, 1, 0, batch_size=4, **kw)
    assert [b["draw"].tolist() for b in rest] == [b["draw"].tolist() for b in again]  # seeded
    firsts = {float(b["draw"][0]) for b in first}
    assert not firsts & {float(b["draw"][0]) for b in rest}
