"""``pack`` checks every image cheaply by default (issue 10 item 4): empty files, headers PIL
cannot identify and truncated JPEG/PNG/WebP are an error naming the file, or a reported skip.
``--validate`` still decodes everything (tests/test_pack_errors.py)."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from click.testing import CliRunner
from corpus import MIXED_KINDS, class_folders, jpeg, mixed_image, write
from PIL import Image

from shardloader import codecs
from shardloader.cli import main
from shardloader.errors import InputError
from shardloader.pack import pack


def _webp() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((30, 40, 3), 90, np.uint8)).save(buf, "WEBP", quality=80)
    return buf.getvalue()


def _png() -> bytes:
    return mixed_image("png-rgb", 3)[1]


BAD = {
    "empty.jpg": (b"", "empty file"),
    "cut-jpeg.jpg": (jpeg(5, 64, 48)[:900], "truncated JPEG"),
    "cut-png.png": (_png()[:-40], "truncated PNG"),
    "cut-webp.webp": (_webp()[:-30], "truncated WebP"),
    "noise.png": (b"this is not a picture at all" * 4, "not an image PIL can identify"),
    "header.jpg": (jpeg(6)[:120], "damaged JPEG header"),
    "cut-bmp.bmp": (mixed_image("bmp", 4)[1][:20], "damaged image header"),
    "noframe.jpg": (
        b"\xff\xd8\xff\xe0\x00\x04ab\xff\xda\x00\x02" + bytes(50) + b"\xff\xd9",
        "image data before any frame header",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_broken_image_fails_the_pack_naming_the_file(tmp_path, name):
    data, reason = BAD[name]
    class_folders(str(tmp_path / "src"), per_class=2)
    write(str(tmp_path / "src"), f"dog/{name}", data)
    with pytest.raises(InputError) as err:
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
    message = str(err.value)
    assert f"dog/{name}" in message and reason in message and "--on-error skip" in message
    assert not os.path.exists(tmp_path / "out" / "index.json")


def test_broken_images_exit_1_or_are_skipped_and_reported(tmp_path):
    src = tmp_path / "src"
    class_folders(str(src), per_class=3)
    for name, (data, _) in BAD.items():
        write(str(src), f"eel/{name}", data)
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "out")])
    assert r.exit_code == 1 and "eel/" in r.stderr, r.output
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "skip"), "--on-error", "skip"])
    assert r.exit_code == 0, r.output
    assert f"skipped {len(BAD)}" in r.stdout and "layout class-folders" in r.stdout
    with open(tmp_path / "skip" / "skipped.jsonl") as f:
        skipped = {json.loads(line)["file"]: json.loads(line)["reason"] for line in f}
    assert skipped.keys() == {f"eel/{name}" for name in BAD}
    for name, (_, reason) in BAD.items():
        assert reason in skipped[f"eel/{name}"]


@pytest.mark.parametrize("tail", [b"", b"\0" * 64, b"camera trailer \xff\xd8 after EOI"])
def test_complete_images_pass_whatever_follows_their_end(tail):
    codecs.check_image(jpeg(1, 64, 48) + tail)
    codecs.check_image(_png() + tail)


@pytest.mark.parametrize(
    "options",
    [
        {"progressive": True},
        {"optimize": True},
        {"quality": 20, "subsampling": 2},
        {"exif": b"Exif\x00\x00" + bytes(600), "icc_profile": bytes(3000)},
        {"restart_marker_blocks": 1},
    ],
)
def test_every_real_format_and_mode_passes(options):
    for kind in MIXED_KINDS:
        codecs.check_image(mixed_image(kind, 2)[1])
    image = Image.fromarray((np.random.default_rng(0).random((64, 80, 3)) * 255).astype("uint8"))
    for mode in ("RGB", "L", "CMYK"):
        buf = io.BytesIO()
        image.convert(mode).save(buf, "JPEG", **options)
        data = buf.getvalue()
        codecs.check_image(data)
        for cut in (len(data) // 3, len(data) - 2):  # cut in the header or the image data
            with pytest.raises(InputError, match="(truncated|damaged) JPEG"):
                codecs.check_image(data[:cut])
