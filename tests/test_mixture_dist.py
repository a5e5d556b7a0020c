"""Mixtures of token corpora with sequence packing: real DataLoader workers and a real gloo
run on 2 ranks resumed on 3, every token of the mixture epoch delivered exactly once."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from corpus import WORDS, jsonl, train_tokenizer
from helpers import torchrun

import shardloader as sl
from shardloader.batching import PackedBatches
from shardloader.pack import PackOptions, pack

CODE_WORDS = "def return if else for in while class import from self None True".split()


def make_corpora(root) -> tuple[str, str, int]:
    """Two token corpora (web: words, code: keywords) under one tokenizer; its pad id."""
    rng = np.random.default_rng(0)
    web = [" ".join(rng.choice(WORDS, int(k))) for k in rng.integers(3, 50, 40)]
    code = [" ".join(rng.choice(CODE_WORDS, int(k))) for k in rng.integers(3, 30, 15)]
    tok = train_tokenizer(str(root / "tok.json"), web + code)
    out = []
    for name, texts in (("web", web), ("code", code)):
        jsonl(str(root / "raw" / name / f"{name}.jsonl"), texts)
        pack(
            str(root / "raw" / name),
            str(root / name),
            PackOptions(tokenizer=tok, shard_size=1500),
        )
        out.append(str(root / name))
    pad = int(sl.read_manifest(out[0])[0].extra["tokenizer"]["vocab_size"])
    return out[0], out[1], pad


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return make_corpora(tmp_path_factory.mktemp("mixlm"))


def web_and_code(web: str, code: str, pad: int) -> sl.Mixture:
    """The mixture tests/mix_job.py reads (there with its own rows per batch)."""
    return sl.Mixture(
        {"web": web, "code": code},
        {"web": 0.7, "code": 0.3},
        planner=PackedBatches(seq_len=16, rows_per_batch=2, window=8, pad_id=pad),
        shuffle=True,
        seed=3,
        epoch_samples=50,
    )


def planned_segments(web: str, code: str, pad: int) -> Counter:
    mix = web_and_code(web, code, pad)
    return Counter(tuple(s) for b in mix.global_batches(0) for s in b.tolist())


@pytest.mark.slow
def test_packed_mixture_is_the_same_with_and_without_workers(corpora):
    web, code, pad = corpora
    runs = []
    for workers in (0, 2):
        mix = web_and_code(web, code, pad)
        batches = list(sl.make_loader(mix, num_workers=workers))
        assert all(tuple(b["input_ids"].shape) == (2, 16) for b in batches)
        runs.append([(b["input_ids"].tolist(), b["__key__"]) for b in batches])
        segments = Counter(
            (int(i), int(a), int(z))
            for b in batches
            for i, (a, z), p in zip(b["__index__"], b["__span__"], b["__pad__"], strict=True)
            if not p
        )
        assert segments == planned_segments(web, code, pad)  # every token once
        keys = {k.split("/")[0] for b in batches for k in b["__key__"]}
        assert keys == {"web", "code"}  # both sources read through their own shards
        report = mix.report(0).sources
        assert report["web"].planned == 35 and report["code"].planned == 15
        assert report["code"].tokens == sum(
            z - a for (i, a, z) in segments if i >= 40
        )  # code's virtual ids follow web's 40 documents
    assert runs[0] == runs[1]


@pytest.mark.slow
@pytest.mark.subprocess
def test_gloo_two_ranks_resumed_on_three_keep_the_global_batch_and_every_token(corpora, tmp_path):
    """2 ranks x 3 packed rows, stopped after 3 steps, resumed on 3 ranks x 2 rows: the global
    batch stays 6 rows, and every token of the mixture epoch arrives exactly once."""
    web, code, pad = corpora
    state = str(tmp_path / "state.json")
    results = []
    for world, rows, stop in ((2, 3, 3), (3, 2, -1)):
        out = str(tmp_path / f"seen{world}.json")
        torchrun(str(tmp_path), "mix_job.py", world, web, code, out, str(stop), state, str(rows))
        with open(out) as f:
            results.append(sorted(json.load(f), key=lambda r: r["rank"]))
    first, second = results
    assert [r["rank"] for r in second] == [0, 1, 2]
    assert {r["state"]["position"] for r in first} == {6}  # 3 steps x 2 ranks
    assert len({r["steps"] for r in second}) == 1  # equal steps on every rank
    assert {len(r["segments"]) > 0 for r in first + second} == {True}
    assert first[0]["state"]["mixture"]["schedule"] == [[0, [7, 3]]]
    assert "rows_per_batch=3," in first[0]["state"]["plan"]  # the global batch: 2 x 3 rows
    assert "rows_per_batch=2," in second[0]["state"]["plan"]  # ... and 3 x 2 rows
    delivered = Counter(
        (i, t) for r in first + second for i, a, z, p in r["segments"] if not p for t in range(a, z)
    )
    planned = planned_segments(web, code, pad)  # the epoch planned in one shape
    assert max(delivered.values()) == 1  # no token twice
    assert set(delivered) == {(i, t) for i, a, z in planned for t in range(a, z)}  # none lost
