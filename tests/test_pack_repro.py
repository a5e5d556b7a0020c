"""Reproducible bytes whatever --workers; parts + merge equal a single pack; resume."""

from __future__ import annotations

import os

import pytest
from corpus import class_folders, docs, jsonl, key_groups, read_back, tree

from shardloader.errors import ManifestError, UsageError
from shardloader.pack import PackOptions, pack
from shardloader.pack.merge import merge


def _mixed_records(root: str) -> None:
    texts = docs(60, seed=3)
    jsonl(os.path.join(root, "a/part-0.jsonl"), texts[:25], extra_lines={4: b"{broken"})
    jsonl(os.path.join(root, "a/part-1.jsonl.gz"), texts[25:], compress="gzip")


def test_workers_do_not_change_a_byte(tmp_path):
    key_groups(str(tmp_path / "src"), n=30)
    opts = dict(max_samples=4, compression="zstd")
    pack(str(tmp_path / "src"), str(tmp_path / "w1"), PackOptions(workers=1, **opts))
    pack(str(tmp_path / "src"), str(tmp_path / "w2"), PackOptions(workers=2, **opts))
    one, two = tree(str(tmp_path / "w1")), tree(str(tmp_path / "w2"))
    assert one == two
    assert len([p for p in one if p.endswith(".tar.zst")]) == 8


def test_same_input_elsewhere_gives_the_same_bytes(tmp_path):
    """No absolute paths, times or owners leak into shards, sidecars, manifest or skip report."""
    for name in ("x", "y"):
        _mixed_records(str(tmp_path / name / "src"))
        pack(
            str(tmp_path / name / "src"),
            str(tmp_path / name / "out"),
            PackOptions(shard_size=4096, on_error="skip"),
        )
    assert tree(str(tmp_path / "x" / "out")) == tree(str(tmp_path / "y" / "out"))


@pytest.mark.parametrize("layout", ["class-folders", "records"])
def test_parts_then_merge_equal_a_single_pack(tmp_path, layout):
    src = str(tmp_path / "src")
    if layout == "class-folders":
        class_folders(src, classes=("a", "b", "c", "d"), per_class=5)
        opts: dict = dict(max_samples=3)
    else:
        _mixed_records(src)
        opts = dict(shard_size=3000, on_error="skip")
    single = pack(src, str(tmp_path / "single"), PackOptions(**opts))
    parts = [str(tmp_path / f"part-{i}") for i in range(3)]
    for i, out in enumerate(parts):
        r = pack(src, out, PackOptions(num_parts=3, part=i, **opts))
        assert r.manifest.classes == single.manifest.classes  # full class list in every part
        numbers = [int(s.path[6:11]) for s in single.manifest.shards]  # shard-NNNNN.tar.zst
        assert r.manifest.extra["part"]["shard_numbers"] == [n for n in numbers if n % 3 == i]
    report = merge(list(reversed(parts)), str(tmp_path / "merged"))
    assert report.mode == "copy"
    assert tree(str(tmp_path / "merged")) == tree(str(tmp_path / "single"))
    if layout == "records":
        assert single.skipped == 1 and "skipped.jsonl" in tree(str(tmp_path / "merged"))


def test_merge_in_place_references_part_shards(tmp_path):
    src = str(tmp_path / "src")
    class_folders(src, per_class=4)
    single = pack(src, str(tmp_path / "single"), PackOptions(max_samples=2))
    job = tmp_path / "job"
    for i in range(2):
        pack(src, str(job / f"part-{i:04d}"), PackOptions(num_parts=2, part=i, max_samples=2))
    report = merge([str(job / "part-0001"), str(job / "part-0000")], str(job))
    assert report.mode == "reference" and report.bytes_copied == 0
    assert report.manifest.shards[1].path == "part-0001/part-0001-shard-00000.tar.zst"
    assert read_back(str(job))[1] == read_back(str(tmp_path / "single"))[1]
    assert report.manifest.fingerprint != single.manifest.fingerprint  # paths differ, data not


def test_merge_refuses_incomplete_or_mismatched_parts(tmp_path):
    src = str(tmp_path / "src")
    class_folders(src, per_class=2)
    for i in range(2):
        pack(src, str(tmp_path / f"p{i}"), PackOptions(num_parts=2, part=i, max_samples=2))
    pack(src, str(tmp_path / "other"), PackOptions(num_parts=2, part=1, max_samples=3))
    pack(src, str(tmp_path / "whole"), PackOptions(max_samples=2))
    with pytest.raises(UsageError, match="missing"):
        merge([str(tmp_path / "p0")], str(tmp_path / "m1"))
    with pytest.raises(ManifestError, match="different plan"):
        merge([str(tmp_path / "p0"), str(tmp_path / "other")], str(tmp_path / "m2"))
    with pytest.raises(ManifestError, match="not the output of a partial pack"):
        merge([str(tmp_path / "whole")], str(tmp_path / "m3"))


def test_resume_keeps_intact_shards_and_redoes_the_rest(tmp_path):
    src, out = str(tmp_path / "src"), tmp_path / "out"
    key_groups(src, n=24)
    first = pack(src, str(out), PackOptions(max_samples=3))
    reference = tree(str(out))
    shards = first.manifest.shards
    # an interrupted run: no manifest, one shard missing, one damaged, one without sidecar,
    # a temporary file left behind
    os.remove(out / "index.json")
    os.remove(out / shards[2].path)
    with open(out / shards[5].path, "r+b") as f:
        f.seek(40)
        f.write(b"\xff")
    os.remove(out / shards[6].index_path)
    (out / f".{shards[7].path}.tmp-{'0' * 32}").write_bytes(b"partial")
    again = pack(src, str(out), PackOptions(max_samples=3, resume=True))
    assert again.kept_shards == len(shards) - 3
    assert tree(str(out)) == reference


def test_resume_repacks_a_shard_whose_sidecar_lacks_the_figures(tmp_path):
    """A sidecar of the same plan without ``field_samples`` (or another figure a kept shard
    takes from it) is no error: that shard is packed again, the manifest counts every shard."""
    from shardloader.manifest import SampleIndex
    from shardloader.pack.resume import sidecar_bytes, sidecar_meta

    src, out = str(tmp_path / "src"), tmp_path / "out"
    key_groups(src, n=12)
    first = pack(src, str(out), PackOptions(max_samples=3))
    reference = tree(str(out))
    for shard, figure in zip(first.manifest.shards, ("field_samples", "bytes_in"), strict=False):
        path = str(out / shard.index_path)
        with open(path, "rb") as f:
            data = f.read()
        meta = sidecar_meta(data, path)
        del meta[figure]
        with open(path, "wb") as f:
            f.write(sidecar_bytes(SampleIndex.from_arrow_bytes(data, path), meta))
    os.remove(out / "index.json")
    again = pack(src, str(out), PackOptions(max_samples=3, resume=True))
    assert again.kept_shards == len(first.manifest.shards) - 2
    assert again.manifest.extra["field_samples"] == first.manifest.extra["field_samples"]
    assert tree(str(out)) == reference


def test_resume_with_other_options_repacks_and_removes_stale_shards(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    key_groups(src, n=12)
    pack(src, out, PackOptions(max_samples=2))
    again = pack(src, out, PackOptions(max_samples=5, resume=True))
    assert again.kept_shards == 0
    pack(src, str(tmp_path / "fresh"), PackOptions(max_samples=5))
    assert tree(out) == tree(str(tmp_path / "fresh"))
    done = pack(src, out, PackOptions(max_samples=5, resume=True, workers=1))
    assert done.kept_shards == len(done.manifest.shards)
