"""Folders as users have them pack as they meant: class folders whatever the dots in the names,
nested subfolders, system junk left out and reported, symlinked class folders followed, sharded
record files recognised by their last extension, and an ambiguous tree refused naming both
readings."""

from __future__ import annotations

import gzip
import io
import json
import os

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner
from corpus import write

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import UsageError
from shardloader.pack import pack
from shardloader.pack.discover import discover


def _image(fmt: str, seed: int, mode: str = "RGB", **options) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((10, 12, 3)) * 255).astype(np.uint8)
    image = Image.fromarray(pixels).convert(mode)
    buf = io.BytesIO()
    image.save(buf, fmt, **options)
    return buf.getvalue()


def _jpeg(seed: int) -> bytes:
    return _image("JPEG", seed)


def _read_all(out) -> dict[str, dict]:
    ds = sl.ShardedDataset(str(out), decoder=sl.Decoder(image="numpy"))
    return {s["__key__"]: s for s in ds}


def test_kaggle_and_lfw_names_pack_as_class_folders(tmp_path):
    src = tmp_path / "src"
    for i in range(3):  # Kaggle's cats and dogs: the class again in every name, then a number
        write(str(src), f"cats/cat.{i}.jpg", _jpeg(i))
        write(str(src), f"dogs/dog.{i}.jpg", _jpeg(10 + i))
    for i in range(4):  # LFW: one person a folder, numbered images under one prefix
        write(str(src), f"Aaron_Eckhart/lfw.{i:03d}.jpg", _jpeg(20 + i))
    report = pack(str(src), str(tmp_path / "out"))
    m = report.manifest
    assert m.layout == "class-folders"
    assert report.samples == 10
    assert m.classes == ("Aaron_Eckhart", "cats", "dogs")
    assert set(m.fields) == {"image", "cls"}
    got = _read_all(tmp_path / "out")
    assert sorted(got) == sorted(
        [f"cats/cat_{i}" for i in range(3)]
        + [f"dogs/dog_{i}" for i in range(3)]
        + [f"Aaron_Eckhart/lfw_{i:03d}" for i in range(4)]
    )
    assert got["dogs/dog_2"]["cls"] == 2 and got["Aaron_Eckhart/lfw_003"]["cls"] == 0
    assert got["cats/cat_1"]["image"].shape == (10, 12, 3)


def test_nested_subfolders_junk_and_every_image_extension(tmp_path):
    src = tmp_path / "src"
    files = {
        "cat/indoor/001.jpg": _jpeg(1),
        "cat/indoor/deep/002.JPG": _jpeg(2),
        "cat/003.jfif": _jpeg(3),
        "cat/Große Katze.png": _image("PNG", 4, "P"),
        "cat/猫.webp": _image("WEBP", 5, lossless=True),
        "dog/001.jpg": _jpeg(6),
        "dog/001.png": _image("PNG", 7, "I;16"),  # the same stem as 001.jpg: two images
        "dog/scan.pgm": _image("PPM", 8, "L"),
        "dog/photo.avif": _image("AVIF", 9),
        "dog/x.bmp": _image("BMP", 10),
        "dog/anim.gif": _image("GIF", 11, "P"),
        "dog/cmyk.tif": _image("TIFF", 12, "CMYK"),
    }
    for rel, data in files.items():
        write(str(src), rel, data)
    junk = ["cat/Thumbs.db", "dog/desktop.ini", ".DS_Store", "dog/.DS_Store", "__MACOSX/._x"]
    for rel in junk:
        write(str(src), rel, b"junk")
    report = pack(str(src), str(tmp_path / "out"))
    assert report.manifest.layout == "class-folders"
    assert report.samples == len(files)
    assert dict(report.ignored) == {
        ".DS_Store": "hidden",
        "__MACOSX/": "system folder",
        "cat/Thumbs.db": "system file",
        "dog/.DS_Store": "hidden",
        "dog/desktop.ini": "system file",
    }
    got = _read_all(tmp_path / "out")
    assert {"cat/indoor/001", "cat/indoor/deep/002", "dog/001_jpg", "dog/001_png"} <= set(got)
    assert {k: v["cls"] for k, v in got.items() if k.startswith("cat/")} == dict.fromkeys(
        ["cat/indoor/001", "cat/indoor/deep/002", "cat/003", "cat/Große Katze", "cat/猫"], 0
    )
    for sample in got.values():  # every mode decodes to RGB
        assert sample["image"].shape == (10, 12, 3) and sample["image"].dtype == np.uint8
    # The CLI's summary says what was left out.
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "cli")])
    assert r.exit_code == 0, r.output
    assert "ignored   5: '.DS_Store' (hidden), '__MACOSX/' (system folder)" in r.stdout


def test_symlinked_class_folders_are_followed_and_loops_reported(tmp_path):
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    for i in range(3):
        write(str(src), f"cat/{i}.jpg", _jpeg(i))
        write(str(elsewhere), f"faces/{i}.jpg", _jpeg(10 + i))
    os.symlink(elsewhere / "faces", src / "faces")
    os.symlink(src, elsewhere / "faces" / "back")  # faces/back/ is SRC again: a loop
    os.symlink(src / "cat", src / "cat" / "again")  # a folder linked inside itself
    report = pack(str(src), str(tmp_path / "out"))
    assert report.manifest.classes == ("cat", "faces")
    assert report.samples == 6
    assert sorted(report.ignored) == [
        ("cat/again/", "symlink loop: leads back to a folder it is in"),
        ("faces/back/", "symlink loop: leads back to a folder it is in"),
    ]


def test_stray_files_beside_class_folders_are_an_error_not_key_groups(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        write(str(src), f"cat/{i}.jpg", _jpeg(i))
        write(str(src), f"dog/{i}.jpg", _jpeg(10 + i))
    write(str(src), "notes.txt", b"where these came from")
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert "mixed layouts: images in class folders (e.g. 'cat/0.jpg') next to other files " in (
        r.stderr
    )
    assert "'notes.txt'" in r.stderr


def test_class_folders_of_image_pairs_are_ambiguous_naming_both_readings(tmp_path):
    src = tmp_path / "src"
    for c in ("a", "b"):
        for i in range(3):
            write(str(src), f"{c}/{i:04d}.jpg", _jpeg(i))
            write(str(src), f"{c}/{i:04d}.seg.png", _image("PNG", i, "L"))
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert (
        "ambiguous layout: 'class-folders' and 'key-groups' both fit: as class-folders, 12 "
        "samples, one per image, in 2 classes (--layout class-folders); as key-groups, 6 samples "
        "with fields jpg, seg.png (--layout key-groups)"
    ) in r.stderr
    assert discover(str(src), "key-groups").layout == "key-groups"
    assert len(list(discover(str(src), "class-folders").items())) == 12


def test_a_real_webdataset_tree_is_still_key_groups(tmp_path):
    src = tmp_path / "src"
    for i in range(4):
        write(str(src), f"a/{i:04d}.jpg", _jpeg(i))
        write(str(src), f"a/{i:04d}.json", json.dumps({"i": i}).encode())
    assert discover(str(src)).layout == "key-groups"


def test_sharded_record_files_pack_as_records(tmp_path):
    src = tmp_path / "src"
    for n in range(2):  # Hugging Face / Megatron style shards of one corpus
        lines = [json.dumps({"text": f"doc {n}.{i}"}) for i in range(3)]
        write(str(src), f"train.{n:02d}.jsonl", ("\n".join(lines) + "\n").encode())
    write(str(src), "train.02.jsonl.gz", gzip.compress(b'{"text": "gz"}\n'))
    write(str(src), "train.03.jsonl.zst", zstandard.compress(b'{"text": "zst"}\n'))
    report = pack(str(src), str(tmp_path / "out"))
    assert report.manifest.layout == "records" and report.samples == 8
    got = _read_all(tmp_path / "out")
    assert got["train.01/000000002"]["json"] == {"text": "doc 1.1"}
    assert got["train.03/000000001"]["json"] == {"text": "zst"}


def test_dask_and_spark_parquet_parts_pack_as_records(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    for n in range(2):
        table = pa.table({"text": [f"row {n}.{i}" for i in range(3)], "label": [n, n, n]})
        pq.write_table(table, src / f"part.{n}.parquet")
    report = pack(str(src), str(tmp_path / "out"))
    assert report.manifest.layout == "records" and report.samples == 6
    got = _read_all(tmp_path / "out")
    assert got["part.1/000000002"]["text"] == "row 1.2" and got["part.1/000000002"]["label"] == 1


def test_text_files_with_dotted_names_are_records_not_mixed(tmp_path):
    src = tmp_path / "src"
    names = ["adduser.txt", "gir1.2-glib-2.0.txt", "gir1.2-gtk-3.0.txt", "libc6.txt"]
    for i, name in enumerate(names):
        write(str(src), name, f"Copyright {i}\nLicense line\n".encode())
    report = pack(str(src), str(tmp_path / "out"))
    assert report.manifest.layout == "records" and report.samples == 8
    assert _read_all(tmp_path / "out")["gir1.2-gtk-3.0/000000001"]["txt"] == "Copyright 2"


def test_captions_beside_images_stay_key_groups(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        write(str(src), f"{i:04d}.jpg", _jpeg(i))
        write(str(src), f"{i:04d}.txt", f"caption {i}".encode())
    src_ = discover(str(src))
    assert src_.layout == "key-groups" and set(src_.fields) == {"jpg", "txt"}


def test_only_junk_is_an_empty_source_saying_so(tmp_path):
    write(str(tmp_path / "src"), "Thumbs.db", b"junk")
    with pytest.raises(UsageError, match=r"empty source \(only hidden or system files"):
        discover(str(tmp_path / "src"))


def test_tokens_format_without_a_tokenizer_is_a_usage_error(tmp_path):
    write(str(tmp_path / "src"), "cat/0.jpg", _jpeg(0))
    r = CliRunner().invoke(
        main, ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "--format", "tokens"]
    )
    assert r.exit_code == 2, r.output
    assert "--format tokens lays out token ids: pass --tokenizer tokenizer.json" in r.stderr
    assert not os.path.exists(tmp_path / "out")
