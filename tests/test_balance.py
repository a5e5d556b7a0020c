"""Compute-balanced steps (``PackedBatches(balance="attention", ranks=W)``): on a long-tailed
corpus each step's dearest rank costs at most 5 % more than the mean (a pure property of the
plan, not a timing), every token still arrives exactly once with equal steps, through real
DataLoader workers, a 2-rank torchrun job and a mid-epoch resume at another world size."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from corpus import docs, packed_docs, read_back
from helpers import torchrun

import shardloader as sl
from shardloader.batching import PackCollate, PackedBatches
from shardloader.batching.balance import assign_capped, batch_costs, step_imbalance
from shardloader.batching.fit import next_fit_rows, pack_rows
from shardloader.errors import UsageError

SEQ, ROWS = 16, 2


def long_tailed(n: int, seed: int = 0) -> np.ndarray:
    """Lognormal document lengths (median ~1.1k tokens) with a tail past 32k tokens."""
    rng = np.random.default_rng(seed)
    lens = np.minimum(rng.lognormal(7.0, 1.3, n).astype(np.int64) + 1, 200_000)
    assert n < 10_000 or (lens > 32_768).sum() >= 20
    return lens


def rows_of(batch: np.ndarray, seq_len: int, fit: str) -> list[list[tuple[int, int, int]]]:
    """The rows a collate built for this planner re-derives from the batch alone."""
    place = pack_rows if fit == "first" else next_fit_rows
    return place((batch[:, 2] - batch[:, 1]).tolist(), seq_len)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("seq_len", "ranks", "rows", "fit"),
    [(8192, 8, 2, "first"), (8192, 64, 2, "best"), (32768, 8, 2, "first"), (32768, 64, 4, "first")],
)
def test_balanced_steps_are_within_five_percent_of_the_mean(seq_len, ranks, rows, fit):
    lens = long_tailed(30_000)
    order = np.random.default_rng(1).permutation(lens.size)

    def plan(balance):
        planner = PackedBatches(
            seq_len, rows, window=16_384, fit=fit, balance=balance,
            ranks=ranks if balance else None,
        )  # fmt: skip
        return planner.plan(order, lens, np.random.default_rng(2))

    balanced, plain = plan("attention"), plan(None)
    mean_balanced = float(step_imbalance(batch_costs(balanced, 0.0), ranks).mean())
    mean_plain = float(step_imbalance(batch_costs(plain, 0.0), ranks).mean())
    assert mean_balanced <= 1.05 < 1.2 < mean_plain
    # the same tokens, each once, in full steps of full batches (a short last step aside)
    segs = np.concatenate(balanced)
    assert int((segs[:, 2] - segs[:, 1]).sum()) == int(lens.sum())
    assert len(np.unique(segs, axis=0)) == len(segs)
    assert len(balanced) // ranks >= len(plain) // ranks - 1
    counts = [len(rows_of(b, seq_len, fit)) for b in balanced]
    assert set(counts[: len(balanced) // ranks * ranks]) == {rows}
    assert max(counts) <= rows


def test_capped_assignment_keeps_counts_and_lowers_the_largest_bin():
    costs = np.array([100.0, 90, 10, 10, 10, 10, 9, 1])
    where = assign_capped(costs, 4, 2)
    assert sorted(Counter(where.tolist()).values()) == [2, 2, 2, 2]
    loads = np.bincount(where, costs, 4)
    assert loads.max() == 101.0  # the dearest item with the cheapest


def test_balance_needs_the_ranks_that_share_a_step():
    with pytest.raises(UsageError, match="ranks"):
        PackedBatches(16, 2, balance="attention")
    with pytest.raises(UsageError, match="balance_c"):
        PackedBatches(16, 2, balance="attention", ranks=2, balance_c=-1.0)
    with pytest.raises(UsageError, match="balance"):
        PackedBatches(16, 2, balance="flops", ranks=2)
    sig = PackedBatches(16, 2, balance="attention", ranks=4).signature()
    assert "balance='attention'" in sig and "ranks=4" in sig
    assert "balance" not in PackedBatches(16, 2).signature()  # old states still load


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """Token shards of 60 documents of very different lengths."""
    root = tmp_path_factory.mktemp("lm")
    texts = docs(60, seed=0, mean=3.5, longest=600)
    out = packed_docs(str(root), texts, shard_size=3000)
    manifest, samples = read_back(out)
    tokens = {key: np.frombuffer(f["tokens"], "<u2").astype(np.int64) for key, f in samples}
    pad = int(manifest.extra["tokenizer"]["vocab_size"])
    return out, tokens, pad


def _spans(batch: dict) -> list[tuple[str, int, int]]:
    return [
        (k, int(a), int(b))
        for k, (a, b), pad in zip(
            batch["__key__"], batch["__span__"], batch["__pad__"], strict=True
        )
        if not pad
    ]


def _cost(spans: list[tuple[str, int, int]]) -> int:
    return sum((b - a) ** 2 for _, a, b in spans)


def _check_once(tokens: dict, seen: list[tuple[str, int, int]]) -> None:
    covered = {key: np.zeros(len(t), np.int64) for key, t in tokens.items()}
    for key, a, b in seen:
        covered[key][a:b] += 1
    assert all((c == 1).all() for c in covered.values())


@pytest.mark.slow
def test_two_ranks_read_every_token_once_in_balanced_steps(lm):
    """Two ranks x 2 DataLoader workers: every token once, equal steps, each step's two
    batches the ones the plan balanced together (each rank's cost as the plan predicts)."""
    path, tokens, pad = lm
    planner = PackedBatches(SEQ, ROWS, window=16, pad_id=pad, balance="attention", ranks=2)
    per_rank = []
    for rank in range(2):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=3, world=sl.World(rank, 2))
        steps = []
        for batch in sl.make_loader(ds, num_workers=2):
            assert tuple(batch["input_ids"].shape) == (ROWS, SEQ)
            steps.append(_spans(batch))
        per_rank.append(steps)
    assert len(per_rank[0]) == len(per_rank[1])  # equal steps
    _check_once(tokens, [s for steps in per_rank for step in steps for s in step])
    ratios = [
        max(_cost(a), _cost(b)) / ((_cost(a) + _cost(b)) / 2)
        for a, b in zip(*per_rank, strict=True)
        if a and b
    ]
    # the plan's own per-step figure for this world, read back from what the ranks got
    planned = ds.report().rank_balance
    assert planned is not None and planned.balanced == pytest.approx(np.mean(ratios), rel=0.2)
    assert planned.balanced < planned.unbalanced


@pytest.mark.slow
def test_a_balanced_epoch_resumes_mid_epoch_at_another_world_size(lm):
    """Checkpoint at 2 ranks x 2 workers after 3 steps, resume at 3 ranks x 1 worker with the
    same planner: every token once; the rest keeps the 2-rank steps' batches (dealt onto 3
    ranks, so no longer balanced per step)."""
    path, tokens, pad = lm
    planner = PackedBatches(SEQ, ROWS, window=16, pad_id=pad, balance="attention", ranks=2)
    seen: list[tuple[str, int, int]] = []
    states = []
    for rank in range(2):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=4, world=sl.World(rank, 2))
        ds.set_epoch(1)
        loader = sl.make_loader(ds, num_workers=2)
        for step, batch in enumerate(loader):
            seen += _spans(batch)
            if step == 2:
                states.append(loader.state_dict())
                break
    assert states[0] == states[1] and states[0]["position"] == 6
    for rank in range(3):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=4, world=sl.World(rank, 3))
        loader = sl.make_loader(ds, num_workers=1)
        loader.load_state_dict(states[0])
        ds.set_epoch(1)
        for batch in loader:
            assert tuple(batch["input_ids"].shape) == (ROWS, SEQ)
            seen += _spans(batch)
    _check_once(tokens, seen)


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_torchrun_job_reads_balanced_steps_exactly_once(lm, tmp_path):
    path, tokens, pad = lm
    out = str(tmp_path / "seen.json")
    torchrun(str(tmp_path), "balance_job.py", 2, path, out, "2", str(SEQ), str(ROWS), str(pad))
    with open(out) as f:
        gathered = sorted(json.load(f), key=lambda g: g["rank"])
    steps = [g["steps"] for g in gathered]
    assert len(steps[0]) == len(steps[1]) > 0  # equal steps
    seen = [(k, a, b) for rank in steps for step in rank for k, a, b, p in step if not p]
    _check_once(tokens, seen)
    # what the ranks read is the plan the library makes for two ranks
    planner = PackedBatches(SEQ, ROWS, window=16, pad_id=pad, balance="attention", ranks=2)
    ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=3, world=sl.World(0, 2))
    assert [_spans(b) for b in sl.make_loader(ds, num_workers=0)] == [
        [(k, a, b) for k, a, b, p in step if not p] for step in steps[0]
    ]


def test_pack_collate_rebuilds_balanced_rows():
    """A balanced batch lists rows of one window's packing so the collate re-derives them."""
    lens = long_tailed(3000, seed=5) // 64 + 1
    for fit in ("first", "best"):
        planner = PackedBatches(512, 3, window=700, fit=fit, balance="attention", ranks=4)
        for batch in planner.plan(np.arange(lens.size), lens, np.random.default_rng(0)):
            collate = PackCollate(512, 0, rows_per_batch=3, fit=fit)
            docs_ = [np.ones(int(b - a), np.int64) for _, a, b in batch]
            out = collate(docs_)  # refuses a batch that needs more than 3 rows
            assert int(out["attention_mask"].sum()) == int((batch[:, 2] - batch[:, 1]).sum())


def test_plan_command_predicts_the_balance_from_the_manifest(lm):
    """``shardloader plan --balance`` (the CLI in-process): balanced and unbalanced per-step
    figures from the recorded lengths."""
    from click.testing import CliRunner

    from shardloader.cli import main

    path, _, _ = lm
    args = ["plan", path, "--ranks-per-node", "4", "--batch-size", "2", "--balance"]
    got = CliRunner().invoke(main, [*args, "--seq-len", "64", "--rows", "2", "--json"])
    assert got.exit_code == 0, got.output
    (fig,) = json.loads(got.output)["balance"]
    assert fig["ranks_per_step"] == 4 and fig["steps"] > 0
    assert 1.0 <= fig["balanced"] < fig["unbalanced"]
    text = CliRunner().invoke(main, [*args, "--seq-len", "64"])
    assert text.exit_code == 0 and "balanced" in text.output and "unbalanced" in text.output
