"""Lean token batches: ``TokenBlocks(lean=True)`` hands over the shards' uint16 ids, and
``expand_on_device`` makes from them exactly the default batch, for every batch of an epoch on
2 ranks (a repeated batch, a padded last batch, padded rows) through real DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from corpus import WORDS, packed_docs, read_back

import shardloader as sl
from shardloader.batching import expand_on_device, signature_of
from shardloader.batching.blocks import TokenBlocks

SEQ, ROWS = 16, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("lean")
    rng = np.random.default_rng(13)  # 35 batches: uneven on 2 ranks, a short last batch
    lengths = np.minimum(rng.lognormal(2.5, 1.2, 60).astype(int), 200)
    lengths[[5, 30]] = 0
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), k)) for k in lengths]
    out = packed_docs(str(root), texts, format="tokens", max_samples=17)
    manifest, _ = read_back(out)
    return out, int(manifest.extra["tokenizer"]["vocab_size"])


def loader(path, vocab, rank, workers, **kw):
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab, **kw)
    ds = sl.ShardedDataset(
        path, planner=planner, shuffle=True, seed=3, world=sl.World(rank, 2), uneven="pad"
    )
    return sl.make_loader(ds, num_workers=workers)


@pytest.mark.parametrize("labels", ["ignore", "keep"])
def test_expanding_every_lean_batch_gives_the_default_batch(corpus, labels):
    path, vocab = corpus
    flagged = padded = 0
    for rank in range(2):
        want = list(loader(path, vocab, rank, 0, repeat_labels=labels))
        workers = 2 if labels == "ignore" else 0  # through the ring, and in this process
        got = list(loader(path, vocab, rank, workers, repeat_labels=labels, lean=True))
        assert len(got) == len(want) == 18
        for j, (lean, full) in enumerate(zip(got, want, strict=True)):
            assert lean["input_ids"].dtype == torch.uint16, "the shards' own dtype"
            assert "labels" not in lean and lean["input_ids"].shape == (ROWS, SEQ)
            out = expand_on_device(lean, "cpu")
            assert sorted(out) == sorted(full), j
            for key, value in full.items():
                if isinstance(value, torch.Tensor):
                    assert out[key].dtype == value.dtype, (rank, j, key)
                    assert torch.equal(out[key], value), (rank, j, key)
                else:
                    assert out[key] == value, (rank, j, key)
            flagged += int(full["__pad__"].all())
            padded += int((full["attention_mask"] == 0).any())
    assert flagged == 1 and padded > 2  # the repeat, padded rows and the short last batch


@pytest.mark.parametrize("lean", [True, False])
def test_rows_gathered_a_shard_at_a_time_land_where_the_row_by_row_copy_puts_them(
    corpus, lean, monkeypatch
):
    """copy_rows gathers a big chunk's full rows by shard (NOTE [lean chunks] in
    shardloader/read/samplepass.py); forced on for every chunk, each batch (short rows,
    padding rows, the short last batch, a repeat) equals the row-by-row copy's."""
    from shardloader.batching import blockchunks

    path, vocab = corpus
    want = list(loader(path, vocab, 1, 0, lean=lean))
    monkeypatch.setattr(blockchunks, "_GATHER_ROWS", 1)
    got = list(loader(path, vocab, 1, 0, lean=lean))
    assert len(got) == len(want) == 18
    for j, (a, b) in enumerate(zip(got, want, strict=True)):
        assert sorted(a) == sorted(b), j
        for key, value in b.items():
            if isinstance(value, torch.Tensor):
                assert a[key].dtype == value.dtype and torch.equal(a[key], value), (j, key)
            else:
                assert a[key] == value, (j, key)


def test_a_big_chunk_without_a_full_row_is_copied_row_by_row(monkeypatch):
    """Every row short (shards shorter than seq_len, padding rows): the gather by shard has
    nothing to take, and each row is copied and padded as the row-by-row copy does it."""
    from shardloader.batching import blockchunks

    n = np.array([3, 2, 1, 0])
    chunk = blockchunks.ChunkLayout(
        2, 2, 4, np.array([0, 1, 0, -1]), np.array([0, 0, 4, 0]), n, *([np.zeros(0)] * 4)
    )
    streams = {0: np.arange(1, 6, dtype=np.uint16), 1: np.arange(1, 3, dtype=np.uint16)}
    got = {}
    for gather in (1, 10**6):
        monkeypatch.setattr(blockchunks, "_GATHER_ROWS", gather)
        ids = np.full((2, 2, 4), 7, np.uint16)
        got[gather] = blockchunks.copy_rows(chunk, streams, ids), ids
    assert got[1][0] == got[10**6][0] == list(enumerate(n.tolist()))
    assert np.array_equal(got[1][1], got[10**6][1])
    assert got[1][1].reshape(4, 4).tolist() == [[1, 2, 3, 0], [1, 2, 0, 0], [5, 0, 0, 0], [0] * 4]


def test_lean_is_no_part_of_the_plan():
    assert signature_of(TokenBlocks(SEQ, ROWS, pad_id=9, lean=True)) == signature_of(
        TokenBlocks(SEQ, ROWS, pad_id=9)
    )
    with pytest.raises(sl.UsageError, match="lean"):
        TokenBlocks(SEQ, ROWS, pad_id=9, lean="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lean=True"):
        expand_on_device({"input_ids": torch.zeros(2, 2, dtype=torch.int64)})


def test_ids_past_uint16_cross_as_uint32_and_expand_to_the_default_batch(tmp_path):
    import json

    from shardloader.pack import PackOptions, pack

    rng = np.random.default_rng(4)
    raw = tmp_path / "raw"
    raw.mkdir()
    with open(raw / "ids.jsonl", "w") as f:
        for k in rng.integers(1, 40, 30).tolist():
            f.write(json.dumps({"input_ids": rng.integers(60_000, 70_000, k).tolist()}) + "\n")
    out = str(tmp_path / "packed")
    pack(str(raw), out, PackOptions(format="tokens", token_field="input_ids", max_samples=11))
    vocab = 70_000
    want = list(loader(out, vocab, 0, 0))
    got = list(loader(out, vocab, 0, 2, lean=True))
    assert len(got) == len(want) > 1
    for lean, full in zip(got, want, strict=True):
        assert lean["input_ids"].dtype == torch.uint32
        out_batch = expand_on_device(lean)
        for key in ("input_ids", "labels", "position_ids", "attention_mask", "__pad__"):
            assert torch.equal(out_batch[key], full[key]), key
        assert int(full["input_ids"].max()) >= 1 << 16  # ids a uint16 could not hold
