"""Every input kind × output format round-trips byte for byte; peers read our tar shards."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest
from corpus import (
    class_folders,
    docs,
    jpeg,
    jsonl,
    key_groups,
    mask_png,
    parquet,
    read_back,
    sidecar,
    write,
)

from shardloader.errors import UsageError
from shardloader.format import get_format
from shardloader.pack import PackOptions, pack

# webdataset leaves shard files to the garbage collector
_WDS_LEAKS = [
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


def _expected_files(files: dict[str, bytes], classes: list[str]) -> dict[str, dict[str, bytes]]:
    """{key: fields} a class-folder pack must give."""
    out = {}
    for rel, data in files.items():
        cls, base = rel.split("/")
        out[f"{cls}/{base.split('.')[0]}"] = {"jpg": data, "cls": b"%d" % classes.index(cls)}
    return out


@pytest.mark.parametrize(
    ("fmt", "compression"),
    [("tar", "zstd"), ("tar", "gzip"), ("tar", "none"), ("arrow", "zstd"), ("arrow", "none")],
)
def test_class_folders_round_trip(tmp_path, fmt, compression):
    files = class_folders(str(tmp_path / "src"))
    report = pack(
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        PackOptions(format=fmt, compression=compression, max_samples=5),
    )
    manifest, samples = read_back(str(tmp_path / "out"))
    assert dict(samples) == _expected_files(files, ["cat", "dog", "eel"])
    assert [k for k, _ in samples] == sorted(k for k, _ in samples)
    assert manifest.classes == ("cat", "dog", "eel") and manifest.layout == "class-folders"
    assert [s.num_samples for s in manifest.shards] == [5, 5, 2]
    assert all(s.path.endswith(get_format(fmt).suffix(compression)) for s in manifest.shards)
    assert report.samples == 12 and report.bytes_in == sum(len(v) for v in files.values())


def test_key_groups_round_trip_every_member(tmp_path):
    files = key_groups(str(tmp_path / "src"), n=7)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(max_samples=3))
    manifest, samples = read_back(str(tmp_path / "out"))
    got = {f"{key}.{ext}": data for key, fields in samples for ext, data in fields.items()}
    assert got == files
    assert manifest.fields["seg.png"].codec == "image" and manifest.fields["json"].codec == "json"
    # text lengths (bytes of the .txt caption, 0 where a sample has none) are in the sidecars
    lengths = [
        int(n)
        for s in manifest.shards
        for n in sidecar(str(tmp_path / "out"), s.index_path).lengths
    ]
    assert lengths == [len(dict(f).get("txt", b"")) for _, f in samples]
    assert manifest.length_field == "txt" and manifest.extra["length_unit"] == "bytes"


@pytest.mark.parametrize("compress", [None, "gzip", "zstd"])
def test_jsonl_round_trip_with_byte_lengths(tmp_path, compress):
    texts = docs(40)
    suffix = {None: "", "gzip": ".gz", "zstd": ".zst"}[compress]
    lines = jsonl(str(tmp_path / f"src/part-0.jsonl{suffix}"), texts, compress=compress)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(shard_size=8192))
    manifest, samples = read_back(str(tmp_path / "out"))
    assert [f["json"] for _, f in samples] == lines
    assert [k for k, _ in samples] == [f"part-0/{i:09d}" for i in range(1, 41)]
    assert manifest.length_field == "text"
    lengths = [
        int(n)
        for s in manifest.shards
        for n in sidecar(str(tmp_path / "out"), s.index_path).lengths
    ]
    assert lengths == [len(t.encode()) for t in texts]
    assert len(manifest.shards) > 1
    assert all(s.raw_bytes <= 8192 for s in manifest.shards)


def test_txt_records_and_arrow_output(tmp_path):
    write(str(tmp_path / "src"), "a.txt", "héllo\nworld\n\nlast".encode())
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(format="arrow"))
    manifest, samples = read_back(str(tmp_path / "out"))
    assert samples == [
        ("a/000000001", {"txt": "héllo".encode()}),
        ("a/000000002", {"txt": b"world"}),
        ("a/000000004", {"txt": b"last"}),
    ]
    assert list(sidecar(str(tmp_path / "out"), manifest.shards[0].index_path).lengths) == [6, 5, 4]


@pytest.mark.parametrize("fmt", ["tar", "arrow", "tokens"])
def test_parquet_rows_round_trip(tmp_path, fmt):
    rows = parquet(str(tmp_path / "src/t.parquet"), 9)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(format=fmt, max_samples=4))
    manifest, samples = read_back(str(tmp_path / "out"))
    assert len(samples) == 9
    for (_, fields), row in zip(samples, rows, strict=True):
        assert fields["blob"] == row["blob"]
        assert fields["text"] == row["text"].encode()
        assert int(fields["label"]) == row["label"]
        assert json.loads(fields["score"]) == row["score"]
        assert ("tags" in fields) == (row["tags"] is not None)
    assert manifest.fields["blob"].codec == "bytes"


def test_planned_size_is_the_written_size(tmp_path):
    """Shard boundaries come from exact uncompressed tar sizes (long and non-ASCII names too)."""
    src = tmp_path / "src"
    write(str(src), "x" * 120 + "/0001.bin", b"a" * 700)
    write(str(src), "ü/0002.bin", b"b" * 512)
    write(str(src), "plain/0003.bin", b"c")
    for i in range(20):
        write(str(src), f"n/{i:04d}.bin", bytes(range(i * 37 % 256)) * (i + 1))
    from shardloader.pack.discover import discover
    from shardloader.pack.plan import Planner

    plans = list(Planner("tar", 6000, None).shards(discover(str(src)).items()))
    report = pack(str(src), str(tmp_path / "out"), PackOptions(shard_size=6000, compression="none"))
    assert [p.raw_bytes for p in plans] == [s.raw_bytes for s in report.manifest.shards]
    assert [s.raw_bytes for s in report.manifest.shards] == [
        os.path.getsize(tmp_path / "out" / s.path) for s in report.manifest.shards
    ]
    assert all(s.raw_bytes <= 6000 for s in report.manifest.shards)


@pytest.mark.parametrize("compression", ["none", "gzip"])
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_reads_our_tar_shards(tmp_path, compression):
    import webdataset as wds

    files = key_groups(str(tmp_path / "src"), n=7)
    report = pack(
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        PackOptions(compression=compression, max_samples=3),
    )
    urls = [str(tmp_path / "out" / s.path) for s in report.manifest.shards]
    got = {}
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        for ext, data in sample.items():
            if not ext.startswith("__"):
                got[f"{sample['__key__']}.{ext}"] = data
    assert got == files


@pytest.mark.subprocess
@pytest.mark.skipif(
    shutil.which("zstd") is None,
    reason="the zstd command-line tool is missing (apt-get install zstd)",
)
def test_zstd_cli_and_tar_list_our_shards(tmp_path):
    files = class_folders(str(tmp_path / "src"), per_class=2)
    report = pack(str(tmp_path / "src"), str(tmp_path / "out"))
    path = tmp_path / "out" / report.manifest.shards[0].path
    tar = subprocess.run(["zstd", "-d", "-c", str(path)], check=True, capture_output=True).stdout
    names = subprocess.run(["tar", "t"], input=tar, check=True, capture_output=True).stdout
    members = names.decode().split()
    assert members == sorted(
        [f"{r.split('.')[0]}.jpg" for r in files] + [f"{r.split('.')[0]}.cls" for r in files]
    )
    listing = subprocess.run(
        ["tar", "tv", "--numeric-owner"], input=tar, check=True, capture_output=True
    ).stdout.decode()
    assert "1970-01-01" in listing and "0/0" in listing


def test_pickled_inputs_are_stored_opaque_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    files = key_groups(str(tmp_path / "src"), n=3, marker=str(marker))
    for extra in ("pyd", "pth"):
        write(str(tmp_path / "src"), f"b/0001.{extra}", files["b/0001.pkl"])
    report = pack(str(tmp_path / "src"), str(tmp_path / "out"))
    manifest, samples = read_back(str(tmp_path / "out"))
    fields = dict(samples)["b/0001"]
    assert fields["pkl"] == fields["pyd"] == fields["pth"] == files["b/0001.pkl"]
    assert {manifest.fields[e].codec for e in ("pkl", "pyd", "pth")} == {"opaque"}
    from shardloader.read.summary import inspect_dataset
    from shardloader.read.verify import verify_dataset

    inspect_dataset(report.out)
    assert verify_dataset(report.out).ok
    assert not marker.exists()


def test_arrow_shards_roll_over_by_size(tmp_path):
    class_folders(str(tmp_path / "src"), per_class=5)
    report = pack(
        str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(format="arrow", shard_size=3000)
    )
    assert len(report.manifest.shards) > 2
    assert all(s.raw_bytes <= 3000 or s.num_samples == 1 for s in report.manifest.shards)
    assert sorted(glob.glob(str(tmp_path / "out" / "*.arrow"))) == sorted(
        str(tmp_path / "out" / p) for s in report.manifest.shards for p in (s.path, s.index_path)
    )


def test_urls_in_and_out(tmp_path):
    """The whole path is URL-based: fsspec's memory:// stands in for an object store here
    (S3 itself is tested against a local server by the storage tests)."""
    import fsspec

    from shardloader.read.summary import inspect_dataset
    from shardloader.read.verify import verify_dataset

    fs = fsspec.filesystem("memory")
    files = key_groups(str(tmp_path / "src"), n=5)
    for rel, data in files.items():
        fs.pipe_file(f"/sl-src/{rel}", data)
    try:
        report = pack("memory://sl-src", "memory://sl-out", PackOptions(max_samples=2))
        assert sorted(fs.ls("/sl-out", detail=False)) == sorted(
            ["/sl-out/index.json"]
            + [f"/sl-out/{p}" for s in report.manifest.shards for p in (s.path, s.index_path)]
        )
        assert inspect_dataset("memory://sl-out").num_samples == 5
        assert verify_dataset("memory://sl-out", images=False).ok
        again = pack("memory://sl-src", "memory://sl-out", PackOptions(max_samples=2, resume=True))
        assert again.kept_shards == 3 and again.manifest == report.manifest
    finally:
        fs.rm("/sl-src", recursive=True)
        if fs.exists("/sl-out"):
            fs.rm("/sl-out", recursive=True)


def test_two_images_per_key_are_key_groups(tmp_path):
    write(str(tmp_path / "src"), "a/0001.jpg", jpeg(1))
    write(str(tmp_path / "src"), "a/0001.png", mask_png(1))
    # Two images in a class folder, or one sample of two images: both readings fit.
    with pytest.raises(UsageError, match="ambiguous layout: 'class-folders' and 'key-groups'"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
    report = pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(layout="key-groups"))
    assert report.manifest.layout == "key-groups" and report.samples == 1
