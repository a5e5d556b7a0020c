"""``--tokenizer``: token ids in a ``tokens`` field, token counts as sample lengths."""

from __future__ import annotations

import json

import numpy as np
import pytest
from corpus import docs, jsonl, read_back, sidecar, write

from shardloader.codecs.allowlist import Decoder, decode_field
from shardloader.errors import InputError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack import PackOptions, pack


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from corpus import train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_tokenizer(str(path), docs(200, seed=9))


@pytest.mark.parametrize("fmt", ["tar", "arrow", "tokens"])
def test_jsonl_is_tokenized_into_uint16_ids(tmp_path, tokenizer, fmt):
    from tokenizers import Tokenizer

    texts = docs(30, seed=1)
    jsonl(str(tmp_path / "corpus.jsonl"), texts)
    report = pack(
        str(tmp_path / "corpus.jsonl"),
        str(tmp_path / "out"),
        PackOptions(format=fmt, tokenizer=tokenizer, text_field="text", max_samples=8),
    )
    manifest, samples = read_back(str(tmp_path / "out"))
    assert manifest.fields["tokens"] == FieldInfo("tokens", "uint16")
    assert manifest.length_field == "tokens" and manifest.extra["length_unit"] == "tokens"
    assert manifest.extra["tokenizer"]["vocab_size"] <= 64
    tok = Tokenizer.from_file(tokenizer)
    expected = [tok.encode(t).ids for t in texts]
    got = [
        decode_field("tokens", "tokens", f["tokens"], Decoder(), dtype="uint16").tolist()
        for _, f in samples
    ]
    assert got == expected
    assert samples[0][1]["tokens"] == np.asarray(expected[0], "<u2").tobytes()
    lengths = [
        int(n)
        for s in manifest.shards
        for n in sidecar(str(tmp_path / "out"), s.index_path).lengths
    ]
    assert lengths == [len(ids) for ids in expected]
    assert [json.loads(f["json"])["text"] for _, f in samples] == texts  # original kept
    assert report.bytes_in == sum(len(f["json"]) for _, f in samples)


def test_big_vocabularies_use_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "big.json"))
    write(str(tmp_path / "src"), "t.txt", b"w1 w69999 w5\nnope w70000\n")
    pack(
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        PackOptions(tokenizer=str(tmp_path / "big.json")),
    )
    manifest, samples = read_back(str(tmp_path / "out"))
    assert manifest.fields["tokens"].dtype == "uint32"
    assert samples[0][1]["tokens"] == np.asarray([1, 69999, 5], "<u4").tobytes()
    assert samples[1][1]["tokens"] == np.asarray([0, 0], "<u4").tobytes()


def test_missing_text_field_is_a_bad_record(tmp_path, tokenizer):
    write(str(tmp_path / "src"), "d.jsonl", b'{"text": "alpha beta"}\n{"body": "gamma"}\n')
    with pytest.raises(InputError, match=r"d\.jsonl line 2 .*no text to tokenize"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(tokenizer=tokenizer))
    report = pack(
        str(tmp_path / "src"),
        str(tmp_path / "skip"),
        PackOptions(tokenizer=tokenizer, on_error="skip"),
    )
    assert report.samples == 1 and report.skipped == 1


def test_tokenizer_needs_text_and_a_readable_file(tmp_path, tokenizer):
    from corpus import class_folders

    class_folders(str(tmp_path / "img"), per_class=1)
    with pytest.raises(UsageError, match="--tokenizer needs text"):
        pack(str(tmp_path / "img"), str(tmp_path / "o1"), PackOptions(tokenizer=tokenizer))
    write(str(tmp_path / "src"), "d.jsonl", b'{"text": "alpha"}\n')
    with pytest.raises(UsageError, match="cannot load"):
        pack(
            str(tmp_path / "src"),
            str(tmp_path / "o2"),
            PackOptions(tokenizer=str(tmp_path / "missing.json")),
        )


def test_text_field_lengths_without_tokenizer(tmp_path):
    write(
        str(tmp_path / "src"),
        "d.jsonl",
        '{"body": "héllo"}\n{"body": 3}\n{"other": "x"}\n'.encode(),
    )
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(text_field="body"))
    manifest, _ = read_back(str(tmp_path / "out"))
    assert manifest.length_field == "body"
    assert list(sidecar(str(tmp_path / "out"), manifest.shards[0].index_path).lengths) == [6, 0, 0]


def test_a_text_field_no_record_has_is_an_error_naming_the_fields_they_have(tmp_path, tokenizer):
    """A typo in --text-field, or text under another key, used to record every length as 0
    and exit 0; the planners failed only at training time."""
    write(str(tmp_path / "src"), "a.jsonl", b'{"body": "alpha", "id": 1}\n{"body": "beta"}\n')
    for options in (PackOptions(text_field="txet"), PackOptions(tokenizer=tokenizer)):
        field = options.text_field
        with pytest.raises(
            UsageError,
            match=rf"--text-field '{field}' is missing from every record of .*a\.jsonl "
            r"\(2 records[^)]*\); its records have 'body', 'id'",
        ):
            pack(str(tmp_path / "src"), str(tmp_path / "out"), options)
    assert not (tmp_path / "out").exists()
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x", "y"]}), str(tmp_path / "t.parquet"))
    with pytest.raises(UsageError, match=r"--text-field 'text2' .* its records have 'body'"):
        pack(str(tmp_path / "t.parquet"), str(tmp_path / "o2"), PackOptions(text_field="text2"))


def test_a_text_field_most_records_lack_is_a_warning_with_counts(tmp_path, caplog):
    lines = [b'{"text": "a"}'] + [b'{"other": 1}'] * 3 + [b'{"text": null}']
    write(str(tmp_path / "src"), "corpus/a.jsonl", b"\n".join(lines) + b"\n")
    write(str(tmp_path / "src"), "corpus/b.jsonl", b'{"text": "fine"}\n')
    with caplog.at_level("WARNING"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions())
    a = str(tmp_path / "src" / "corpus" / "a.jsonl")
    assert f"text missing in 4 of 5 records of {a}" in caplog.text
    assert "b.jsonl" not in caplog.text
    manifest, _ = read_back(str(tmp_path / "out"))
    assert manifest.length_field == "text"


def test_the_default_text_field_in_no_record_records_no_lengths(tmp_path, caplog):
    """Records without any text: no length field, rather than a length of 0 for each."""
    write(str(tmp_path / "src"), "m.jsonl", b'{"a": 1}\n{"a": 2}\n')
    with caplog.at_level("WARNING"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions())
    assert "no record has a 'text' key or column" in caplog.text
    manifest, _ = read_back(str(tmp_path / "out"))
    assert manifest.length_field is None and "length_unit" not in manifest.extra


@pytest.mark.subprocess
def test_the_cli_refuses_a_missing_text_field_with_exit_2(tmp_path):
    import subprocess
    import sys

    write(str(tmp_path / "src"), "corpus.jsonl", b'{"content": "alpha"}\n')
    done = subprocess.run(
        [sys.executable, "-m", "shardloader", "pack", str(tmp_path / "src"), str(tmp_path / "o")]
        + ["--text-field", "txet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "--text-field 'txet' is missing from every record of" in done.stderr
    assert "its records have 'content'" in done.stderr
    assert not (tmp_path / "o" / "index.json").exists()
