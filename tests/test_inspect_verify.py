"""``inspect`` summarises from manifest + sidecars; ``verify`` finds every kind of damage."""

from __future__ import annotations

import json
import os

import pytest
from corpus import class_folders, docs, jsonl, key_groups
from synthetic import write_manifest, write_shard

from shardloader.manifest import FieldInfo, Manifest
from shardloader.pack import PackOptions, pack
from shardloader.summary import inspect_dataset
from shardloader.verify import verify_dataset


def test_inspect_class_folders(tmp_path):
    class_folders(str(tmp_path / "src"), classes=("b", "a"), per_class=3)
    report = pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(max_samples=4))
    s = inspect_dataset(str(tmp_path / "out"))
    assert (s.num_shards, s.num_samples) == (2, 6)
    assert s.classes == (("a", 3), ("b", 3))
    assert s.shard_samples.min == 2 and s.shard_samples.max == 4
    assert s.bytes == report.bytes_out and s.raw_bytes == report.raw_bytes
    assert s.sample_bytes.count == 6 and s.lengths is None
    assert s.fields == {"cls": {"codec": "int"}, "image": {"codec": "image"}}
    json.dumps(s.to_dict())  # machine-readable


def test_inspect_records_lengths(tmp_path):
    texts = docs(50)
    jsonl(str(tmp_path / "d.jsonl"), texts)
    pack(str(tmp_path / "d.jsonl"), str(tmp_path / "out"), PackOptions(max_samples=20))
    s = inspect_dataset(str(tmp_path / "out"))
    sizes = [len(t.encode()) for t in texts]
    assert s.length_field == "text" and s.length_unit == "bytes"
    assert (s.lengths.min, s.lengths.max, s.lengths.total) == (min(sizes), max(sizes), sum(sizes))
    assert s.classes == ()


@pytest.fixture
def packed(tmp_path):
    key_groups(str(tmp_path / "src"), n=12)
    out = tmp_path / "out"
    report = pack(str(tmp_path / "src"), str(out), PackOptions(max_samples=4))
    return out, report.manifest


def test_verify_passes_a_good_pack(packed):
    out, manifest = packed
    r = verify_dataset(str(out), images=False)
    assert r.ok and r.samples == 12 and r.shards == 3


def test_verify_flags_a_flipped_byte(packed):
    out, manifest = packed
    path = out / manifest.shards[1].path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x55
    path.write_bytes(bytes(data))
    r = verify_dataset(str(out), images=False)
    assert [b.path for b in r.bad] == [manifest.shards[1].path]
    assert any("sha256" in x or "decompress" in x or "corrupt" in x for x in r.bad[0].reasons)


def test_verify_flags_truncated_missing_and_swapped(packed):
    out, manifest = packed
    s0, s1, s2 = manifest.shards
    path = out / s0.path
    path.write_bytes(path.read_bytes()[:-20])
    os.remove(out / s1.path)
    (out / s2.index_path).write_bytes((out / s1.index_path).read_bytes())
    r = verify_dataset(str(out), images=False)
    bad = {b.path: " | ".join(b.reasons) for b in r.bad}
    assert set(bad) == {s0.path, s1.path, s2.path}
    assert "cannot read" in bad[s1.path] or "No such file" in bad[s1.path]
    assert "does not match its sha256" in bad[s2.path]
    assert "the sidecar does not match the shard" in bad[s2.path]  # its ranges are checked


def test_verify_parses_every_field(tmp_path):
    """A shard whose bytes match the manifest but whose JSON field is broken is still bad."""
    fields = {"json": FieldInfo("json"), "jpg": FieldInfo("image")}
    samples = [
        ("k/1", {"json": b'{"ok": 1}'}),
        ("k/2", {"json": b'{"ok": '}),
        ("k/3", {"jpg": b"not an image"}),
    ]
    shard = write_shard(str(tmp_path), "shard-00000.tar", "tar", "none", fields, samples)
    write_manifest(str(tmp_path), Manifest("tar", "none", fields, [shard]))
    r = verify_dataset(str(tmp_path))
    [bad] = r.bad
    assert any("'k/2'" in x and "invalid JSON" in x for x in bad.reasons)
    assert any("'k/3'" in x and "image" in x for x in bad.reasons)
    cheap = verify_dataset(str(tmp_path), images=False).bad[0].reasons  # header check only
    assert len(cheap) == 2 and any("'k/3'" in x and "not an image PIL can" in x for x in cheap)
