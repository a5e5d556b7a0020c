"""Mixtures: the blend keeps every prefix within one sample of the weights, each source's own
epochs hold every sample exactly once, and the mixed stream keeps every guarantee of a single
dataset (planners, ranks, workers, resume, weight changes at a resume, report)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import write_dataset, write_datasets
from hypothesis import given, settings
from hypothesis import strategies as st

import shardloader as sl
from shardloader.batching import BucketBatches, PackedBatches, TokenBudgetBatches
from shardloader.mixture import Source
from shardloader.plan.blend import MAX_PARTS, MixOrder, blend_counts, blend_period, integer_parts
from shardloader.plan.shuffle import ShuffleOptions
from shardloader.read.lengths import load_lengths

SIZES = {"a": [7, 5, 9], "b": [4, 4], "c": [3]}  # 21, 8 and 3 samples


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_datasets(str(tmp_path_factory.mktemp("mix")), SIZES)


def lengths_of(sources: dict[str, str]) -> np.ndarray:
    """Every sample's recorded length, by virtual id (sources in order)."""
    parts = []
    for url in sources.values():
        manifest, base = sl.read_manifest(url)
        parts.append(load_lengths(manifest, base, sl.ReadOptions()))
    return np.concatenate(parts)


def prefix_error(sources: np.ndarray, parts: tuple[int, ...]) -> float:
    """Largest ``|count_s(n) - w_s n|`` over every prefix ``n`` and source ``s``."""
    k = len(parts)
    counts = np.cumsum(np.eye(k, dtype=np.int64)[sources], axis=0)
    n = np.arange(1, len(sources) + 1)[:, None]
    weights = np.asarray(parts, float) / sum(parts)
    return float(np.abs(counts - weights[None, :] * n).max())


# -- the blend (pure) -----------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=7).filter(lambda p: sum(p) > 0))
def test_blend_stays_within_one_sample_of_the_weights(parts):
    parts = tuple(parts)
    period = blend_period(parts)
    assert np.bincount(period, minlength=len(parts)).tolist() == list(parts)
    stream = np.tile(period, 3)
    assert prefix_error(stream, parts) <= 1.0 + 1e-9
    for n in (0, 1, len(period) - 1, len(period), 2 * len(period) + 1):
        assert (
            blend_counts(parts, n).tolist()
            == np.bincount(stream[:n], minlength=len(parts)).tolist()
        )


def test_megatron_greedy_drifts_past_one_sample_where_the_blend_does_not():
    """Why the blend is not the greedy rule: with six sources the greedy rule (the source
    furthest below w (n + 1)) ends up more than one sample off; the blend never does."""
    parts = (4, 5, 5, 25, 25, 25)  # found by search; most weights stay within one
    weights = np.asarray(parts) / sum(parts)
    counts, greedy = np.zeros(len(parts)), []
    for n in range(2 * sum(parts)):
        s = int(np.argmax(weights * (n + 1) - counts))
        counts[s] += 1
        greedy.append(s)
    assert prefix_error(np.array(greedy), parts) > 1.0
    assert prefix_error(np.tile(blend_period(parts), 2), parts) <= 1.0


def test_weights_become_exact_integer_parts():
    assert integer_parts([0.7, 0.3]) == (7, 3)
    assert integer_parts([60, 25, 15]) == (12, 5, 3)
    assert integer_parts([1, 0]) == (1, 0)
    parts = integer_parts([0.6180339887, 0.3819660113])
    assert sum(parts) <= MAX_PARTS and abs(parts[0] / sum(parts) - 0.6180339887) < 1e-4
    for bad in ([-1, 1], [0, 0], [float("nan"), 1], [True, 1], ["1", 1]):
        with pytest.raises(sl.UsageError):
            integer_parts(bad)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=3), min_size=1, max_size=4),
    data=st.data(),
)
def test_each_source_epoch_holds_every_sample_once_across_mixture_epochs(sizes, data):
    k = len(sizes)
    epoch_samples = data.draw(st.integers(1, 40))
    epochs = data.draw(st.integers(1, 6))
    parts_st = st.lists(st.integers(0, 9), min_size=k, max_size=k).filter(lambda p: sum(p) > 0)
    changes = sorted(set(data.draw(st.lists(st.integers(1, epochs), max_size=2))))
    schedule = tuple((e, tuple(data.draw(parts_st))) for e in [0, *changes])
    shuffled = data.draw(st.booleans())
    mix = MixOrder(
        tuple(tuple(s) for s in sizes),
        tuple(range(10, 10 + k)),
        (ShuffleOptions(shuffled, block=5),) * k,
        epoch_samples,
        schedule,
    )
    offsets = np.concatenate([[0], np.cumsum([sum(s) for s in sizes])])
    stream = np.concatenate([mix.order(e) for e in range(epochs)])
    assert len(stream) == epochs * epoch_samples
    source = np.searchsorted(offsets, stream, side="right") - 1
    assert (source == np.concatenate([mix.sources(e) for e in range(epochs)])).all()
    for s in range(k):  # its own epochs: consecutive permutations of all its samples
        own = stream[source == s] - offsets[s]
        size = sum(sizes[s])
        for lo in range(0, len(own), size):
            chunk = own[lo : lo + size]
            assert len(set(chunk.tolist())) == len(chunk) and chunk.max() < size
    bounds = [e for e, _ in schedule[1:]] + [epochs]
    for (start, parts), stop in zip(schedule, bounds, strict=True):  # each segment's blend
        segment = source[start * epoch_samples : stop * epoch_samples]
        if len(segment):
            assert prefix_error(segment, parts) <= 1.0 + 1e-9
    cursors = mix.cursors(epochs)
    assert cursors.tolist() == np.bincount(source, minlength=k).tolist()


# -- the mixed dataset ---------------------------------------------------------------------
def delivered(ds, epoch, world, start=0):
    """Every rank's non-padding ids of a pass, read without workers (rank-major lists)."""
    out = []
    for rank in range(world):
        view = ds.for_rank(rank, world)
        view.seek(epoch, start)
        ids = []
        for batch in view:
            ids += [token_share(s) for s in batch if not s["__pad__"]]
        out.append(ids)
    return out


def token_share(sample):
    """A sample's id, or for a segment of a packed batch (id, tokens in it)."""
    span = sample.get("__span__")
    return sample["__index__"] if span is None else (sample["__index__"], span[1] - span[0])


PLANNERS = {
    "fixed": {"batch_size": 3},
    "bucket": {"planner": BucketBatches(batch_size=3, window=8)},
    "budget": {"planner": TokenBudgetBatches(max_tokens=600, window=8)},
    "packed": {"planner": PackedBatches(seq_len=80, rows_per_batch=2, window=8)},
}


@pytest.mark.parametrize("planner", sorted(PLANNERS))
@pytest.mark.parametrize(
    ("world", "weights", "epoch_samples"),
    [(1, (7, 3, 1), 30), (3, (1, 1, 2), 50), (2, (5, 0, 1), 17)],
)
def test_every_planned_position_arrives_once_on_every_world_size(
    sources, planner, world, weights, epoch_samples
):
    mix = sl.Mixture(
        sources,
        dict(zip(SIZES, weights, strict=True)),
        epoch_samples=epoch_samples,
        shuffle=True,
        seed=5,
        collate_fn=list,
        uneven="pad",
        **PLANNERS[planner],
    )
    for epoch in (0, 1):
        order = mix.order(epoch)
        got = [i for ids in delivered(mix, epoch, world) for i in ids]
        if planner == "packed":  # every token once: a document's segments add up to it
            lengths = lengths_of(sources)
            tokens = np.zeros(len(lengths), np.int64)
            np.add.at(tokens, [i for i, _ in got], [n for _, n in got])
            want = np.bincount(order, minlength=len(tokens)) * lengths
            assert tokens.tolist() == want.tolist()
        else:
            assert sorted(got) == sorted(order.tolist())
        steps = {len(mix.for_rank(r, world)) for r in range(world)}
        assert len(steps) == 1  # equal steps per rank
        counts = mix.report(epoch).sources
        assert sum(c.planned for c in counts.values()) == epoch_samples


@pytest.mark.parametrize(("before", "after", "k"), [(2, 3, 2), (3, 1, 1), (1, 2, 3)])
def test_resume_on_another_world_size_continues_exactly(sources, before, after, k):
    kw = {"epoch_samples": 40, "shuffle": True, "seed": 2, "batch_size": 2, "collate_fn": list}
    weights = {"a": 2, "b": 1, "c": 1}
    whole = sl.Mixture(sources, weights, **kw)
    full = sorted(i for ids in delivered(whole, 0, 1) for i in ids)
    first = sl.Mixture(sources, weights, **kw)
    seen = []
    for rank in range(before):  # k steps on each rank of the first run
        loader = sl.make_loader(first.for_rank(rank, before))
        for step, batch in enumerate(loader):
            seen += [s["__index__"] for s in batch if not s["__pad__"]]
            if step + 1 == k:
                state = loader.state_dict()
                break
    second = sl.Mixture(sources, weights, **kw)
    sl.make_loader(second).load_state_dict(state)
    epoch, position = second.resume_point()
    assert (epoch, position) == (0, k * before)
    seen += [i for ids in delivered(second, 0, after, position) for i in ids]
    assert sorted(seen) == full


@pytest.mark.parametrize("planner", ["fixed", "packed"])
def test_a_resume_that_keeps_the_global_batch_reads_the_mixture_once(sources, planner):
    """2 ranks x 6 -> 3 ranks x 4 (packed: 2 x 3 rows -> 3 x 2): the rest of the mixture
    epoch is re-cut from the blend, never from a source's own order (each sample, each token,
    once)."""
    weights = {"a": 2, "b": 1, "c": 1}
    shapes = {
        "fixed": ({"batch_size": 6}, {"batch_size": 4}),
        "packed": (
            {"planner": PackedBatches(seq_len=8, rows_per_batch=3, window=4)},
            {"planner": PackedBatches(seq_len=8, rows_per_batch=2, window=4)},
        ),
    }[planner]
    kw = {"epoch_samples": 60, "shuffle": True, "seed": 4, "collate_fn": list}
    got = []
    for rank in range(2):  # two steps on each rank of the first run
        loader = sl.make_loader(sl.Mixture(sources, weights, **kw, **shapes[0]).for_rank(rank, 2))
        for step, batch in enumerate(loader):
            got += [(s["__index__"], *s.get("__span__", (0, 0))) for s in batch if not s["__pad__"]]
            if step == 1:
                state = loader.state_dict()
                break
    for rank in range(3):
        loader = sl.make_loader(sl.Mixture(sources, weights, **kw, **shapes[1]).for_rank(rank, 3))
        loader.load_state_dict(state)
        got += [
            (s["__index__"], *s.get("__span__", (0, 0)))
            for batch in loader
            for s in batch
            if not s["__pad__"]
        ]
    order = sl.Mixture(sources, weights, **kw, **shapes[0]).order(0)
    if planner == "fixed":
        assert sorted(i for i, _, _ in got) == sorted(order.tolist())
    else:
        tokens = Counter((i, t) for i, a, z in got for t in range(a, z))
        lengths = lengths_of(sources)  # a small source's samples recur in its own epochs:
        want = Counter((i, t) for i in order.tolist() for t in range(lengths[i]))
        assert tokens == want  # each token as often as its sample is in the blend


def test_dataloader_workers_do_not_change_the_sequence(sources):
    kw = {"epoch_samples": 45, "shuffle": True, "seed": 9, "batch_size": 4}
    runs = []
    for workers in (0, 2, 3):
        mix = sl.Mixture(sources, {"a": 0.6, "b": 0.3, "c": 0.1}, **kw)
        loader = sl.make_loader(mix, num_workers=workers)
        runs.append([b["__index__"].tolist() for b in loader])
    assert runs[0] == runs[1] == runs[2]
    assert sum(len(b) for b in runs[0]) == 48  # 45 planned, 3 padded to a full batch


def test_weights_change_at_a_resume_from_the_next_epoch(sources):
    kw = {"epoch_samples": 30, "shuffle": True, "seed": 4, "batch_size": 5}
    old = {"a": 0.5, "b": 0.5, "c": 0}
    new = {"a": 0.2, "b": 0.2, "c": 0.6}
    first = sl.Mixture(sources, old, **kw)
    loader = sl.make_loader(first, num_workers=2)
    taken = []
    for step, batch in enumerate(loader):
        taken += batch["__index__"].tolist()
        if step == 1:
            state = loader.state_dict()
            break
    assert state["mixture"]["schedule"] == [[0, [1, 1, 0]]]
    second = sl.Mixture(sources, new, **kw)
    loader = sl.make_loader(second, num_workers=2)
    loader.load_state_dict(state)
    assert second.schedule == [(0, {"a": 0.5, "b": 0.5, "c": 0.0}), (1, pytest.approx(new))]
    rest = [i for b in loader for i in b["__index__"].tolist()]
    assert sorted(taken + rest) == sorted(first.order(0).tolist())
    second.set_epoch(1)
    epoch1 = [i for b in loader for i in b["__index__"].tolist()]
    report = second.report(1)
    assert {n: c.planned for n, c in report.sources.items()} == {"a": 6, "b": 6, "c": 18}
    assert report.sources["c"].epochs_started == 6  # 18 picks of a 3-sample source
    assert second.extra_state()["mixture"]["schedule"] == [[0, [1, 1, 0]], [1, [1, 1, 3]]]
    # each source continues its own stream where epoch 0 left it: b's 15 picks of epoch 0
    # and its 6 of epoch 1 are its own epoch 0 (8 samples), epoch 1 (8), then 5 of epoch 2
    b_stream = [i - 21 for i in taken + rest + epoch1 if 21 <= i < 29]
    assert len(b_stream) == 21
    assert sorted(b_stream[:8]) == sorted(b_stream[8:16]) == list(range(8))
    assert b_stream[:8] != b_stream[8:16]  # reshuffled


def test_report_counts_samples_tokens_and_own_epochs(sources):
    mix = sl.Mixture(sources, {"a": 1, "b": 1, "c": 2}, epoch_samples=40, batch_size=4)
    report = mix.report(0)
    got = {n: (c.planned, c.samples, c.epoch, c.epochs_started) for n, c in report.sources.items()}
    # 10 of a (21), 10 of b (8: a second epoch begun), 20 of c (3: its 7th epoch begun)
    assert got == {"a": (10, 10, 0, 1), "b": (10, 10, 1, 2), "c": (20, 20, 6, 7)}
    assert report.num_samples == 40 and report.steps_per_rank == 10
    assert report.sources["a"].tokens > 0 and report.sources["a"].weight == 0.25


def test_sources_take_their_own_options(sources):
    mix = sl.Mixture(
        {"a": Source(sources["a"], shuffle=False), "b": Source(sources["b"], seed=1)},
        {"a": 1, "b": 1},
        shuffle=True,
        epoch_samples=16,
        batch_size=4,
    )
    order = mix.global_batches(0)
    a_ids = [i for b in order for i in b.tolist() if i < 21]
    assert a_ids == list(range(8))  # unshuffled source: its own order, whatever the mixture's


def test_bad_mixtures_are_refused_with_names(sources):
    with pytest.raises(sl.UsageError, match="missing \\['c'\\]"):
        sl.Mixture(sources, {"a": 1, "b": 1})
    with pytest.raises(sl.UsageError, match="unknown \\['d'\\]"):
        sl.Mixture(sources, {"a": 1, "b": 1, "c": 1, "d": 1})
    with pytest.raises(sl.UsageError, match="by="):
        sl.Mixture(sources, {"a": 1, "b": 1, "c": 1}, by="bytes")
    with pytest.raises(sl.UsageError, match="TokenBlocks"):
        sl.Mixture(
            sources, {"a": 1, "b": 1, "c": 1}, planner=sl.TokenBlocks(seq_len=4, rows_per_batch=2)
        )
    mix = sl.Mixture(sources, {"a": 1, "b": 1, "c": 1}, batch_size=2)
    state = sl.make_loader(mix).state_dict()
    other = sl.Mixture({"a": sources["a"], "b": sources["b"]}, {"a": 1, "b": 1}, batch_size=2)
    with pytest.raises(sl.ResumeError):
        sl.make_loader(other).load_state_dict(state)


@pytest.mark.slow
def test_a_served_mixture_gives_each_rank_its_local_batches(sources, tmp_path):
    """The service over a Mixture: RemoteLoader on every rank of 2, byte for byte what a local
    loader yields, resumed mid-epoch too."""
    from test_service_support import InProcessServer, digest

    def mixture():
        return sl.Mixture(
            sources, {"a": 3, "b": 2, "c": 1}, epoch_samples=26, shuffle=True, seed=8, batch_size=3
        )

    world = 2
    want = {r: [digest(b) for b in sl.make_loader(mixture().for_rank(r, world))] for r in range(2)}
    with InProcessServer(mixture(), workers=1) as server:
        got = {
            r: [digest(b) for b in sl.RemoteLoader(server.url, world=sl.World(r, world))]
            for r in range(world)
        }
        resumed = sl.RemoteLoader(server.url, world=sl.World(1, world))
        resumed.load_state_dict({**resumed.state_dict(), "position": 4})
        tail = [digest(b) for b in resumed]
    assert got == want and len(want[0]) == 5  # 26 positions: 9 batches, padded to 10
    assert tail == want[1][2:]


@settings(max_examples=25, deadline=None)
@given(
    planner=st.sampled_from(sorted(PLANNERS)),
    weights=st.lists(st.integers(0, 6), min_size=3, max_size=3).filter(lambda w: sum(w) > 0),
    epoch_samples=st.integers(5, 60),
    worlds=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    steps=st.integers(0, 6),
    epoch=st.integers(0, 3),
)
def test_any_resume_point_on_any_world_sizes_delivers_the_epoch_once(
    sources, planner, weights, epoch_samples, worlds, steps, epoch
):
    """Property over (weights, planner, world sizes before and after, resume point, epoch):
    what all ranks read before the resume plus what all ranks read after it is the epoch's
    planned positions (tokens, for packing), each exactly once."""
    kw = {"epoch_samples": epoch_samples, "shuffle": True, "seed": 6, "collate_fn": list}
    mix = sl.Mixture(sources, dict(zip(SIZES, weights, strict=True)), **kw, **PLANNERS[planner])
    before, after = worlds
    first = mix.for_rank(0, before)
    first.set_epoch(epoch)
    per_rank = len(first)
    steps = min(steps, per_rank)
    seen = []
    for rank in range(before):
        view = mix.for_rank(rank, before)
        view.set_epoch(epoch)
        for step, batch in enumerate(view):
            if step == steps:
                break
            seen += [token_share(s) for s in batch if not s["__pad__"]]
    if steps < per_rank:  # else the epoch is over (state: next epoch)
        seen += [i for ids in delivered(mix, epoch, after, steps * before) for i in ids]
    order = mix.order(epoch)
    if planner == "packed":
        lengths = lengths_of(sources)
        tokens = np.zeros(len(lengths), np.int64)
        np.add.at(tokens, [i for i, _ in seen], [n for _, n in seen])
        assert tokens.tolist() == (np.bincount(order, minlength=len(tokens)) * lengths).tolist()
    else:
        assert sorted(seen) == sorted(order.tolist())


def test_persistent_workers_follow_a_scheduled_weight_change(sources):
    """NOTE [mixture state]: the schedule is shared with the workers, which persist across
    epochs, so a change made between epochs reaches them (and the cached plan of len())."""
    mix = sl.Mixture(sources, {"a": 1, "b": 1, "c": 0}, epoch_samples=24, batch_size=4)
    loader = sl.make_loader(mix, num_workers=2)
    offsets = mix.offsets
    assert offsets == {"a": 0, "b": 21, "c": 29}

    def counts(ids):
        source = np.searchsorted(list(offsets.values()), ids, side="right") - 1
        return np.bincount(source, minlength=3).tolist()

    first = [i for b in loader for i in b["__index__"].tolist()]
    assert counts(first) == [12, 12, 0] and len(loader) == 6
    mix.set_weights({"a": 1, "b": 0, "c": 1}, epoch=1)
    mix.set_epoch(1)
    second = [i for b in loader for i in b["__index__"].tolist()]
    assert counts(second) == [12, 0, 12]
    assert second == mix.order(1).tolist()
    assert mix.weights(0) == {"a": 0.5, "b": 0.5, "c": 0.0}


def test_token_weights_are_token_shares(sources):
    """by="tokens": the weights are token shares, placed by token deadline (the full check is
    tests/test_token_deadlines.py): a source of longer samples gets fewer samples."""
    mix = sl.Mixture(sources, {"a": 1, "b": 1, "c": 2}, by="tokens", batch_size=2)
    assert mix.weights() == {"a": 0.25, "b": 0.25, "c": 0.5}
    tokens = {n: c.tokens for n, c in mix.report().sources.items()}
    longest = int(lengths_of(sources).max())
    assert abs(tokens["c"] - 0.5 * sum(tokens.values())) <= longest


def test_a_bad_sample_names_its_source_shard_and_key(tmp_path):
    for name, sizes in (("good", [6]), ("bad", [5])):
        write_dataset(str(tmp_path / name), sizes)
    shard = tmp_path / "bad" / "shard-00000.tar"
    data = bytearray(shard.read_bytes())
    data[1024 + 100] ^= 0xFF  # inside the first sample's data: its checksum fails
    shard.write_bytes(bytes(data))
    urls = {"good": str(tmp_path / "good"), "bad": str(tmp_path / "bad")}
    mix = sl.Mixture(urls, {"good": 1, "bad": 1}, batch_size=11)
    where = r"shard-00000\.tar \(source 'bad', rank 0/1.*'s/000000'"
    with pytest.raises(sl.ShardloaderError, match=where):
        list(mix)
    skipping = sl.Mixture(urls, {"good": 1, "bad": 1}, batch_size=11, on_error="skip")
    (batch,) = list(skipping)
    assert batch["__pad__"].sum() == 1  # the bad sample stood in for, flagged
