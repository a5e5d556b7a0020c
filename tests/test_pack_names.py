"""Names as people have them: file and tar member names that are not UTF-8 (Linux allows any
bytes), extensions in any case, ``--alias`` without case."""

from __future__ import annotations

import io
import json
import os
import tarfile
from urllib.parse import unquote_to_bytes

import numpy as np
import pytest
from helpers import run_cli

import shardloader as sl
from shardloader.format.keys import escape_name
from shardloader.pack import PackOptions, pack


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((8, 10, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(root: bytes, rel: bytes, data: bytes) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _keys(out) -> dict[str, dict]:
    return {s["__key__"]: s for s in sl.ShardedDataset(str(out), decoder=sl.Decoder())}


def test_escape_is_reversible_and_keeps_utf8_names():
    for raw in (b"caf\xe9", b"5%\xff off", b"\xc3\x28%41"):
        name = os.fsdecode(raw)
        escaped = escape_name(name)
        assert escaped.encode("utf-8")  # text now: goes into keys, JSON and tar headers
        assert unquote_to_bytes(escaped) == raw
    assert escape_name("Große Katze %41") == "Große Katze %41"  # UTF-8: unchanged


def test_non_utf8_file_names_pack_under_escaped_keys(tmp_path):
    """Old code: UnicodeEncodeError (surrogates not allowed) from the resume digest."""
    src = os.fsencode(tmp_path / "src")
    _write(src, b"caf\xe9/caf\xe9.jpg", _jpeg(1))  # a class folder too
    _write(src, b"caf\xe9/ok.jpg", _jpeg(2))
    _write(src, b"dog/r\xe9sum\xe9 100%.jpg", _jpeg(3))
    report = pack(os.fsdecode(src), str(tmp_path / "out"))
    assert report.manifest.classes == ("caf%E9", "dog")
    got = _keys(tmp_path / "out")
    assert sorted(got) == ["caf%E9/caf%E9", "caf%E9/ok", "dog/r%E9sum%E9 100%25"]
    assert unquote_to_bytes("dog/r%E9sum%E9 100%25") == b"dog/r\xe9sum\xe9 100%"
    assert got["dog/r%E9sum%E9 100%25"]["cls"] == 1
    assert tuple(got["caf%E9/caf%E9"]["image"].shape) == (3, 8, 10)


@pytest.mark.subprocess
def test_non_utf8_bad_file_is_skipped_and_listed_without_a_traceback(tmp_path):
    """Old code: a UnicodeEncodeError traceback, with --on-error skip too."""
    src = os.fsencode(tmp_path / "src")
    _write(src, b"cat/caf\xe9.jpg", _jpeg(1))
    _write(src, b"cat/bad\xff.jpg", b"not a jpeg")
    out = tmp_path / "out"
    r = run_cli("pack", os.fsdecode(src), str(out), "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "skipped 1" in r.stdout
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [s["file"] for s in skipped] == ["cat/bad%FF.jpg"]
    assert sorted(_keys(out)) == ["cat/caf%E9"]
    r = run_cli("pack", os.fsdecode(src), str(tmp_path / "out2"))  # without skip: one line, rc 1
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "cat/bad%FF" in r.stderr


@pytest.mark.subprocess
def test_index_refuses_a_non_utf8_tar_member_in_one_line(tmp_path):
    """Old code: a UnicodeEncodeError traceback from the sidecar's key column."""
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar:
        for name, data in (("caf\udce9.jpg", _jpeg(1)), ("caf\udce9.txt", b"a cat")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:  # the bytes on disk are the raw name
        assert tar.getnames()[0].encode("utf-8", "surrogateescape") == b"caf\xe9.jpg"
    r = run_cli("index", str(path), str(tmp_path))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "member name b'caf\\xe9.jpg' is not UTF-8" in r.stderr
    assert not (tmp_path / "index.json").exists()


# -- extensions without case; --alias without case --------------------------------------------


def test_extension_case_makes_one_image_field(tmp_path):
    """Old code: fields JPEG, JPG and jpg, three fields for one kind of image."""
    src = tmp_path / "src"
    src.mkdir()
    for i, ext in enumerate(["jpg", "JPG", "JPEG", "jpeg", "Jpg"]):
        (src / f"{i:04d}.{ext}").write_bytes(_jpeg(i))
    report = pack(str(src), str(tmp_path / "out"))
    m = report.manifest
    assert set(m.fields) == {"image"} and m.aliases == {"image": ("jpeg", "jpg")}
    assert any("fill the field 'image'" in note for note in report.notes)
    got = _keys(tmp_path / "out")
    assert sorted(got) == [f"{i:04d}" for i in range(5)]
    assert all(tuple(s["image"].shape) == (3, 8, 10) for s in got.values())
    with tarfile.open(fileobj=_tar_bytes(tmp_path / "out")) as tar:  # real member names
        assert sorted(tar.getnames()) == sorted(
            ["0000.jpg", "0001.jpg", "0002.jpeg", "0003.jpeg", "0004.jpg"]
        )


def _tar_bytes(out) -> io.BytesIO:
    import zstandard

    [shard] = [p for p in os.listdir(out) if p.endswith(".tar.zst")]
    return io.BytesIO(
        zstandard.ZstdDecompressor().decompressobj().decompress((out / shard).read_bytes())
    )


def test_alias_is_case_insensitive_and_image_pairs_keep_their_fields(tmp_path):
    """Old code: --alias pic=JPEG names no field (fields were case-sensitive)."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):  # an image and its mask: two images a sample, no image alias
        (src / f"{i:04d}.JPEG").write_bytes(_jpeg(i))
        (src / f"{i:04d}.PNG").write_bytes(_png(i))
    report = pack(str(src), str(tmp_path / "out"), PackOptions(aliases={"pic": ("JPEG",)}))
    assert report.manifest.aliases == {"pic": ("jpeg",)}
    assert set(report.manifest.fields) == {"pic", "png"}
    assert not report.notes or not any("'image'" in n for n in report.notes)


def _png(seed: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.full((8, 10), seed, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


# -- junk and img2dataset ---------------------------------------------------------------------


def _meta(i: int) -> dict:
    """A row as img2dataset writes it: nulls where a value is missing."""
    return {
        "url": f"http://example.com/{i}.jpg",
        "key": f"{i:09d}",
        "status": "success",
        "error_message": None,
        "caption": f"caption {i}",
        "width": 10,
        "height": 8,
        "original_width": 10,
        "original_height": 8,
        "exif": None,
        "sha256": None,
    }


def _img2dataset_folder(root, shards: int = 2, per: int = 4) -> None:
    """img2dataset's --output_format files: 00000/000000000.jpg|txt|json beside 00000.parquet
    and 00000_stats.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for s in range(shards):
        rows = []
        (root / f"{s:05d}").mkdir(parents=True)
        for j in range(per):
            i = s * 10000 + j
            (root / f"{s:05d}" / f"{i:09d}.jpg").write_bytes(_jpeg(i))
            (root / f"{s:05d}" / f"{i:09d}.txt").write_text(f"caption {i}")
            (root / f"{s:05d}" / f"{i:09d}.json").write_text(json.dumps(_meta(i)))
            rows.append(_meta(i))
        pq.write_table(pa.Table.from_pylist(rows), root / f"{s:05d}.parquet")
        (root / f"{s:05d}_stats.json").write_text(json.dumps({"count": per, "successes": per}))


def test_img2dataset_folder_packs_its_pairs_and_leaves_out_side_files(tmp_path):
    """Old code: auto detection refused the folder (mixed layouts), and --layout key-groups
    packed 4 side files as samples (12 for 8 images)."""
    src = tmp_path / "src"
    _img2dataset_folder(src)
    report = pack(str(src), str(tmp_path / "out"))
    assert report.samples == 8 and report.manifest.layout == "key-groups"
    assert set(report.manifest.fields) == {"image", "json", "txt"}
    assert dict(report.ignored) == {
        "00000.parquet": "img2dataset metadata table",
        "00000_stats.json": "img2dataset download stats",
        "00001.parquet": "img2dataset metadata table",
        "00001_stats.json": "img2dataset download stats",
    }
    got = _keys(tmp_path / "out")
    assert sorted(got) == sorted(f"{s:05d}/{s * 10000 + j:09d}" for s in range(2) for j in range(4))
    sample = got["00001/000010002"]
    assert sample["json"] == _meta(10002) and sample["json"]["exif"] is None  # nulls kept
    assert sample["txt"] == "caption 10002"


@pytest.mark.subprocess
def test_img2dataset_tars_pack_and_index_with_side_files_left_out(tmp_path):
    """Old code: pack made each tar, .parquet and _stats.json one sample of bytes, exit 0."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import webdataset as wds

    src = tmp_path / "tars"
    src.mkdir()
    for s in range(2):
        with wds.TarWriter(str(src / f"{s:05d}.tar")) as w:
            for j in range(3):
                i = s * 10000 + j
                w.write(
                    {
                        "__key__": f"{i:09d}",
                        "jpg": _jpeg(i),
                        "txt": f"caption {i}",
                        "json": _meta(i),
                    }
                )
        pq.write_table(pa.Table.from_pylist([_meta(s)]), src / f"{s:05d}.parquet")
        (src / f"{s:05d}_stats.json").write_text(json.dumps({"count": 3}))
    r = run_cli("pack", str(src), str(tmp_path / "out"), "--format", "arrow")
    assert r.returncode == 0, r.stderr
    assert "layout tars" in r.stdout and "samples   6" in r.stdout and "ignored   4:" in r.stdout
    packed = _keys(tmp_path / "out")
    assert sorted(packed) == sorted(f"{s * 10000 + j:09d}" for s in range(2) for j in range(3))
    r = run_cli("index", str(src), str(src))
    assert r.returncode == 0, r.stderr
    indexed = _keys(src)
    assert sorted(indexed) == sorted(packed)
    for key, sample in packed.items():
        assert sample["json"] == indexed[key]["json"] == _meta(int(key))  # nulls kept
        assert sample["txt"] == indexed[key]["txt"] == f"caption {int(key)}"
        assert torch_equal(sample["image"], indexed[key]["jpg"])


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a, b))


def test_a_stray_file_is_left_out_and_listed_not_packed(tmp_path):
    """Old code: val_labels.csv became the 7th sample, with a field of its own."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"img_{i}.jpg").write_bytes(_jpeg(i))
    (src / "val_labels.csv").write_text("img_0.jpg,1\n")
    report = pack(str(src), str(tmp_path / "out"))
    assert report.samples == 6 and set(report.manifest.fields) == {"image"}
    assert report.ignored == (
        ("val_labels.csv", "junk: shares no field with most samples (image)"),
    )
    from shardloader.cli.pack import format_report

    assert "ignored   1: 'val_labels.csv' (junk" in format_report(report)


# -- --labels: a flat image folder and a labels file ------------------------------------------


def _imagenet_val(root, n: int = 8) -> dict[str, str]:
    """ILSVRC2012_val_00000001.JPEG ... in one folder; {key: synset} as the labels CSV says."""
    root.mkdir(parents=True)
    synsets = {}
    for i in range(1, n + 1):
        name = f"ILSVRC2012_val_{i:08d}"
        from PIL import Image

        buf = io.BytesIO()
        rng = np.random.default_rng(i)
        Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
        (root / f"{name}.JPEG").write_bytes(buf.getvalue())
        synsets[name] = ["n01440764", "n01443537", "n01484850"][i % 3]
    return synsets


def test_imagenet_val_folder_with_a_labels_csv_runs_the_vision_recipe(tmp_path):
    """Old code: no --labels, and .JPEG became a field 'JPEG' that train_transform (field
    'image') cannot find."""
    import torch

    from shardloader import vision

    synsets = _imagenet_val(tmp_path / "val")
    csv_path = tmp_path / "LOC_val_solution.csv"
    csv_path.write_text(
        "ImageId,label\n" + "".join(f"{k},{v}\n" for k, v in reversed(synsets.items()))
    )
    report = pack(str(tmp_path / "val"), str(tmp_path / "out"), PackOptions(labels=str(csv_path)))
    classes = ("n01440764", "n01443537", "n01484850")
    assert report.manifest.classes == classes
    assert set(report.manifest.fields) == {"image", "cls"}
    ds = sl.ShardedDataset(
        str(tmp_path / "out"),
        batch_size=4,
        shuffle=True,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(32),
    )
    seen = {}
    for batch in sl.make_loader(ds, num_workers=2):
        assert batch["image"].dtype == torch.uint8 and tuple(batch["image"].shape) == (4, 3, 32, 32)
        seen.update(zip(batch["__key__"], batch["cls"].tolist(), strict=True))
    assert seen == {k: classes.index(v) for k, v in synsets.items()}


def test_devkit_label_list_gives_int_labels_in_sorted_file_order(tmp_path):
    synsets = _imagenet_val(tmp_path / "val", 5)
    ground_truth = tmp_path / "ILSVRC2012_validation_ground_truth.txt"
    ground_truth.write_text("".join(f"{100 + i}\n" for i in range(len(synsets))))
    report = pack(
        str(tmp_path / "val"), str(tmp_path / "out"), PackOptions(labels=str(ground_truth))
    )
    assert report.manifest.classes == ()  # integers stay integers
    got = _keys(tmp_path / "out")
    assert {k: s["cls"] for k, s in got.items()} == {
        k: 100 + i for i, k in enumerate(sorted(synsets))
    }


@pytest.mark.subprocess
def test_labels_that_miss_files_are_refused_or_skipped_and_listed(tmp_path):
    synsets = _imagenet_val(tmp_path / "val", 4)
    rows = [f"{k}.JPEG,{v}" for k, v in synsets.items()][1:]  # the first image has no label
    (tmp_path / "val" / "labels.csv").write_text("\n".join([*rows, "ILSVRC2012_val_99.JPEG,x"]))
    labels = str(tmp_path / "val" / "labels.csv")  # inside SRC: left out, not a sample
    r = run_cli("pack", str(tmp_path / "val"), str(tmp_path / "out"), "--labels", labels)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "1 file has no label (e.g. 'ILSVRC2012_val_00000001')" in r.stderr
    assert "1 label names no file (e.g. labels.csv line 4 (ILSVRC2012_val_99.JPEG))" in r.stderr
    assert not (tmp_path / "out" / "index.json").exists()
    r = run_cli(
        "pack",
        str(tmp_path / "val"),
        str(tmp_path / "out"),
        "--labels",
        labels,
        "--on-error",
        "skip",
    )
    assert r.returncode == 0, r.stderr
    assert "samples   3" in r.stdout and "ignored   3:" in r.stdout
    assert sorted(_keys(tmp_path / "out")) == sorted(synsets)[1:]
    r = run_cli("pack", str(tmp_path / "val"), str(tmp_path / "o2"), "--labels", str(tmp_path))
    assert r.returncode == 2 and "--labels" in r.stderr and "Traceback" not in r.stderr


def test_labels_refused_where_folders_name_the_classes(tmp_path):
    for c in ("cat", "dog"):
        (tmp_path / "src" / c).mkdir(parents=True)
        (tmp_path / "src" / c / "1.jpg").write_bytes(_jpeg(1))
    (tmp_path / "l.csv").write_text("cat/1.jpg,0\ndog/1.jpg,1\n")
    from shardloader.errors import UsageError

    with pytest.raises(UsageError, match="folder names are the labels already"):
        pack(
            str(tmp_path / "src"),
            str(tmp_path / "out"),
            PackOptions(labels=str(tmp_path / "l.csv")),
        )


def test_a_folder_of_two_kinds_keeps_both(tmp_path):
    """The junk rule leaves out rare strays, not the smaller half of a mixed folder."""
    from shardloader.pack.discover import discover

    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"{i}.wav").write_bytes(b"RIFF")
    for i in range(5, 9):
        (src / f"{i}.flac").write_bytes(b"fLaC")
    found = discover(str(src))
    assert found.ignored == () and set(found.fields) == {"wav", "flac"}
    assert len(list(found.items())) == 9
