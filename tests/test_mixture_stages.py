"""Mixture stages: weights that change at optimizer steps, kept at the same steps and stream
positions by a resume on another world size and number of DataLoader workers."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_cli, torchrun, write_datasets

import shardloader as sl
from shardloader.batching import PackedBatches
from shardloader.errors import ResumeError, UsageError
from shardloader.read.lengths import load_lengths

SIZES = {"a": [7, 5, 9], "b": [4, 4], "c": [3]}  # 21, 8 and 3 samples
OFFSETS = {"a": 0, "b": 21, "c": 29}
STAGES = [(0, {"a": 3, "b": 1, "c": 0}), (7, {"a": 1, "b": 1, "c": 2})]
GLOBAL_BATCH = 12  # 2 ranks x 6, 3 x 4, 1 x 12: the same global batch on every world
KW = {"epoch_samples": 60, "shuffle": True, "seed": 6, "collate_fn": list}  # 5 steps an epoch


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_datasets(str(tmp_path_factory.mktemp("stages")), SIZES)


def staged(sources, batch_size: int, by: str = "samples") -> sl.Mixture:
    return sl.Mixture(sources, stages=STAGES, batch_size=batch_size, by=by, **KW)


def source_of(i: int) -> str:
    return "c" if i >= OFFSETS["c"] else "b" if i >= OFFSETS["b"] else "a"


def run(mixes, ranks: int, workers: int, epochs, stop=None, state=None):
    """Per global step, every rank's sample ids in rank order (a step's global batch), from
    ``mixes`` (one Mixture per rank) over ``epochs``; ``stop`` steps then the state."""
    loaders = []
    for r in range(ranks):
        loader = sl.make_loader(mixes[r].for_rank(r, ranks), num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        loaders.append(loader)
    steps, saved = [], None
    for epoch in epochs:
        if epoch != epochs[0] or state is None:
            for loader in loaders:
                loader.dataset.set_epoch(epoch)
        passes = [iter(loader) for loader in loaders]
        for _ in range(len(loaders[0])):
            step = []
            for it in passes:
                step += [s["__index__"] for s in next(it) if not s["__pad__"]]
            steps.append(step)
            if stop is not None and len(steps) == stop:
                saved = loaders[-1].state_dict()
                return steps, saved
    return steps, saved


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "workers"), [(3, 1), (1, 4)])
def test_stages_resumed_on_another_world_begin_at_their_step(sources, ranks, workers):
    """2 ranks x 2 workers stopped after 3 steps (mid stage 0), resumed on ``ranks`` x
    ``workers``: the steps after the resume equal an unbroken run's, and the weights change
    exactly at step 7 (stage 0 gives c nothing, stage 1 half of every step)."""
    whole, _ = run([staged(sources, 6) for _ in range(2)], 2, 2, [0, 1])
    assert len(whole) == 10 and {len(s) for s in whole} == {GLOBAL_BATCH}
    first, state = run([staged(sources, 6) for _ in range(2)], 2, 2, [0, 1], stop=3)
    assert state["mixture"]["stages"] == [[0, [3, 1, 0]], [7, [1, 1, 2]]]
    assert state["mixture"]["samples_per_step"] == GLOBAL_BATCH
    batch = GLOBAL_BATCH // ranks
    rest, _ = run(
        [staged(sources, batch) for _ in range(ranks)], ranks, workers, [0, 1], state=state
    )
    assert first + rest == whole  # the continuation is the unbroken run, step by step
    shares = [{n: sum(source_of(i) == n for i in step) for n in "abc"} for step in whole]
    assert shares[:7] == [{"a": 9, "b": 3, "c": 0}] * 7  # 3:1:0 is exact in 12 positions
    assert shares[7:] == [{"a": 3, "b": 3, "c": 6}] * 3  # 1:1:2 from step 7 on


def test_a_resume_with_another_global_batch_keeps_the_stages_where_the_stream_had_them(sources):
    """2 ranks x 6 stopped after 3 steps, resumed on 3 ranks x 6 (18 a step, not 12): the
    saved state keeps a step at 12 documents, so stage 1 still begins at stream position 84
    and the documents after the resume are the unbroken run's, in order."""
    whole, _ = run([staged(sources, 6) for _ in range(2)], 2, 0, [0, 1])
    first, state = run([staged(sources, 6) for _ in range(2)], 2, 0, [0, 1], stop=3)
    resumed = [staged(sources, 6) for _ in range(3)]
    rest, _ = run(resumed, 3, 0, [0, 1], state=state)
    assert resumed[0].samples_per_step == GLOBAL_BATCH
    assert [i for s in first + rest for i in s] == [i for s in whole for i in s]


def test_stages_are_in_the_blend_at_their_stream_positions(sources):
    """Stage 1 begins at step 7 = epoch 1, position 24 of 60 (12 samples a step): the blend
    changes there mid-epoch, each stage within one sample of its weights at every prefix."""
    mix = staged(sources, 12)
    assert mix.stage_starts() == [(0, 0), (7, 84)]
    ids = np.concatenate([mix.order(e) for e in (0, 1, 2)])
    src = np.asarray(["abc".index(source_of(int(i))) for i in ids])
    for lo, hi, parts in ((0, 84, (3, 1, 0)), (84, 180, (1, 1, 2))):
        counts = np.cumsum(np.eye(3, dtype=np.int64)[src[lo:hi]], axis=0)
        n = np.arange(1, hi - lo + 1)[:, None]
        w = np.asarray(parts, float) / sum(parts)
        assert np.abs(counts - w[None, :] * n).max() <= 1
    assert mix.stages == [
        (0, {"a": 0.75, "b": 0.25, "c": 0.0}),
        (7, {"a": 0.25, "b": 0.25, "c": 0.5}),
    ]
    assert "stages=[[0,[3,1,0]],[7,[1,1,2]]]" in mix.plan_signature


def test_a_resume_with_other_stages_is_refused(sources):
    loader = sl.make_loader(staged(sources, 6).for_rank(0, 2))
    next(iter(loader))
    state = loader.state_dict()
    other = sl.Mixture(sources, stages=[(0, STAGES[0][1]), (8, STAGES[1][1])], batch_size=6, **KW)
    with pytest.raises(ResumeError, match="stages"):
        sl.make_loader(other).load_state_dict(state)


def test_stages_the_planner_cannot_express_are_refused(sources):
    with pytest.raises(UsageError, match="PackedBatches.*batch_size="):
        sl.Mixture(sources, stages=STAGES, planner=PackedBatches(seq_len=80, rows_per_batch=2))
    with pytest.raises(UsageError, match="not both"):
        sl.Mixture(sources, {"a": 1, "b": 1, "c": 1}, stages=STAGES, batch_size=4)
    with pytest.raises(UsageError, match="step 0"):
        sl.Mixture(sources, stages=[(5, STAGES[0][1])], batch_size=4)
    with pytest.raises(UsageError, match="increase"):
        sl.Mixture(sources, stages=[STAGES[0], (0, STAGES[1][1])], batch_size=4)
    with pytest.raises(UsageError, match="2 node partitions.*partition='global'"):
        len(staged(sources, 4).for_rank(0, 4, ranks_per_node=2))  # 2 nodes x 2 ranks
    with pytest.raises(UsageError, match="stages"):
        staged(sources, 4).set_weights({"a": 1, "b": 1, "c": 1}, epoch=1)


@pytest.mark.slow
@pytest.mark.subprocess
def test_gloo_two_ranks_resumed_on_three_keep_the_stages(sources, tmp_path):
    """A real gloo run: 2 ranks x 6 (2 DataLoader workers each) stopped after 3 steps,
    resumed on 3 ranks x 4: every step after the resume is the unbroken run's, stage 1 from
    step 7."""
    whole, _ = run([staged(sources, 6) for _ in range(2)], 2, 0, [0, 1])
    state = str(tmp_path / "state.json")
    steps = []
    for world, batch, stop in ((2, 6, 3), (3, 4, -1)):
        out = str(tmp_path / f"seen{world}.json")
        args = (*sources.values(), out, str(stop), state, str(batch))
        torchrun(str(tmp_path), "stages_job.py", world, *args)
        with open(out) as f:
            ranks = sorted(json.load(f), key=lambda r: r["rank"])
        assert len({len(r["batches"]) for r in ranks}) == 1  # equal steps on every rank
        steps += [sum(step, []) for step in zip(*(r["batches"] for r in ranks), strict=True)]
    assert steps == whole


@pytest.mark.subprocess
def test_plan_prints_where_each_stage_begins_and_what_it_delivers(sources):
    """``shardloader plan`` of the staged mixture on 2 ranks x 6, two epochs: stage 1 begins
    at step 7 = position 84, and the documents and tokens per source are the run's own."""
    spec = ",".join(f"{n}={u}" for n, u in sources.items())
    stage_args = [
        a
        for st, w in STAGES
        for a in ("--stage", f"{st}:" + ",".join(f"{n}={v}" for n, v in w.items()))
    ]
    common = [spec, *stage_args, "--batch-size", 6, "--nodes", 1, "--ranks-per-node", 2]
    common += ["--epoch-samples", 60, "--epochs", 2, "--seed", 6]
    proc = run_cli("plan", *common, "--json")
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert [(s["step"], s["position"], s["positions"]) for s in got["stages"]] == [
        (0, 0, 84),
        (7, 84, 36),
    ]
    mix = staged(sources, 6).for_rank(0, 2)
    ids = np.concatenate([mix.order(0), mix.order(1)])
    lengths = np.concatenate(
        [load_lengths(*sl.read_manifest(u), sl.ReadOptions()) for u in sources.values()]
    )
    for stage, (lo, hi) in zip(got["stages"], ((0, 84), (84, 120)), strict=True):
        for name in "abc":
            mine = [i for i in ids[lo:hi] if source_of(i) == name]
            want = {"samples": len(mine), "tokens": int(lengths[mine].sum())}
            assert stage["sources"][name] == want
    text = run_cli("plan", *common)
    assert (
        text.returncode == 0 and "from step 7 (epoch 1, position 84), 36 documents" in text.stdout
    )
    nodes = run_cli("plan", *common, "--nodes", 2)  # the last --nodes counts: 2 x 2 ranks
    assert nodes.returncode != 0 and "partition='global'" in nodes.stderr
    assert run_cli("plan", *common, "--nodes", 2, "--partition", "global").returncode == 0
    bad = run_cli("plan", spec, "--stage", "0:a=oops")
    assert (
        bad.returncode != 0 and "--stage '0:a=oops'" in bad.stderr and "Traceback" not in bad.stderr
    )


def test_token_stages_hold_token_shares_from_their_step_and_resume_exactly(sources):
    """``by="tokens"``: each stage's token shares are within one longest document of its
    weights at every prefix from its step (stage 1 from step 7, mid-epoch 1), and 2 ranks x 6
    stopped after 3 steps, resumed on 3 ranks x 4 with 2 workers, equal the unbroken run."""
    mix = staged(sources, 12, "tokens")
    lengths = np.concatenate(
        [load_lengths(*sl.read_manifest(u), sl.ReadOptions()) for u in sources.values()]
    )
    ids = np.concatenate([mix.order(e) for e in (0, 1, 2)])
    src = np.asarray(["abc".index(source_of(int(i))) for i in ids])
    for (lo, hi), (_, weights) in zip(((0, 84), (84, 180)), STAGES, strict=True):
        tokens = np.cumsum(np.eye(3, dtype=np.int64)[src[lo:hi]] * lengths[ids[lo:hi], None], 0)
        w = np.asarray([weights[n] for n in "abc"], float)
        share = w / w.sum() * tokens.sum(axis=1, keepdims=True)
        assert (np.abs(tokens - share) <= lengths.max()).all()
    assert not (src[:84] == 2).any() and (src[84:96] == 2).any()  # c only from step 7 on
    whole, _ = run([staged(sources, 6, "tokens") for _ in range(2)], 2, 0, [0, 1])
    first, state = run([staged(sources, 6, "tokens") for _ in range(2)], 2, 0, [0, 1], stop=3)
    rest, _ = run([staged(sources, 4, "tokens") for _ in range(3)], 3, 2, [0, 1], state=state)
    assert first + rest == whole
    assert [i for step in whole for i in step] == ids[:120].tolist()
