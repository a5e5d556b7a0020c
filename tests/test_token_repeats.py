"""Every repeat is flagged: TokenBlocks rows repeated so every rank takes the same number of
steps (``uneven="pad"``) arrive through real DataLoader workers flagged ``__pad__`` with labels
-100, and ``ds.ledger()`` of a token-row dataset adds up to ``ds.report()``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from corpus import WORDS, packed_docs, read_back

import shardloader as sl
from shardloader.batching.blocks import TokenBlocks

SEQ, ROWS = 16, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("repeats")
    rng = np.random.default_rng(13)  # 35 batches: uneven on 2 ranks and on 3
    lengths = np.minimum(rng.lognormal(2.5, 1.2, 60).astype(int), 200)
    lengths[[5, 30]] = 0
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), k)) for k in lengths]
    out = packed_docs(str(root), texts, format="tokens", max_samples=17)
    manifest, _ = read_back(out)
    return out, int(manifest.extra["tokenizer"]["vocab_size"])


def dataset(path, vocab, world, rank, **kw):
    uneven = kw.pop("uneven", "pad")
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab, **kw)
    return sl.ShardedDataset(
        path, planner=planner, shuffle=True, seed=3, world=sl.World(rank, world), uneven=uneven
    )


@pytest.mark.parametrize("labels", ["ignore", "keep"])
def test_rows_repeated_for_equal_steps_are_flagged_and_not_learned_twice(corpus, labels):
    path, vocab = corpus
    world = 2  # 35 batches: rank 1 repeats one
    first = dataset(path, vocab, 1, 0)
    n = len(first)
    assert n % world, "the corpus must leave the ranks uneven"
    originals = list(sl.make_loader(first, num_workers=0))  # every batch once, in plan order
    repeated = flagged = 0
    for rank in range(world):
        options = {} if labels == "ignore" else {"repeat_labels": labels}  # the default first
        ds = dataset(path, vocab, world, rank, **options)
        report = ds.report()
        got = list(sl.make_loader(ds, num_workers=2))
        assert len(got) == -(-n // world)
        for j, batch in enumerate(got):
            q = j * world + rank
            pad = batch["__pad__"]
            assert pad.dtype == torch.bool and tuple(pad.shape) == (ROWS,)
            want = originals[q % n]
            assert torch.equal(batch["input_ids"], want["input_ids"])
            if q < n:  # a first delivery: only the padding rows of a short last batch
                assert pad.tolist() == (want["attention_mask"].sum(1) == 0).tolist()
                assert torch.equal(batch["labels"], want["labels"])
                continue
            assert pad.all(), f"rank {rank} step {j} repeats batch {q % n} unflagged"
            if labels == "ignore":
                assert (batch["labels"] == -100).all()
            else:
                assert torch.equal(batch["labels"], want["labels"])
            assert torch.equal(batch["attention_mask"], want["attention_mask"])
            repeated += int(batch["attention_mask"].sum())
            flagged += 1
    assert flagged == -(-n // world) * world - n
    assert repeated == report.repeated_tokens > 0


@pytest.mark.parametrize(
    ("world", "kw"),
    [
        (3, {}),
        (2, {}),
        (3, {"uneven": "drop"}),
        (2, {"remainder": "drop", "tail": "drop", "uneven": "drop"}),
        (1, {"remainder": "drop"}),
    ],
    ids=str,
)
def test_the_ledger_of_token_rows_adds_up_to_the_report(corpus, world, kw):
    path, vocab = corpus
    ds = dataset(path, vocab, world, 0, **kw)
    report, ledger = ds.report(), ds.ledger()
    counts = ledger.counts()
    assert ledger.num_samples == 60
    assert counts["dropped"] == report.dropped_samples
    assert counts["truncated"] == report.truncated_samples
    tokens = {s: sum(e.tokens for e in ledger.entries if e.status == s) for s in counts}
    assert tokens["padded"] == report.repeated_tokens
    assert tokens["dropped"] == report.dropped_tokens
    assert tokens["truncated"] == report.truncated_tokens
    assert all(e.reason for e in ledger.entries)
    if kw.get("remainder") == "drop":
        assert any("remainder='drop'" in e.reason for e in ledger.entries)
    if kw.get("uneven") == "drop" and len(dataset(path, vocab, 1, 0, **kw)) % world:
        assert any("uneven='drop'" in e.reason for e in ledger.entries)
    if world > 1:
        assert dataset(path, vocab, world, world - 1, **kw).ledger() == ledger  # every rank
