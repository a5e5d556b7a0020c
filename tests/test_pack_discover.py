"""Layout detection, keys and the deterministic sample stream; bad layouts are usage errors."""

from __future__ import annotations

import os

import numpy as np
import pytest
from corpus import class_folders, jsonl, key_groups, parquet, read_back, write

from shardloader.errors import UsageError
from shardloader.pack import pack
from shardloader.pack.discover import discover
from shardloader.pack.layouts.records import record_kind
from shardloader.pack.refs import InputFile, LineRun


def _keys(items):
    """The sample keys of a stream of samples and runs of lines."""
    keys = []
    for item in items:
        if isinstance(item, LineRun):
            keys += [item.key(i) for i in range(item.num_lines)]
        else:
            keys.append(item.key)
    return keys


def test_class_folders_detected_with_sorted_classes_and_cls_field(tmp_path):
    class_folders(str(tmp_path), classes=("zebra", "ant", "mole"), per_class=2)
    src = discover(str(tmp_path))
    assert src.layout == "class-folders"
    assert src.classes == ("ant", "mole", "zebra")
    samples = list(src.items())
    assert [s.key for s in samples] == [
        "ant/img000",
        "ant/img001",
        "mole/img000",
        "mole/img001",
        "zebra/img000",
        "zebra/img001",
    ]
    fields = dict(samples[-1].fields)
    assert fields["cls"] == b"2"
    assert isinstance(fields["jpg"], InputFile) and fields["jpg"].rel == "zebra/img001.jpg"
    assert fields["jpg"].size == os.path.getsize(tmp_path / "zebra/img001.jpg")
    assert src.fields["cls"].codec == "int" and src.fields["jpg"].codec == "image"


def test_class_folder_keys_have_no_dots_and_collisions_are_refused(tmp_path):
    write(str(tmp_path), "cat/a.b.JPG", b"x")
    src = discover(str(tmp_path))
    assert [s.key for s in src.items()] == ["cat/a_b"]
    assert dict(next(src.items()).fields).keys() == {"cls", "jpg"}
    # Two images of one stem keep apart by their extension ...
    write(str(tmp_path), "cat/a_b.png", b"y")
    assert [s.key for s in discover(str(tmp_path)).items()] == ["cat/a_b_jpg", "cat/a_b_png"]
    # ... and only names that still collide are refused, naming both.
    write(str(tmp_path), "cat/a_b.jpg", b"z")
    with pytest.raises(UsageError, match=r"a\.b\.JPG.*a_b\.jpg|a_b\.jpg.*a\.b\.JPG"):
        list(discover(str(tmp_path)).items())


def test_key_groups_follow_the_webdataset_rule(tmp_path):
    files = key_groups(str(tmp_path), n=4)
    src = discover(str(tmp_path))
    assert src.layout == "key-groups"
    samples = list(src.items())
    assert [s.key for s in samples] == ["a/0000", "a/0002", "b/0001", "b/0003"]
    first = dict(samples[0].fields)
    assert sorted(first) == ["jpg", "json", "seg.png", "txt"]
    assert first["seg.png"].size == len(files["a/0000.seg.png"])
    assert src.fields["seg.png"].codec == "image"
    assert src.text is not None and src.text.length_field == "txt"


def test_records_keys_strip_compression_suffixes_and_count_lines(tmp_path):
    root = tmp_path / "src"
    jsonl(str(root / "docs/part-0.jsonl.gz"), ["a", "b"], compress="gzip", extra_lines={1: b""})
    jsonl(str(root / "docs/part-1.jsonl.zst"), ["c"], compress="zstd")
    write(str(root), "notes.v2.txt", b"one\r\n\ntwo")
    src = discover(str(root))
    assert src.layout == "records"
    items = list(src.items())
    assert _keys(items) == [
        "docs/part-0/000000001",
        "docs/part-0/000000003",
        "docs/part-1/000000001",
        "notes.v2/000000001",
        "notes.v2/000000003",
    ]
    assert items[1].where == "line 3" and items[1].file == "docs/part-0.jsonl.gz"
    assert isinstance(items[3], LineRun)  # a plain file: the shard's writer reads its lines
    assert set(src.fields) == {"json", "txt"}
    pack(str(root), str(tmp_path / "out"))
    assert dict(read_back(str(tmp_path / "out"))[1])["notes.v2/000000001"] == {"txt": b"one"}


def test_tables_become_one_field_per_column(tmp_path):
    rows = parquet(str(tmp_path / "t.parquet"), 5)
    src = discover(str(tmp_path))
    assert src.layout == "records"
    assert {k: v.codec for k, v in src.fields.items()} == {
        "text": "text",
        "label": "int",
        "score": "json",
        "blob": "bytes",
        "tags": "tokens",  # list<int64>: token ids, as Hugging Face's Sequence(int) columns
    }
    samples = list(src.items())
    assert [s.key for s in samples] == [f"t/{i:09d}" for i in range(5)]
    f0, f1 = dict(samples[0].fields), dict(samples[1].fields)
    assert f0["blob"] == rows[0]["blob"] and f0["label"] == b"0" and "tags" not in f0
    assert f1["tags"] == np.array([1, 2], "<i8").tobytes()  # list<int64>: token ids
    assert f1["text"] == rows[1]["text"].encode()


def test_single_file_source(tmp_path):
    jsonl(str(tmp_path / "corpus.jsonl"), ["x", "y"])
    src = discover(str(tmp_path / "corpus.jsonl"))
    assert _keys(src.items()) == ["corpus/000000001", "corpus/000000002"]


def test_hidden_files_are_ignored(tmp_path):
    class_folders(str(tmp_path), per_class=1)
    write(str(tmp_path), ".DS_Store", b"junk")
    write(str(tmp_path), "cat/.thumbs/x.db", b"junk")
    assert discover(str(tmp_path)).layout == "class-folders"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "empty source"),
        ({"a/b/c/README": b"x"}, "unknown layout.*README"),
        ({"d.jsonl": b"{}\n", "img/1.jpg": b"x"}, "mixed layouts"),
    ],
)
def test_bad_layouts_are_usage_errors(tmp_path, files, message):
    for rel, data in files.items():
        write(str(tmp_path), rel, data)
    with pytest.raises(UsageError, match=message):
        list(discover(str(tmp_path)).items())


def test_record_files_with_the_same_stem_are_refused(tmp_path):
    write(str(tmp_path), "a.jsonl", b"{}\n")
    write(str(tmp_path), "a.jsonl.gz", b"")
    # Two record files of one corpus, not one sample with two fields: refused, naming both.
    with pytest.raises(UsageError, match="'a.jsonl' and 'a.jsonl.gz' both give sample keys"):
        discover(str(tmp_path))
    with pytest.raises(UsageError, match="both give sample keys"):
        discover(str(tmp_path), layout="records")


def test_missing_source_and_forced_layout_mismatch(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        discover(str(tmp_path / "nope"))
    key_groups(str(tmp_path), n=2)
    with pytest.raises(UsageError, match="not an image at SRC/<class>/<image>"):
        discover(str(tmp_path), layout="class-folders")
    with pytest.raises(UsageError, match="not a record file"):
        discover(str(tmp_path), layout="records")


def test_record_kind():
    assert record_kind("a/b.JSONL") == ("json", "a/b")
    assert record_kind("a/b.txt.zst") == ("txt", "a/b")
    assert record_kind("x.parquet") == ("parquet", "x")
    assert record_kind("x.arrow") == ("arrow", "x")
    assert record_kind("x.parquet.gz") is None
    assert record_kind("x.json") is None
    assert record_kind(".jsonl") is None
