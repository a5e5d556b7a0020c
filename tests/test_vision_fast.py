"""Crop-aware JPEG decoding (issue 15): the native decoder (libjpeg-turbo, shardloader.codecs._jpeg)
gives the PIL path's pixels, draws nothing of its own, and leaves every doubtful file to PIL.

Tolerance: on a fixed set of JPEGs (4:2:0, 4:2:2, 4:4:4, grey, progressive, restart markers,
odd and tiny sizes, every draft scale) the native and the PIL outputs of the train, eval and
plain decodes are compared pixel by pixel; the documented tolerance (README *Vision*) is
``TOLERANCE`` = 0 grey levels: both paths run libjpeg-turbo's same integer IDCT and upsampling
on the same scaled image, and the native crop decodes a margin around the box so the box's edge
pixels see the same neighbours.  Tests that need the native decoder skip, with the reason, where
it is not built; the PIL fallback runs every other test.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import shardloader as sl
from shardloader import vision
from shardloader.errors import DecodeError
from shardloader.vision import jpeg
from shardloader.vision.image import Encoded

TOLERANCE = 0  # max absolute difference, native vs PIL (README "Vision")

needs_native = pytest.mark.skipif(
    jpeg.native_reason() is not None, reason=str(jpeg.native_reason())
)


def _photo(h: int, w: int, seed: int, channels: int = 3) -> np.ndarray:
    """Colour ramps, a coarse texture and pixel noise: every DCT frequency, so an edge pixel
    decoded from different neighbours would show."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    ramps = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + 2 * y) % 256], -1)
    texture = np.kron(rng.normal(0, 25, (h // 5 + 1, w // 5 + 1, 3)), np.ones((5, 5, 1)))[:h, :w]
    a = np.clip(ramps + texture + rng.normal(0, 8, (h, w, 3)), 0, 255).astype(np.uint8)
    return a[..., 0] if channels == 1 else a


def _jpeg(a: np.ndarray, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", **{"quality": 90, **options})
    return buf.getvalue()


def _fixed_set() -> dict[str, bytes]:
    return {
        "420 500x375": _jpeg(_photo(375, 500, 0)),
        "422 333x251": _jpeg(_photo(251, 333, 1), subsampling=1),
        "444 257x191": _jpeg(_photo(191, 257, 2), subsampling=0),
        "grey 301x199": _jpeg(_photo(199, 301, 3, channels=1)),
        "progressive 479x361": _jpeg(_photo(361, 479, 4), progressive=True),
        "restarts 400x300": _jpeg(_photo(300, 400, 5), restart_marker_blocks=3),
        "optimized 1280x960": _jpeg(_photo(960, 1280, 6), optimize=True),
        "tall 97x611": _jpeg(_photo(611, 97, 7)),
        "tiny 9x7": _jpeg(_photo(7, 9, 8)),
        "one pixel": _jpeg(_photo(1, 1, 9)),
    }


IMAGES = _fixed_set()


def _cmyk() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(_photo(60, 80, 10)).convert("CMYK").save(buf, "JPEG", quality=95)
    return buf.getvalue()


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
    return int((a.to(torch.int16) - b.to(torch.int16)).abs().max())


def _both(make, data: bytes, seed: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for backend in ("auto", "pil"):
        t = make(backend)
        if seed is None:
            out.append(t(data))
        else:
            out.append(t(data, generator=torch.Generator().manual_seed(seed)))
    return out[0], out[1]


# -- which files the native decoder takes --------------------------------------------------------


@needs_native
def test_the_native_decoder_takes_plain_jpegs_and_leaves_the_rest_to_pil():
    for name, data in IMAGES.items():
        assert Encoded(data).native, name
        assert Encoded(data).size == Image.open(io.BytesIO(data)).size, name
    png = io.BytesIO()
    Image.fromarray(_photo(20, 30, 0)).save(png, "PNG")
    for data in (_cmyk(), png.getvalue(), b"\xff\xd8\xff" + b"\x00" * 40):
        assert jpeg.probe(data) is None  # CMYK, not a JPEG, an unreadable header: PIL decides
    assert not Encoded(IMAGES["tiny 9x7"], backend="pil").native


def test_without_the_native_decoder_everything_decodes_through_pil(monkeypatch):
    data = IMAGES["420 500x375"]
    want = vision.train_transform(224, field=None, backend="pil")(
        data, generator=torch.Generator().manual_seed(4)
    )
    monkeypatch.setattr(jpeg, "_jpeg", None)  # as on a machine where it was not built
    assert jpeg.probe(data) is None and not Encoded(data).native
    got = vision.train_transform(224, field=None)(data, generator=torch.Generator().manual_seed(4))
    assert torch.equal(got, want)


# -- the same pixels ----------------------------------------------------------------------------


@needs_native
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if "1280" in n else n for n in sorted(IMAGES)]
)
def test_native_and_pil_give_the_same_pixels(name):
    """Train (random boxes, every draft scale through the output sizes, flips), eval and plain
    decodes, native vs PIL, within TOLERANCE on the fixed set."""
    data = IMAGES[name]
    worst = 0
    for size in (224, 56, 16):
        for seed in range(6):
            a, b = _both(
                lambda be, s=size: vision.RandomResizedCrop(s, flip=0.5, backend=be), data, seed
            )
            worst = max(worst, _max_diff(a, b))
    for size in (224, 64):
        a, b = _both(lambda be, s=size: vision.ResizeCenterCrop(s, backend=be), data)
        worst = max(worst, _max_diff(a, b))
    for target in (None, 100, (40, 30)):
        a, b = _both(
            lambda be, t=target: lambda d: vision.decode_image(d, target_size=t, backend=be), data
        )
        worst = max(worst, _max_diff(a, b))
    assert worst <= TOLERANCE, f"{name}: max abs difference {worst}"


@needs_native
def test_boxes_at_every_edge_and_scale_decode_exactly():
    """Direct boxes, including ones touching the image edges and MCU boundaries, at 1/1 to 1/8:
    the native box is the same region of PIL's drafted full decode."""
    data = IMAGES["optimized 1280x960"]
    for factor in (1, 2, 4, 8):
        image = Image.open(io.BytesIO(data))
        image.draft("RGB", (1280 // factor, 960 // factor))
        full = np.asarray(image.convert("RGB"))
        h, w = full.shape[:2]
        for x0, y0, x1, y1 in [
            (0, 0, w, h),
            (0, 0, 16, 16),
            (w - 16, h - 16, w, h),
            (15, 17, 33, 31),
            (16, 16, 32, 32),
            (w // 3, 0, w // 3 + 1, h),
            (1, h // 2, w - 1, h // 2 + 1),
        ]:
            got = jpeg._jpeg.decode(data, 8 // factor, x0, y0, x1, y1, False)
            box = np.frombuffer(got, np.uint8).reshape(y1 - y0, x1 - x0, 3)
            assert np.array_equal(box, full[y0:y1, x0:x1]), (factor, x0, y0, x1, y1)
            mirrored = jpeg._jpeg.decode(data, 8 // factor, x0, y0, x1, y1, True)
            assert np.array_equal(
                np.frombuffer(mirrored, np.uint8).reshape(y1 - y0, x1 - x0, 3), box[:, ::-1]
            )


def test_the_crop_flip_is_a_random_horizontal_flip_after_the_crop():
    """``RandomResizedCrop(flip=p)``: the draws and pixels of ``RandomHorizontalFlip(p)`` after
    the crop (train_transform relies on it), on both paths."""
    data = IMAGES["420 500x375"]
    for backend in ("auto", "pil"):
        fused = vision.RandomResizedCrop(64, flip=0.5, backend=backend)
        apart = vision.Compose(
            [vision.RandomResizedCrop(64, backend=backend), vision.RandomHorizontalFlip()]
        )
        flipped = set()
        for seed in range(8):
            g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            a, b = fused(data, generator=g1), apart(data, generator=g2)
            assert torch.equal(a, b) and torch.equal(g1.get_state(), g2.get_state())
            no_flip = vision.RandomResizedCrop(64, backend=backend)(
                data, generator=torch.Generator().manual_seed(seed)
            )
            flipped.add(not torch.equal(a, no_flip))
        assert flipped == {True, False}


def test_eval_crops_first_within_half_a_source_pixel():
    """ResizeCenterCrop cuts the box Resize-then-CenterCrop would show: on a smooth image (no
    detail at the pixel scale) the two agree closely; a small image still pads."""
    smooth = np.asarray(Image.fromarray(_photo(375, 500, 0)).resize((50, 38)).resize((500, 375)))
    data = _jpeg(smooth, quality=95)
    first = vision.ResizeCenterCrop(224, 256)(data).float()
    after = vision.Compose([vision.Resize(256), vision.CenterCrop(224)])(data).float()
    assert first.shape == after.shape == (3, 224, 224)
    assert (first - after).abs().mean() < 1.5
    small = vision.ResizeCenterCrop(32, resize=16)(data)
    assert small.shape == (3, 32, 32) and small[:, 0].sum() == 0  # resized to 16, padded


# -- doubtful files ------------------------------------------------------------------------------


def test_corrupt_jpegs_get_pils_verdict():
    data = IMAGES["420 500x375"]
    for backend in ("auto", "pil"):
        t = vision.RandomResizedCrop(32, backend=backend)
        with pytest.raises(DecodeError, match="truncated"):
            t(data[: len(data) // 2], generator=torch.Generator().manual_seed(0))
        with pytest.raises(DecodeError):
            t(b"\xff\xd8\xff\xe0" + bytes(64), generator=torch.Generator().manual_seed(0))
    # a stray marker in the entropy data: libjpeg warns ("Corrupt JPEG data"), the native
    # decoder declines, and PIL decodes it as it always did
    damaged = data[: len(data) // 2] + b"\xff\xd3" + data[len(data) // 2 :]
    if jpeg.native_reason() is None:
        with pytest.raises(jpeg._jpeg.JpegError, match="Corrupt JPEG data"):
            jpeg._jpeg.decode(damaged, 8, 0, 0, 500, 375, False)
    a, b = _both(lambda be: vision.RandomResizedCrop(64, scale=(1, 1), backend=be), damaged, 1)
    assert torch.equal(a, b)


def test_cmyk_and_oversized_jpegs_take_the_pil_path(monkeypatch):
    a, b = _both(lambda be: vision.RandomResizedCrop(24, flip=1.0, backend=be), _cmyk(), 0)
    assert torch.equal(a, b)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 375 * 500 // 3)  # a "decompression bomb"
    assert jpeg.probe(IMAGES["420 500x375"]) is None
    with pytest.raises(DecodeError, match="decompression bomb"):
        vision.RandomResizedCrop(24)(IMAGES["420 500x375"])


# -- through the dataset: the same crops whatever the backend and num_workers ------------------


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from corpus import write

    from shardloader.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("fast")
    for i in range(10):
        write(str(root / "src"), f"c{i % 2}/{i}.jpg", _jpeg(_photo(90 + 7 * i, 120 - 3 * i, i)))
    pack(str(root / "src"), str(root / "packed"), PackOptions(max_samples=4))
    return str(root / "packed")


def _epoch(data: str, backend: str, workers: int) -> list[tuple[list[str], torch.Tensor]]:
    ds = sl.ShardedDataset(
        data,
        batch_size=3,
        shuffle=True,
        seed=11,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(32, backend=backend),
    )
    return [(b["__key__"], b["image"]) for b in sl.make_loader(ds, num_workers=workers)]


@needs_native
@pytest.mark.slow
def test_the_dataset_gives_the_same_crops_on_both_paths_and_any_worker_count(packed):
    reference = _epoch(packed, "pil", 0)
    assert len(reference) == 4
    for backend, workers in (("auto", 0), ("auto", 2)):
        got = _epoch(packed, backend, workers)
        assert [k for k, _ in got] == [k for k, _ in reference]
        worst = max(_max_diff(a, b) for (_, a), (_, b) in zip(got, reference, strict=True))
        assert worst <= TOLERANCE, (backend, workers, worst)


@needs_native
def test_damaged_jpegs_never_crash_the_native_decoder():
    """Untrusted bytes: random byte damage, cuts and splices of a small JPEG either decode (the
    same pixels as PIL) or raise DecodeError; the C code neither crashes nor hangs."""
    data = _jpeg(_photo(40, 56, 12), progressive=True)
    rng = np.random.default_rng(0)
    decoded = failed = 0
    for i in range(300):
        damaged = bytearray(data)
        for at in rng.integers(2, len(data), int(rng.integers(1, 6))):
            damaged[at] = int(rng.integers(0, 256))
        if i % 3 == 1:
            damaged = damaged[: int(rng.integers(3, len(damaged)))]
        elif i % 3 == 2:
            damaged[int(rng.integers(20, len(damaged))) :] = data[: int(rng.integers(0, 200))]
        try:
            a, b = _both(
                lambda be: vision.RandomResizedCrop(16, flip=0.5, backend=be), bytes(damaged), i
            )
        except DecodeError:
            failed += 1
            continue
        assert torch.equal(a, b)
        decoded += 1
    assert decoded > 0 and failed > 0


@needs_native
@pytest.mark.parametrize(
    ("h", "w", "out_h", "out_w"),
    [(190, 170, 224, 224), (400, 300, 224, 224), (50, 700, 224, 224), (1, 1, 16, 16)]
    + [(300, 5, 7, 64), (224, 224, 224, 224), (9, 13, 9, 13), (333, 517, 31, 17)],
)
def test_the_native_resize_is_pillows_filter_within_one_level(h, w, out_h, out_w):
    """Up, down, mixed, identity and odd sizes: Pillow's antialiased bilinear within one grey
    level (14-bit coefficients), the same result for CHW and HWC-memory input."""
    from shardloader.vision.image import resize_chw

    a = _photo(h, w, h + w)
    want = np.asarray(Image.fromarray(a).resize((out_w, out_h), Image.BILINEAR))
    got = resize_chw(torch.from_numpy(a).permute(2, 0, 1), (out_h, out_w))
    assert got.shape == (3, out_h, out_w) and (got.is_contiguous() or (h, w) == (out_h, out_w))
    assert np.abs(got.permute(1, 2, 0).numpy().astype(int) - want).max() <= 1
    kernel = jpeg.resize(a, (out_h, out_w))  # also at equal sizes, which resize_chw skips
    assert kernel is not None and np.abs(kernel.transpose(1, 2, 0).astype(int) - want).max() <= 1
    chw = torch.from_numpy(np.ascontiguousarray(a.transpose(2, 0, 1)))
    assert torch.equal(resize_chw(chw, (out_h, out_w)), got)


def test_without_the_extension_the_resize_is_torchs(monkeypatch):
    from shardloader.vision.image import resize_chw

    a = torch.from_numpy(_photo(40, 30, 3)).permute(2, 0, 1)
    monkeypatch.setattr(jpeg, "_RESIZE", None)
    want = torch.nn.functional.interpolate(
        a[None].float(), size=(20, 25), mode="bilinear", antialias=True
    )[0]
    assert (resize_chw(a, (20, 25)).float() - want).abs().max() <= 1
