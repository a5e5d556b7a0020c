"""Real image folders mix extensions and modes: one ``image`` field, correct RGB, every tool.

Issue 10 item 1: a class folder of .jpg/.jpeg/.png used to pack into fields jpg/jpeg/png, so
the README recipe, ``bench``, ``serve`` and the training examples failed on it.
"""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from corpus import (
    MIXED_KINDS,
    jpeg,
    mask_png,
    mixed_class_folders,
    mixed_image,
    pixels_match,
    read_back,
    write,
)
from PIL import Image

import shardloader as sl
from shardloader import vision
from shardloader.cli import main
from shardloader.codecs.allowlist import Decoder, decode_field
from shardloader.errors import ShardError, UsageError
from shardloader.manifest import Manifest
from shardloader.pack import PackOptions, pack

EXTENSIONS = ["bmp", "gif", "jpeg", "jpg", "png", "tiff", "webp"]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(raw folder, {key: (pixels, tolerance)}, packed tar.zst, packed arrow)."""
    root = tmp_path_factory.mktemp("mixed")
    want = mixed_class_folders(str(root / "raw"))
    pack(str(root / "raw"), str(root / "tar"), PackOptions(max_samples=7))
    pack(str(root / "raw"), str(root / "arrow"), PackOptions(format="arrow", max_samples=7))
    return str(root / "raw"), want, str(root / "tar"), str(root / "arrow")


@pytest.mark.slow
def test_a_class_folder_pack_has_one_image_field_whatever_the_extension(mixed):
    raw, want, tar, _ = mixed
    manifest, samples = read_back(tar)
    assert dict(manifest.fields) == {
        "cls": sl.manifest.FieldInfo("int"),
        "image": sl.manifest.FieldInfo("image"),
    }
    assert dict(manifest.aliases) == {"image": tuple(EXTENSIONS)}
    # members keep their real extension: webdataset and `tar t` see real files
    members = {ext for _, fields in samples for ext in fields if ext != "cls"}
    assert members == set(EXTENSIONS)
    with open(os.path.join(tar, "index.json"), "rb") as f:
        raw_manifest = json.load(f)
    assert raw_manifest["aliases"] == {"image": EXTENSIONS}
    assert Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.slow
def test_the_readme_vision_recipe_runs_on_a_mixed_folder(mixed):
    _, want, tar, _ = mixed
    ds = sl.ShardedDataset(
        tar,
        batch_size=4,
        shuffle=True,
        seed=17,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(24),
    )
    seen = []
    for batch in sl.make_loader(ds, num_workers=2):
        assert batch["image"].dtype == torch.uint8
        assert batch["image"].shape == (4, 3, 24, 24)
        seen += [k for k, pad in zip(batch["__key__"], batch["__pad__"], strict=True) if not pad]
    assert sorted(seen) == sorted(want)
    x = vision.Normalize()(batch["image"])
    assert x.dtype == torch.float32 and torch.isfinite(x).all()


@pytest.mark.slow
@pytest.mark.parametrize("packed", [2, 3], ids=["tar", "arrow"])
def test_the_default_decoder_gives_correct_rgb_for_every_mode(mixed, packed):
    _, want, *_ = mixed
    ds = sl.ShardedDataset(mixed[packed])
    got = {s["__key__"]: s["image"] for s in ds}
    assert got.keys() == want.keys()
    for key, image in got.items():
        pixels, tolerance = want[key]
        assert image.dtype == torch.uint8 and image.shape[0] == 3, key
        assert pixels_match(image.permute(1, 2, 0).numpy(), pixels, tolerance), key


@pytest.mark.parametrize("kind", MIXED_KINDS)
def test_decoder_modes_and_vision_agree(kind):
    _, data, pixels, tolerance = mixed_image(kind, 7)

    def decode(**options):
        return decode_field("image", "image", data, Decoder(**options))

    rgb = decode(image="numpy")
    assert rgb.dtype == np.uint8 and pixels_match(rgb, pixels, tolerance)
    # vision's fast path (bytes in, drafted decode) converts the same way as the Decoder
    assert torch.equal(vision.decode_image(data), decode(image="tensor"))
    assert torch.equal(vision.ToImageTensor()(data), decode(image="tensor"))
    assert np.array_equal(np.asarray(vision.open_image(data, target_size=8)), rgb)
    assert np.array_equal(np.asarray(decode(image="pil")), rgb)
    grey = decode(image="numpy", mode="L")
    assert grey.shape == (*rgb.shape[:2], 1) and grey.dtype == np.uint8
    rgba = decode(image="tensor", mode="RGBA")
    assert rgba.shape == (4, *rgb.shape[:2])
    if kind == "png-rgba":
        assert rgba[3].min() == 0 and rgba[3].max() == 255  # alpha kept, not composited
    kept = decode(image="numpy", mode=None)
    if kind == "png-16bit":
        assert kept.dtype == np.uint16 and np.array_equal(kept[:, :, 0] // 257, pixels[:, :, 0])
    if kind == "png-palette":
        assert kept.shape[2] == 1 and kept.max() <= 3  # palette indices, as stored


def test_sixteen_bit_and_transparency_are_not_clipped_or_dropped():
    """The two conversions PIL's plain convert("RGB") gets wrong, with named values."""
    wide = Image.fromarray(np.array([[0, 257 * 128, 65535]], np.uint16))
    buf = io.BytesIO()
    wide.save(buf, "PNG")
    got = decode_field("image", "image", buf.getvalue(), Decoder(image="numpy"))
    assert got[0, :, 0].tolist() == [0, 128, 255]  # clipping would give 0, 255, 255
    rgba = Image.fromarray(np.array([[[0, 0, 0, 0], [0, 0, 0, 255], [200, 0, 0, 128]]], np.uint8))
    buf = io.BytesIO()
    rgba.save(buf, "PNG")
    got = decode_field("image", "image", buf.getvalue(), Decoder(image="numpy"))
    assert got[0].tolist() == [[255, 255, 255], [0, 0, 0], [227, 127, 127]]  # over white


def test_bad_decoder_mode_is_a_clear_error():
    with pytest.raises(UsageError, match="mode='CMYK' is not one of RGB, RGBA, L"):
        Decoder(mode="CMYK")


@pytest.mark.slow
def test_bench_runs_on_a_mixed_folder(mixed):
    r = run(
        "bench",
        mixed[2],
        "--workers",
        "0",
        "--batches",
        "2",
        "--batch-size",
        "4",
        "--image-size",
        "16",
        "--json",
    )
    assert r.exit_code == 0, r.output
    results = json.loads(r.stdout)["results"]
    assert {p["decode"] for p in results} == {True, False}
    assert all(p["samples"] > 0 for p in results)


@pytest.mark.slow
def test_inspect_and_verify_name_the_aliases(mixed):
    r = run("verify", mixed[2])
    assert r.exit_code == 0 and "samples checked" in r.output, r.output
    r = run("pack", mixed[0], mixed[2] + "-again", "--shard-size", "1MB")
    assert r.exit_code == 0 and "image:image (bmp/gif/jpeg/jpg/png/tiff/webp)" in r.stdout


# -- key groups: per-extension fields unless aliased -------------------------------------------


@pytest.fixture
def groups(tmp_path):
    """a/0 holds a .jpg, b/1 a .png, each with a caption; c/2 a .jpg and a .seg.png mask."""
    src = tmp_path / "src"
    write(str(src), "a/0.jpg", jpeg(0))
    write(str(src), "a/0.txt", b"zero")
    write(str(src), "b/1.png", mask_png(1))
    write(str(src), "b/1.txt", b"one")
    write(str(src), "c/2.jpg", jpeg(2))
    write(str(src), "c/2.seg.png", mask_png(2))
    write(str(src), "c/2.txt", b"two")
    return src


def test_key_groups_fill_image_as_class_folders_do(groups, tmp_path):
    """Image extensions are one field 'image' by default (seg.png, a second image, is not)."""
    report = pack(str(groups), str(tmp_path / "out"))
    assert set(report.manifest.fields) == {"image", "seg.png", "txt"}
    assert report.manifest.aliases == {"image": ("jpg", "png")}
    assert any("fill the field 'image'" in note for note in report.notes)


def test_pack_alias_records_one_field_in_the_manifest(groups, tmp_path):
    r = run("pack", groups, tmp_path / "out", "--alias", "image=jpg,png,webp")
    assert r.exit_code == 0, r.output
    manifest = sl.read_manifest(str(tmp_path / "out"))[0]
    assert manifest.aliases == {"image": ("jpg", "png")}  # only extensions the source has
    assert set(manifest.fields) == {"image", "seg.png", "txt"}
    ds = sl.ShardedDataset(
        str(tmp_path / "out"),
        batch_size=3,
        decoder=Decoder(image="raw"),
        transform=vision.eval_transform(8),
    )
    batch = next(iter(ds))
    assert batch["image"].shape == (3, 3, 8, 8) and batch["txt"] == ["zero", "one", "two"]


def test_read_time_aliases_merge_over_the_manifest(groups, tmp_path):
    pack(str(groups), str(tmp_path / "out"))
    ds = sl.ShardedDataset(
        str(tmp_path / "out"), read=sl.ReadOptions(aliases={"image": ("jpg", "png")})
    )
    samples = {s["__key__"]: s for s in ds}
    assert all(s["image"].shape[0] == 3 for s in samples.values())
    assert "jpg" not in samples["a/0"] and "png" not in samples["b/1"]
    assert samples["c/2"]["seg.png"].shape[0] == 3  # not aliased: its own field
    # over a manifest's aliases: a name given at read time takes the extensions it lists
    pack(str(groups), str(tmp_path / "aliased"), PackOptions(aliases={"image": ("jpg", "png")}))
    ds = sl.ShardedDataset(
        str(tmp_path / "aliased"), read=sl.ReadOptions(aliases={"photo": ("jpg",)})
    )
    samples = {s["__key__"]: s for s in ds}
    assert "photo" in samples["a/0"] and "image" in samples["b/1"]


def test_two_members_filling_one_field_are_refused(groups, tmp_path):
    r = run("pack", groups, tmp_path / "bad", "--alias", "image=jpg,seg.png")
    assert r.exit_code == 2
    assert "c/2.jpg" in r.stderr and "c/2.seg.png" in r.stderr and "'image'" in r.stderr
    pack(str(groups), str(tmp_path / "out"))
    ds = sl.ShardedDataset(
        str(tmp_path / "out"), read=sl.ReadOptions(aliases={"image": ("jpg", "seg.png")})
    )
    with pytest.raises(ShardError, match=r"shard .*shard-00000.tar.zst.*sample 'c/2'.*'image'"):
        list(ds)


@pytest.mark.parametrize(
    ("aliases", "message"),
    [
        ({"txt": ("jpg",)}, "'txt' is already a field"),
        ({"image": ("jpg", "txt")}, "different codecs"),
        ({"a": ("jpg",), "b": ("jpg",)}, "in both 'a' and 'b'"),
        ({"__key__": ("jpg",)}, "not a usable field name"),
    ],
)
def test_bad_aliases_are_usage_errors(groups, tmp_path, aliases, message):
    pack(str(groups), str(tmp_path / "out"))
    with pytest.raises(UsageError, match=message):
        sl.ShardedDataset(str(tmp_path / "out"), read=sl.ReadOptions(aliases=aliases))
    with pytest.raises(UsageError, match=message):
        pack(str(groups), str(tmp_path / "p"), PackOptions(aliases=aliases))


def test_alias_option_syntax(groups, tmp_path):
    r = run("pack", groups, tmp_path / "out", "--alias", "image")
    assert r.exit_code == 2 and "FIELD=EXT" in r.stderr
    r = run("pack", groups, tmp_path / "out", "--alias", "image=webp")
    assert r.exit_code == 2 and "has none of these fields" in r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_streams_a_mixed_folder(mixed, tmp_path):
    from test_service_support import server_env, start_servers

    from shardloader.service import RemoteLoader

    _, want, tar, _ = mixed
    env = server_env(tar, str(tmp_path / "cache"))
    (server,) = start_servers(
        [
            [
                tar,
                "--batch-size",
                "4",
                "--transform",
                "train",
                "--image-size",
                "16",
                "--workers",
                "1",
                "--cache-dir",
                str(tmp_path / "cache"),
            ]
        ],
        str(tmp_path),
        env,
    )
    try:
        batches = list(RemoteLoader(server.url, world=sl.World(0, 1)))
    finally:
        server.stop()
    assert all(b["image"].shape == (4, 3, 16, 16) for b in batches)
    keys = [
        k for b in batches for k, pad in zip(b["__key__"], b["__pad__"], strict=True) if not pad
    ]
    assert sorted(keys) == sorted(want)


@pytest.mark.parametrize("mode", ["L", "CMYK", "RGB"])
def test_drafted_jpeg_decode_converts_grey_and_cmyk(mode):
    """vision's draft path (a JPEG decoded at 1/2..1/8 scale) gives RGB for any JPEG mode."""
    yy, xx = np.mgrid[0:480, 0:640]
    rgb = np.dstack([xx * 255 // 640, yy * 255 // 480, (xx + yy) * 255 // 1120]).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(buf, "JPEG", quality=95)
    data = buf.getvalue()
    full = decode_field("image", "image", data, Decoder())
    drafted = vision.decode_image(data, target_size=120)  # decodes at 1/4 scale
    assert drafted.shape == (3, 120, 160) and full.shape == (3, 480, 640)
    small = torch.nn.functional.interpolate(full[None].float(), size=(120, 160), mode="area")[0]
    assert (drafted.float() - small).abs().mean() < 4  # the same picture, the same colours
    out = vision.train_transform(32, field=None)(data)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8
