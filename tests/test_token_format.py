"""Token shards (``--format tokens``): what the format contract (tests/format_contract.py) cannot
see because its samples have no token field: the token region, its chunk table, the header,
and pack → verify → inspect → read through the command line."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from corpus import docs, jsonl, train_tokenizer

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import ChecksumError, ShardError, located
from shardloader.format import get_format
from shardloader.format.tokens.format import HEADER_BYTES, TokenShardReader, TokenStream
from shardloader.manifest import FieldInfo, SampleIndex

FIELDS = {"json": FieldInfo("json"), "tokens": FieldInfo("tokens", "uint16")}


def samples(n: int = 9) -> list[tuple[str, dict[str, bytes]]]:
    """Documents with tokens of varied length (one empty, one without the field)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        fields = {"json": json.dumps({"id": i}).encode()}
        if i != 4:
            length = 0 if i == 2 else int(rng.integers(1, 3000))
            fields["tokens"] = rng.integers(0, 60000, length, dtype="<u2").tobytes()
        out.append((f"d/{i:03d}", fields))
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path: str, data, compression: str = "none"):
    with open(path, "wb") as f:
        writer = get_format("tokens").writer(f, compression, FIELDS)
        for key, fields in data:
            writer.add(key, fields, length=None)
        return writer.close()


def test_tokens_lie_end_to_end_and_samples_read_back(tmp_path):
    data = samples()
    path = str(tmp_path / "s.tok")
    shard = write(path, data)
    fmt = get_format("tokens")
    planned = fmt.shard_overhead + sum(
        fmt.sample_raw_size(k, [(e, len(v)) for e, v in f.items()]) for k, f in data
    )
    assert planned == shard.raw_bytes == os.path.getsize(path)  # sizes stay exact and additive
    lengths = [len(f.get("tokens", b"")) // 2 for _, f in data]
    assert shard.index.lengths.tolist() == lengths  # token counts, whatever length= said
    stream = TokenStream(path)
    want = np.frombuffer(b"".join(f.get("tokens", b"") for _, f in data), "<u2")
    assert stream.header.field == "tokens" and stream.tokens.tolist() == want.tolist()
    stream.close()
    reader = TokenShardReader(path, shard.index)
    assert [reader.read(i) for i in (8, 0, 4, 2, 5)] == [data[i] for i in (8, 0, 4, 2, 5)]
    reader.close()
    with open(path, "rb") as f:
        assert list(fmt.iter_stored(f, "none", path)) == data


def test_a_damaged_token_chunk_is_named_by_reader_stream_and_verify(tmp_path):
    data = samples()
    path = str(tmp_path / "s.tok")
    shard = write(path, data)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 1000)
        byte = f.read(1)
        f.seek(HEADER_BYTES + 1000)
        f.write(bytes([byte[0] ^ 1]))
    stream = TokenStream(path)
    with pytest.raises(ChecksumError, match=r"shard X: tokens \d+\.\.\d+ \(chunk \d+"):
        with located("shard X"):  # the caller names the shard (TokenRows: its ShardSet's name)
            stream.check_tokens(np.array([0]), np.array([stream.tokens.size]))
    stream.close()
    reader = TokenShardReader(path, shard.index)
    with pytest.raises(ChecksumError, match=r"sample 'd/000'"):
        reader.read(0)  # byte 1000 is in the first document's tokens
    reader.close()
    with open(path, "rb") as f, pytest.raises(ChecksumError, match="chunk"):
        list(get_format("tokens").iter_stored(f, "none", path))


@pytest.mark.parametrize(
    ("where", "what"),
    [(0, "bad magic"), (16, "truncated|add up"), (24, "header"), (-3, "truncated|add up")],
)
def test_a_damaged_header_or_tail_is_a_shard_error(tmp_path, where, what):
    data = samples(4)
    path = str(tmp_path / "s.tok")
    shard = write(path, data)
    raw = bytearray(_read(path))
    if where == -3:
        raw = raw[:-3]
    else:
        raw[where] ^= 0x41
    with pytest.raises(ShardError, match=what):
        list(get_format("tokens").iter_stored(io.BytesIO(bytes(raw)), "none", path))
    bad = str(tmp_path / "bad.tok")
    with open(bad, "wb") as f:
        f.write(raw)
    with pytest.raises(ShardError):
        TokenShardReader(bad, shard.index).read(0)


def test_streams_are_bounded(tmp_path):
    data = samples()
    path = str(tmp_path / "s.tok")
    shard = write(path, data, "zstd")
    stored = _read(path)
    fmt = get_format("tokens")
    with pytest.raises(ShardError, match="bytes the manifest declares"):
        list(fmt.iter_stored(io.BytesIO(stored), "zstd", path, limit=HEADER_BYTES + 100))
    with pytest.raises(ShardError, match="more than the 100 allowed"):
        list(fmt.iter_stored(io.BytesIO(stored), "zstd", path, limit=None, max_member=100))
    assert shard.raw_bytes > HEADER_BYTES + 100


def test_a_sidecar_that_disagrees_with_the_shard_is_refused(tmp_path):
    data = samples()
    path = str(tmp_path / "s.tok")
    shard = write(path, data)
    index = shard.index
    lengths = index.lengths.copy()
    lengths[0] += 1
    other = SampleIndex(index.keys, index.offsets, index.sizes, lengths, index.checksums)
    with pytest.raises(ShardError, match="lengths add up to"):
        TokenShardReader(path, other)
    odd = {"tokens": b"\x01\x02\x03"}
    with open(str(tmp_path / "odd.tok"), "wb") as f:
        writer = get_format("tokens").writer(f, "none", FIELDS)
        with pytest.raises(ShardError, match="'bad'.*whole number of uint16"):
            writer.add("bad", odd)


def test_pack_verify_inspect_and_read_through_the_cli(tmp_path):
    texts = docs(120, seed=4)
    jsonl(str(tmp_path / "raw" / "d.jsonl"), texts)
    tok = train_tokenizer(str(tmp_path / "tok.json"), texts)
    out = str(tmp_path / "out")
    runner = CliRunner()
    args = ["pack", str(tmp_path / "raw"), out, "--format", "tokens", "--tokenizer", tok]
    result = runner.invoke(main, [*args, "--compression", "none", "--max-samples", "40"])
    assert result.exit_code == 0, result.output
    assert sorted(f for f in os.listdir(out) if f.endswith(".tok")) == [
        "shard-00000.tok",
        "shard-00001.tok",
        "shard-00002.tok",
    ]
    result = runner.invoke(main, ["verify", out])
    assert result.exit_code == 0, result.output
    result = runner.invoke(main, ["inspect", out, "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["format"] == "tokens" and summary["length_field"] == "tokens"
    total = summary["lengths"]["total"]
    ds = sl.ShardedDataset(out, planner=sl.TokenBlocks(8, 2, pad_id=999))
    assert ds.report().tokens == total
    samples_ds = sl.ShardedDataset(out, batch_size=10, decoder=None, collate_fn=list)
    got = [s for batch in sl.make_loader(samples_ds) for s in batch]
    assert sum(len(s["tokens"]) // 2 for s in got) == total  # per-sample reads, in place
    whole = sl.ShardedDataset(out, planner=sl.PackedBatches(8, 2, pad_id=999))  # documents whole
    real = sum(int(b["attention_mask"].sum()) for b in sl.make_loader(whole, num_workers=1))
    assert real == total == whole.report().tokens
    with open(os.path.join(out, "shard-00001.tok"), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\xff\xff")
    result = runner.invoke(main, ["verify", out])
    assert result.exit_code == 1 and "shard-00001.tok" in result.output, result.output
    with pytest.raises(ChecksumError, match="shard-00001.tok"):
        list(sl.make_loader(ds))
