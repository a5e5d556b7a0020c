"""A Mixture of TokenBlocks sources (NOTE [token rows mix] in shardloader/plan/rowmix.py): rows
of seq_len tokens of one source each, blended so every global batch keeps each source within
one row of its token share, every token at most once, the report counting each source's
tokens, and an elastic resume on another world equal to the unbroken run, through real
DataLoader workers."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest

import shardloader as sl
from shardloader.batching.blocks import TokenBlocks
from shardloader.errors import UsageError
from shardloader.pack import PackOptions, pack

SEQ, ROWS = 64, 4
WEIGHTS = {"short": 0.5, "mid": 0.3, "long": 0.2}
# (mean document length in tokens, documents, documents a shard)
SHAPES = {"short": (50, 400, 100), "mid": (500, 40, 10), "long": (5000, 4, 1)}
EPOCH = 400  # rows of a mixture epoch: 200 / 120 / 80, fewer than each source holds


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Three pre-tokenized sources (mean lengths ~50, 500 and 5,000 tokens).  Every token id
    is unique and a source's ids run on across its documents, so a delivered id names its
    source and a row cut from one source's stream is a run of consecutive ids."""
    root = tmp_path_factory.mktemp("rowmix")
    rng = np.random.default_rng(3)
    urls, spans, nxt = {}, {}, 1
    for name, (mean, n, per_shard) in SHAPES.items():
        src = root / f"{name}-raw"
        os.makedirs(src)
        first = nxt
        with open(src / "docs.jsonl", "w", encoding="utf-8") as f:
            for k in np.maximum(rng.lognormal(np.log(mean), 0.5, n).astype(int), 1).tolist():
                f.write(json.dumps({"input_ids": list(range(nxt, nxt + k))}) + "\n")
                nxt += k
        spans[name] = (first, nxt)
        out = str(root / name)
        pack(
            str(src),
            out,
            PackOptions(format="tokens", token_field="input_ids", max_samples=per_shard),
        )
        urls[name] = out
    return urls, spans, nxt  # nxt: the vocabulary size, a free pad id


def _real_rows(batch):
    """Each real row of a batch (not padding, not a repeat) as its ids."""
    return [
        ids[mask.bool()].tolist()
        for ids, mask, pad in zip(
            batch["input_ids"], batch["attention_mask"], batch["__pad__"], strict=True
        )
        if mask.any() and not pad
    ]


def _source_of(row, spans):
    return next(name for name, (a, b) in spans.items() if a <= row[0] < b)


@pytest.mark.parametrize("remainder", ["drop", "pad"])
def test_every_global_batch_keeps_each_source_within_one_row_of_its_share(sources, remainder):
    urls, spans, vocab = sources
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab, remainder=remainder)
    mix = sl.Mixture(urls, WEIGHTS, planner=planner, epoch_samples=EPOCH, shuffle=True, seed=1)
    tokens = {n: 0 for n in urls}
    rows = {n: 0 for n in urls}
    seen: Counter[int] = Counter()
    batches = 0
    for batch in sl.make_loader(mix, num_workers=2):
        batches += 1
        for row in _real_rows(batch):
            name = _source_of(row, spans)
            assert row == list(range(row[0], row[0] + len(row)))  # one window of one source
            assert row[-1] < spans[name][1]
            tokens[name] += len(row)
            rows[name] += 1
            seen.update(row)
        total, count = sum(tokens.values()), sum(rows.values())
        for name, w in WEIGHTS.items():  # at every prefix: within one row
            assert abs(rows[name] - w * count) <= 1
            if remainder == "drop":  # every row full: rows are tokens / SEQ
                assert abs(tokens[name] - w * total) <= SEQ
    assert batches == EPOCH // ROWS and sum(rows.values()) == EPOCH
    assert max(seen.values()) == 1  # every token at most once
    report = mix.report()
    assert {n: c.tokens for n, c in report.sources.items()} == tokens
    assert {n: c.samples for n, c in report.sources.items()} == rows
    assert report.tokens == sum(tokens.values()) and report.repeated_tokens == 0
    assert report.dropped_tokens == report.truncated_tokens == 0  # the rest: later epochs
    assert mix.ledger().entries == ()  # nothing of this epoch's rows left out or repeated


def test_the_ledger_and_report_count_what_a_dropped_tail_cuts(sources):
    """tail='drop' leaves out the epoch's last 2 rows: the report's dropped and truncated
    tokens are exactly their tokens, and the ledger's entries add up to them."""
    urls, _, vocab = sources
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab, remainder="drop", tail="drop")
    mix = sl.Mixture(urls, WEIGHTS, planner=planner, epoch_samples=EPOCH + 2, seed=2)
    got = sum(len(r) for b in sl.make_loader(mix) for r in _real_rows(b))
    report, ledger = mix.report(), mix.ledger()
    assert got == report.tokens == EPOCH * SEQ
    assert report.dropped_tokens + report.truncated_tokens == 2 * SEQ
    assert sum(e.tokens for e in ledger.entries) == 2 * SEQ
    assert all("tail='drop'" in e.reason for e in ledger.entries)


def test_rows_are_the_rows_tokenblocks_cuts_from_each_source(sources):
    urls, spans, vocab = sources
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)
    mix = sl.Mixture(urls, WEIGHTS, planner=planner, epoch_samples=EPOCH, shuffle=True, seed=5)
    got = [tuple(r) for b in sl.make_loader(mix) for r in _real_rows(b)]
    for name, url in urls.items():
        alone = {
            tuple(r)
            for b in sl.make_loader(sl.ShardedDataset(url, planner=planner))
            for r in _real_rows(b)
        }
        mine = [r for r in got if _source_of(r, spans) == name]
        assert mine and set(mine) <= alone


def _steps(ds, workers):
    """Each step's real rows of one rank's pass."""
    return [_real_rows(b) for b in sl.make_loader(ds, num_workers=workers)]


def test_a_resume_from_2x2_onto_3x1_equals_the_unbroken_run(sources):
    """2 ranks x 3 rows with 2 workers each, stopped after two steps, resumed on 3 ranks x 2
    rows with one worker (the global batch kept): each global step holds the unbroken run's
    rows, and the epoch's rows arrive once."""
    urls, _, vocab = sources
    kw = {"epoch_samples": EPOCH, "shuffle": True, "seed": 7}

    def mix(rows, rank, world):
        planner = TokenBlocks(SEQ, rows, pad_id=vocab)
        return sl.Mixture(urls, WEIGHTS, planner=planner, world=sl.World(rank, world), **kw)

    ranks = [_steps(mix(3, r, 2), 2) for r in range(2)]
    whole = [Counter(map(tuple, a + b)) for a, b in zip(*ranks, strict=True)]
    head, states = [], []
    for rank in range(2):
        loader = sl.make_loader(mix(3, rank, 2), num_workers=2)
        for step, batch in enumerate(loader):
            if rank == 0:
                head.append(Counter())
            head[step].update(map(tuple, _real_rows(batch)))
            if step == 1:
                states.append(loader.state_dict())
                break
    tail_ranks = []
    for rank in range(3):
        ds = mix(2, rank, 3)
        loader = sl.make_loader(ds, num_workers=1)
        loader.load_state_dict(states[0])
        assert ds.reshapes == ((3, 4),)
        report, ledger = ds.report(), ds.ledger()
        tail_ranks.append([_real_rows(b) for b in loader])
    tail = [Counter(map(tuple, a + b + c)) for a, b, c in zip(*tail_ranks, strict=True)]
    assert head + tail == whole
    delivered = sum(whole, Counter())
    assert sum(delivered.values()) == EPOCH and max(delivered.values()) == 1
    assert report.tokens == sum(len(r) for r in delivered)
    padded = sum(e.tokens for e in ledger.entries if e.status == "padded")
    assert padded == report.repeated_tokens > 0  # the last step's repeat, flagged __pad__


def test_what_a_token_row_mixture_cannot_take_is_refused_naming_it(sources, tmp_path):
    urls, _, vocab = sources
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)
    with pytest.raises(UsageError, match="by="):
        sl.Mixture(urls, WEIGHTS, planner=planner, by="tokens")
    with pytest.raises(UsageError, match="stages"):
        sl.Mixture(urls, planner=planner, stages=[(0, WEIGHTS)])
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "d.jsonl").write_text('{"text": "a b c"}\n{"text": "d e"}\n', encoding="utf-8")
    pack(str(raw), str(tmp_path / "plain"), PackOptions())
    with pytest.raises(UsageError, match="source 'plain'.*--format tokens"):
        sl.Mixture(
            {**urls, "plain": str(tmp_path / "plain")}, {**WEIGHTS, "plain": 1}, planner=planner
        )
