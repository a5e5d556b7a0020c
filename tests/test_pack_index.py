"""``index``: manifests for shards webdataset wrote, without rewriting them."""

from __future__ import annotations

import os
import shutil
import tarfile

import pytest
from corpus import jpeg, key_groups, sidecar, tar_file, tree

from shardloader.errors import OutputExistsError, UsageError
from shardloader.format.tar.reader import TarShardReader
from shardloader.pack import PackOptions, pack
from shardloader.pack.index_existing import index_shards
from shardloader.read.verify import verify_dataset


def _wds_shards(folder, n=11, per_shard=4, suffix=".tar"):
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    samples = []
    for i in range(n):
        samples.append(
            {"__key__": f"s{i:05d}", "jpg": jpeg(i), "txt": f"caption {i}" * (i + 1), "cls": i % 3}
        )
    pattern = os.path.join(folder, f"train-%03d{suffix}")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for s in samples:
            sink.write(s)
    return samples


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz"])
def test_index_webdataset_shards_in_place(tmp_path, suffix):
    folder = tmp_path / "shards"
    samples = _wds_shards(str(folder), suffix=suffix)
    before = tree(str(folder))
    report = index_shards([str(folder)], str(folder))
    m = report.manifest
    assert [s.path for s in m.shards] == [f"train-00{i}{suffix}" for i in range(3)]
    assert m.compression == ("gzip" if suffix == ".tar.gz" else "none")
    assert [s.num_samples for s in m.shards] == [4, 4, 3]
    assert {k: v.codec for k, v in m.fields.items()} == {
        "jpg": "image",
        "txt": "text",
        "cls": "int",
    }
    assert m.length_field == "txt"
    after = tree(str(folder))
    assert {k: v for k, v in after.items() if k in before} == before  # shards untouched
    assert verify_dataset(str(folder)).ok
    # random access through the sidecar offsets (on the uncompressed tar)
    first = m.shards[1]
    raw = folder / first.path
    if suffix == ".tar.gz":
        import gzip

        (tmp_path / "staged.tar").write_bytes(gzip.decompress(raw.read_bytes()))
        raw = tmp_path / "staged.tar"
    index = sidecar(str(folder), first.index_path)
    reader = TarShardReader(str(raw), index)
    key, fields = reader.read(2)
    reader.close()
    assert key == "s00006" and fields["jpg"] == samples[6]["jpg"]
    assert fields["txt"].decode() == samples[6]["txt"]
    assert list(index.lengths) == [len(s["txt"]) for s in samples[4:8]]


def test_index_into_a_folder_above_and_refuse_existing_manifest(tmp_path):
    _wds_shards(str(tmp_path / "data/shards"), n=5)
    urls = sorted(str(p) for p in (tmp_path / "data/shards").iterdir())
    report = index_shards(urls, str(tmp_path / "data"))
    assert report.manifest.shards[0].path == "shards/train-000.tar"
    assert report.manifest.shards[0].index_path == "shards/train-000.idx.arrow"
    assert verify_dataset(str(tmp_path / "data")).ok
    with pytest.raises(OutputExistsError):
        index_shards(urls, str(tmp_path / "data"))
    index_shards(urls[:1], str(tmp_path / "data"), overwrite=True)


def test_index_refuses_shards_outside_out(tmp_path):
    """A manifest never points outside its folder (schema.py refuses '..' paths on load)."""
    _wds_shards(str(tmp_path / "shards"), n=5)
    urls = sorted(str(p) for p in (tmp_path / "shards").iterdir())
    with pytest.raises(UsageError, match="not below"):
        index_shards(urls, str(tmp_path / "meta"))
    assert not (tmp_path / "meta" / "index.json").exists()


def test_index_gives_our_own_sidecar_offsets(tmp_path):
    key_groups(str(tmp_path / "src"), n=9)
    report = pack(
        str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(compression="none", max_samples=4)
    )
    (tmp_path / "idx").mkdir()
    for shard in report.manifest.shards:
        shutil.copy(tmp_path / "out" / shard.path, tmp_path / "idx" / shard.path)
    indexed = index_shards([str(tmp_path / "idx")], str(tmp_path / "idx"))
    for ours, theirs in zip(report.manifest.shards, indexed.manifest.shards, strict=True):
        a = sidecar(str(tmp_path / "out"), ours.index_path)
        b = sidecar(str(tmp_path / "idx"), theirs.index_path)
        assert a.keys == b.keys
        assert list(a.offsets) == list(b.offsets) and list(a.sizes) == list(b.sizes)
        assert a.checksums is not None and list(a.checksums) == list(b.checksums)
        assert (ours.sha256, ours.raw_bytes, ours.bytes) == (
            theirs.sha256,
            theirs.raw_bytes,
            theirs.bytes,
        )


def test_index_handles_long_names_and_directories(tmp_path):
    """GNU tar / pax details: long member names, directory entries between samples."""
    path = tmp_path / "odd.tar"
    long_key = "d" * 90 + "/" + "k" * 40
    members = [
        ("dir/", None),
        (f"{long_key}.txt", b"long"),
        ("x/1.txt", b"one"),
        ("x/1.json", b"{}"),
        ("README", b"no ext"),
    ]
    tar_file(str(path), members, tarfile.GNU_FORMAT)
    m = index_shards([str(path)], str(tmp_path)).manifest
    index = sidecar(str(tmp_path), m.shards[0].index_path)
    assert index.keys == [long_key, "x/1"]
    reader = TarShardReader(str(path), index)
    assert reader.read(0) == (long_key, {"txt": b"long"})
    assert reader.read(1) == ("x/1", {"txt": b"one", "json": b"{}"})
    reader.close()


def test_index_refuses_what_it_cannot_index(tmp_path):
    (tmp_path / "a.jsonl").write_bytes(b"{}\n")
    with pytest.raises(UsageError, match="convert them with `shardloader pack`"):
        index_shards([str(tmp_path / "a.jsonl")], str(tmp_path / "out"))
    _wds_shards(str(tmp_path / "s1"), n=2)
    _wds_shards(str(tmp_path / "s2"), n=2, suffix=".tar.gz")
    with pytest.raises(UsageError, match="mix compressions"):
        index_shards([str(tmp_path / "s1"), str(tmp_path / "s2")], str(tmp_path / "out"))
