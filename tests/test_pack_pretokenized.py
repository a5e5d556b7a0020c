"""``--token-field``: token ids the input already holds (a Parquet list column as
``datasets.Dataset.to_parquet`` writes it, or JSONL lists) packed as token shards without a
tokenizer, and read by every LLM planner through a real DataLoader, each token once."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from corpus import read_back, sidecar

import shardloader as sl
from shardloader.batching import BucketBatches, PackedBatches, TokenBlocks
from shardloader.errors import InputError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack import PackOptions, pack


def _ids(n: int, seed: int, vocab: int = 1000) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(1, 60))).tolist() for _ in range(n)]


def _hf_parquet(path: str, ids: list[list[int]], dtype: str) -> None:
    """As ``datasets.Dataset.map(tokenize).to_parquet()`` writes it: ``input_ids`` a
    ``Sequence(Value(dtype))`` (list<int32> from a tokenizer, list<int64> from Python ints),
    beside the text and an ``attention_mask``."""
    import datasets

    features = datasets.Features(
        {
            "text": datasets.Value("string"),
            "input_ids": datasets.Sequence(datasets.Value(dtype)),
            "attention_mask": datasets.Sequence(datasets.Value("int8")),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "text": [f"document {i}" for i in range(len(ids))],
            "input_ids": ids,
            "attention_mask": [[1] * len(x) for x in ids],
        },
        features=features,
    )
    ds.to_parquet(path, batch_size=16)  # several row groups


def _jsonl(path: str, ids: list[list[int]]) -> None:
    with open(path, "w") as f:
        for i, x in enumerate(ids):
            f.write(json.dumps({"input_ids": x, "id": i}) + "\n")


def _source(tmp_path, kind: str) -> tuple[str, dict[str, list[int]]]:
    """A pre-tokenized source and {sample key: its ids}."""
    src = tmp_path / "src"
    src.mkdir()
    a, b = _ids(70, seed=1), _ids(50, seed=2)
    if kind == "jsonl":
        _jsonl(str(src / "a.jsonl"), a)
        _jsonl(str(src / "b.jsonl"), b)
        keys = [f"a/{i + 1:09d}" for i in range(len(a))] + [f"b/{i + 1:09d}" for i in range(len(b))]
    else:
        _hf_parquet(str(src / "a.parquet"), a, kind)
        _hf_parquet(str(src / "b.parquet"), b, kind)
        keys = [f"a/{i:09d}" for i in range(len(a))] + [f"b/{i:09d}" for i in range(len(b))]
    return str(src), dict(zip(keys, a + b, strict=True))


@pytest.fixture(scope="module", params=["int32", "int64", "jsonl"])
def packed(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"pretok-{request.param}")
    src, expected = _source(tmp, request.param)
    out = str(tmp / "out")
    report = pack(src, out, PackOptions(format="tokens", token_field="input_ids", max_samples=32))
    assert report.samples == len(expected) and report.shards == 4
    return request.param, out, expected


def test_ids_become_the_tokens_field_with_lengths_and_vocab(packed):
    kind, out, expected = packed
    manifest, samples = read_back(out)
    vocab = max(max(x) for x in expected.values()) + 1
    assert manifest.fields["tokens"] == FieldInfo("tokens", "uint16")
    assert "input_ids" not in manifest.fields
    assert manifest.length_field == "tokens" and manifest.extra["length_unit"] == "tokens"
    assert manifest.extra["tokenizer"] == {"token_field": "input_ids", "vocab_size": vocab}
    got = {k: np.frombuffer(f["tokens"], "<u2").tolist() for k, f in samples}
    assert got == expected
    lengths = [n for s in manifest.shards for n in sidecar(out, s.index_path).lengths.tolist()]
    assert lengths == [len(x) for x in expected.values()]
    if kind == "jsonl":  # the other keys stay, the ids are not stored twice
        assert [json.loads(f["json"]) for _, f in samples[:2]] == [{"id": 0}, {"id": 1}]
    else:
        assert {"text", "attention_mask"} <= set(manifest.fields)
        assert samples[3][1]["text"] == b"document 3"


def test_token_blocks_deliver_every_token_once(packed):
    _, out, expected = packed
    manifest, _ = sl.read_manifest(out)
    vocab = manifest.extra["tokenizer"]["vocab_size"]
    ds = sl.ShardedDataset(out, planner=TokenBlocks(seq_len=16, rows_per_batch=4, pad_id=vocab))
    real = []
    for batch in sl.make_loader(ds, num_workers=2):
        real += batch["input_ids"][batch["attention_mask"].bool()].tolist()
    assert real == [t for ids in expected.values() for t in ids]  # in order, each once
    total = sum(len(x) for x in expected.values())
    report = ds.report()
    assert (report.tokens, report.total_tokens, report.dropped_tokens) == (total, total, 0)


def test_packed_batches_deliver_every_document_whole_once(packed):
    _, out, expected = packed
    vocab = sl.read_manifest(out)[0].extra["tokenizer"]["vocab_size"]
    ds = sl.ShardedDataset(
        out, planner=PackedBatches(seq_len=64, rows_per_batch=4, pad_id=vocab), shuffle=True
    )
    segments: Counter = Counter()
    keys: Counter = Counter()
    for batch in sl.make_loader(ds, num_workers=2):
        keys.update(batch["__key__"])
        for row, mask, pos in zip(
            batch["input_ids"], batch["attention_mask"], batch["position_ids"], strict=True
        ):
            tokens, starts = row[mask.bool()].tolist(), pos[mask.bool()].tolist()
            cuts = [i for i, p in enumerate(starts) if p == 0] + [len(tokens)]
            segments.update(tuple(tokens[a:b]) for a, b in zip(cuts, cuts[1:], strict=False))
    assert keys == Counter(list(expected))  # every document once (none longer than a row)
    assert segments == Counter(tuple(x) for x in expected.values())
    report = ds.report()
    assert report.tokens == report.total_tokens == sum(len(x) for x in expected.values())


def _ids_only(sample: dict) -> dict:
    """The tokenizer's own ``attention_mask`` column goes: PadCollate makes the batch's."""
    return {k: v for k, v in sample.items() if k != "attention_mask"}


def test_bucket_batches_deliver_every_document_once(packed):
    _, out, expected = packed
    vocab = sl.read_manifest(out)[0].extra["tokenizer"]["vocab_size"]
    planner = BucketBatches(batch_size=8)
    ds = sl.ShardedDataset(
        out,
        planner=planner,
        shuffle=True,
        transform=_ids_only,
        collate_fn=planner.make_collate({"tokens": vocab}),
    )
    got: dict[str, list[int]] = {}
    for batch in sl.make_loader(ds, num_workers=2):
        for key, row, n in zip(batch["__key__"], batch["tokens"], batch["lengths"], strict=True):
            assert key not in got
            got[key] = row[: int(n)].tolist()
            assert (row[int(n) :] == vocab).all()
    assert got == expected
    report = ds.report()
    assert report.tokens == report.total_tokens == sum(len(x) for x in expected.values())


def test_a_vocabulary_past_uint16_stores_uint32_and_vocab_size_is_taken(tmp_path):
    src = tmp_path / "big.jsonl"
    _jsonl(str(src), [[0, 70000, 5], [65535]])
    pack(str(src), str(tmp_path / "a"), PackOptions(format="tokens", token_field="input_ids"))
    manifest, samples = read_back(str(tmp_path / "a"))
    assert manifest.fields["tokens"].dtype == "uint32"
    assert manifest.extra["tokenizer"]["vocab_size"] == 70001
    assert np.frombuffer(samples[0][1]["tokens"], "<u4").tolist() == [0, 70000, 5]
    small = tmp_path / "small.jsonl"
    _jsonl(str(small), [[1, 2]])
    options = PackOptions(format="tokens", token_field="input_ids", vocab_size=50257)
    pack(str(small), str(tmp_path / "b"), options)  # GPT-2's vocabulary fits uint16
    manifest, _ = read_back(str(tmp_path / "b"))
    assert manifest.fields["tokens"].dtype == "uint16"
    assert manifest.extra["tokenizer"]["vocab_size"] == 50257


def test_ids_outside_the_vocabulary_are_refused_naming_file_and_record(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _hf_parquet(str(src / "a.parquet"), [[1, 2], [3, 50257], [4]], "int32")
    options = PackOptions(format="tokens", token_field="input_ids", vocab_size=50257)
    with pytest.raises(InputError, match=r"a\.parquet row 1: 'input_ids' holds token id 50257"):
        pack(str(src), str(tmp_path / "out"), options)
    neg = tmp_path / "neg.jsonl"
    _jsonl(str(neg), [[1], [2, -1]])
    with pytest.raises(InputError, match=r"neg\.jsonl line 2: .*negative token id -1"):
        pack(
            str(neg), str(tmp_path / "out2"), PackOptions(format="tokens", token_field="input_ids")
        )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input_ids": [1, 2.5]}\n')
    with pytest.raises(
        InputError, match=r"bad\.jsonl line 1: 'input_ids' is not a list of integer"
    ):
        pack(
            str(bad), str(tmp_path / "out3"), PackOptions(format="tokens", token_field="input_ids")
        )
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_a_token_field_no_record_has_is_an_error_naming_what_they_have(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _hf_parquet(str(src / "a.parquet"), [[1, 2]], "int32")
    with pytest.raises(
        UsageError,
        match=r"--token-field 'ids' is missing from every record of "
        r".*a\.parquet \(1 records\); its records have 'attention_mask', "
        r"'input_ids', 'text'",
    ):
        pack(str(src), str(tmp_path / "out"), PackOptions(format="tokens", token_field="ids"))
    text = tmp_path / "t.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": ["not", "ids"]}), str(text))
    with pytest.raises(UsageError, match="Arrow type string, not a list of integer token ids"):
        pack(str(text), str(tmp_path / "o2"), PackOptions(format="tokens", token_field="input_ids"))


def test_a_token_field_most_records_lack_is_a_warning_with_counts(tmp_path, caplog):
    src = tmp_path / "c.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n{"other": 1}\n{"other": 2}\n{"input_ids": null}\n')
    with caplog.at_level(logging.WARNING):
        pack(str(src), str(tmp_path / "out"), PackOptions(format="tokens", token_field="input_ids"))
    assert f"input_ids missing in 3 of 4 records of {src}" in caplog.text
    _, samples = read_back(str(tmp_path / "out"))
    assert [len(f["tokens"]) for _, f in samples] == [4, 0, 0, 0]  # kept, with no tokens


@pytest.mark.subprocess
def test_the_cli_packs_ids_and_refuses_bad_ones_with_exit_1(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(str(src / "d.jsonl"), [[5, 6, 7], [8]])

    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "shardloader", "pack", str(src), *args, "--format", "tokens"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    done = run(str(tmp_path / "out"), "--token-field", "input_ids")
    assert done.returncode == 0, done.stderr
    assert "tokens:tokens" in done.stdout
    done = run(str(tmp_path / "o2"), "--token-field", "input_ids", "--vocab-size", "8")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "d.jsonl line 2: 'input_ids' holds token id 8, not below --vocab-size 8" in done.stderr
    assert not os.path.exists(tmp_path / "o2" / "index.json")
    done = run(str(tmp_path / "o3"), "--token-field", "ids")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--token-field 'ids' is missing from every record of" in done.stderr
    assert "its records have 'id', 'input_ids'" in done.stderr


def test_planner_errors_point_to_a_path_that_works(tmp_path):
    """A pre-tokenized corpus packed as plain records: TokenBlocks' error names --token-field,
    not PackedBatches (which fails on it too); a tar pack of token ids: PackedBatches, which
    then reads it."""
    src = tmp_path / "d.jsonl"
    ids = _ids(20, seed=5)
    _jsonl(str(src), ids)
    plain = str(tmp_path / "plain")
    pack(str(src), plain, PackOptions())  # ids stay a JSON list: no length field to plan with
    with pytest.raises(UsageError, match="--token-field input_ids") as err:
        sl.ShardedDataset(plain, planner=TokenBlocks(seq_len=16, rows_per_batch=2, pad_id=1000))
    assert "PackedBatches" not in str(err.value)
    with pytest.raises(UsageError, match="--token-field input_ids"):
        ds = sl.ShardedDataset(plain, planner=PackedBatches(16, 2, pad_id=1000))
        next(iter(sl.make_loader(ds)))
    tar = str(tmp_path / "tar")
    pack(str(src), tar, PackOptions(token_field="input_ids"))  # tar shards, token lengths
    with pytest.raises(UsageError, match="or use PackedBatches"):
        sl.ShardedDataset(tar, planner=TokenBlocks(seq_len=16, rows_per_batch=2, pad_id=1000))
    ds = sl.ShardedDataset(tar, planner=PackedBatches(64, 2, pad_id=1000))  # the advice works
    real = sum(int(b["attention_mask"].sum()) for b in sl.make_loader(ds))
    assert real == sum(len(x) for x in ids)
