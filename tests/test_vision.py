"""Vision: fast decode, transforms deterministic under torch's seed, no torchvision needed."""

from __future__ import annotations

import io
import pickle
import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, JpegImagePlugin

from shardloader.collate import PadCollate
from shardloader.errors import DecodeError, UsageError
from shardloader.vision import (
    ApplyTo,
    CenterCrop,
    Compose,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToImageTensor,
    decode_image,
    eval_transform,
    open_image,
    train_transform,
)


def _array(h: int, w: int, seed: int = 0) -> np.ndarray:
    """Smooth colour ramps plus mild noise: JPEG-friendly and position-dependent."""
    y, x = np.mgrid[0:h, 0:w]
    noise = np.random.default_rng(seed).integers(0, 8, (h, w, 3))
    ramps = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
    return np.clip(ramps + noise, 0, 255).astype(np.uint8)


def _encode(a: np.ndarray, fmt: str = "JPEG") -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buf.getvalue()


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return _encode(_array(120, 160))


@pytest.fixture(scope="module")
def big_jpeg() -> bytes:
    return _encode(_array(960, 1280))


# -- decoding -----------------------------------------------------------------------------------


def test_decode_image_is_uint8_chw_or_hwc(jpeg):
    chw = decode_image(jpeg)
    hwc = decode_image(jpeg, channels_last=True)
    assert chw.dtype == torch.uint8 and chw.shape == (3, 120, 160) and chw.is_contiguous()
    assert hwc.shape == (120, 160, 3) and torch.equal(hwc.permute(2, 0, 1), chw)
    ref = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
    assert np.array_equal(hwc.numpy(), ref)


def test_decode_drafts_jpeg_but_never_below_target(big_jpeg):
    small = decode_image(big_jpeg, target_size=200)  # shorter side >= 200
    assert small.shape == (3, 240, 320)  # 1/4 scale: 1/8 would give 120 < 200
    exact = decode_image(big_jpeg, target_size=(300, 500))
    assert exact.shape == (3, 480, 640)
    png = _encode(_array(96, 128), "PNG")
    assert decode_image(png, target_size=10).shape == (3, 96, 128)  # no draft for PNG
    gray = io.BytesIO()
    Image.fromarray(_array(40, 50)[..., 0]).save(gray, "JPEG")
    assert decode_image(gray.getvalue()).shape == (3, 40, 50)
    assert open_image(big_jpeg, target_size=100).mode == "RGB"


def test_corrupt_images_raise_decode_error(jpeg):
    with pytest.raises(DecodeError):
        decode_image(b"not an image")
    with pytest.raises(DecodeError):
        RandomResizedCrop(32)(b"not an image")
    with pytest.raises(UsageError, match="not an image"):
        RandomResizedCrop(32)({"jpg": jpeg})


# -- random transforms: determinism and bounds --------------------------------------------------


def test_train_transform_is_deterministic_under_torch_seed_only(jpeg):
    t = train_transform(64, field=None)
    torch.manual_seed(5)
    np.random.seed(1)
    random.seed(1)
    a = t(jpeg)
    torch.manual_seed(5)
    np.random.seed(2)  # numpy's and Python's global state play no part
    random.seed(2)
    b = t(jpeg)
    assert a.shape == (3, 64, 64) and a.dtype == torch.uint8 and torch.equal(a, b)
    outs = {t(jpeg).sum().item() for _ in range(8)}
    assert len(outs) > 1  # and it does vary from call to call


def test_explicit_generator_and_pickling(jpeg):
    a = RandomResizedCrop(48, generator=torch.Generator().manual_seed(3))
    b = RandomResizedCrop(48, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a(jpeg), b(jpeg))
    t = train_transform(32, field="jpg")
    clone = pickle.loads(pickle.dumps(t))
    torch.manual_seed(0)
    x = t({"jpg": jpeg, "cls": 1})
    torch.manual_seed(0)
    y = clone({"jpg": jpeg, "cls": 1})
    assert torch.equal(x["jpg"], y["jpg"]) and x["cls"] == 1


@given(
    st.integers(1, 600),
    st.integers(1, 600),
    st.floats(0.01, 1.0),
    st.floats(0.01, 1.0),
    st.integers(0, 2**31),
)
def test_random_resized_crop_params_stay_inside(width, height, s1, s2, seed):
    lo, hi = sorted((s1, s2))
    t = RandomResizedCrop(32, scale=(lo, hi), generator=torch.Generator().manual_seed(seed))
    left, top, w, h = t.params(width, height)
    assert 0 <= left and 0 <= top and 1 <= w and 1 <= h
    assert left + w <= width and top + h <= height
    if min(w, h) >= 20 and w < width and h < height:  # not the fallback; rounding is small
        assert 3 / 4 / 1.06 <= w / h <= 4 / 3 * 1.06


def test_crop_inputs_agree_and_draft_matches_full_decode(big_jpeg, monkeypatch):
    full = np.asarray(Image.open(io.BytesIO(big_jpeg)).convert("RGB"))
    t = RandomResizedCrop(64, scale=(0.5, 1.0), backend="pil")  # the PIL path: draft spied on
    outs = []
    for img in (full, Image.fromarray(full), torch.from_numpy(full.copy()).permute(2, 0, 1)):
        torch.manual_seed(11)
        outs.append(t(img).to(torch.int16))
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] - outs[2]).abs().max() <= 1  # tensor path: same kernel, same box
    drafted = []
    original = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        width = self.size[0]
        result = original(self, mode, size)
        drafted.append(round(width / result[1][2]) if result is not None else 1)
        return result

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    torch.manual_seed(11)
    fast = t(big_jpeg).to(torch.int16)
    assert drafted == [8]  # crops of >= 780 px decode at 1/8 scale for a 64 px output
    assert (fast - outs[0]).abs().float().mean() < 6  # and the picture is the same


def test_flip():
    x = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4)
    assert torch.equal(RandomHorizontalFlip(1.0)(x), x.flip(-1))
    assert torch.equal(RandomHorizontalFlip(0.0)(x), x)
    a = _array(5, 7)
    assert np.array_equal(RandomHorizontalFlip(1.0)(a).permute(1, 2, 0).numpy(), a[:, ::-1])
    with pytest.raises(UsageError):
        RandomHorizontalFlip(2.0)


# -- deterministic transforms -------------------------------------------------------------------


def test_resize_and_center_crop(jpeg):
    assert Resize(60)(jpeg).shape == (3, 60, 80)
    assert Resize((30, 40))(jpeg).shape == (3, 30, 40)
    assert Resize(60)(torch.zeros(3, 120, 160, dtype=torch.uint8)).shape == (3, 60, 80)
    a = _array(50, 70)
    crop = CenterCrop((20, 30))(a)
    assert np.array_equal(crop.permute(1, 2, 0).numpy(), a[15:35, 20:50])
    t = torch.from_numpy(a.copy()).permute(2, 0, 1)
    assert torch.equal(CenterCrop((20, 30))(t), crop)
    padded = CenterCrop(80)(a)
    assert padded.shape == (3, 80, 80) and padded[:, :15].sum() == 0
    assert np.array_equal(padded.permute(1, 2, 0)[15:65, 5:75].numpy(), a)
    out = eval_transform(96, field=None)(jpeg)
    assert out.shape == (3, 96, 96) and out.is_contiguous()


def test_to_image_tensor_and_normalize():
    a = _array(6, 8)
    chw = ToImageTensor()(a)
    hwc = ToImageTensor(channels_last=True)(Image.fromarray(a))
    assert chw.is_contiguous() and hwc.is_contiguous() and np.array_equal(hwc.numpy(), a)
    norm = Normalize((0.5, 0.5, 0.5), (0.25, 0.5, 1.0))
    y = norm(chw)
    want = (a.transpose(2, 0, 1) / 255 - 0.5) / np.array([0.25, 0.5, 1.0])[:, None, None]
    assert y.dtype == torch.float32 and np.allclose(y.numpy(), want, atol=1e-5)
    batch = torch.stack([chw, chw])
    assert torch.allclose(norm(batch)[1], y)
    assert torch.allclose(norm(chw.float() / 255), y, atol=1e-6)  # float input is in [0, 1]
    cl = Normalize((0.5, 0.5, 0.5), (0.25, 0.5, 1.0), channels_last=True)(hwc)
    assert torch.allclose(cl.permute(2, 0, 1), y)
    with pytest.raises(UsageError):
        Normalize((0.5,), (0.0,))


def test_normalize_refuses_float_pixels_in_0_255():
    """The Troubleshooting table's mistake: uint8 pixels cast to float without / 255."""
    pixels = torch.from_numpy(_array(6, 8)).permute(2, 0, 1)
    norm = Normalize()
    with pytest.raises(UsageError, match=r"values up to 2\d\d: float images must be in \[0, 1\]"):
        norm(pixels.float())
    with pytest.raises(UsageError, match="divide by 255"):
        norm(torch.stack([pixels, pixels]).double())  # a batch, checked again
    assert torch.allclose(norm(pixels.float() / 255), norm(pixels), atol=1e-6)
    assert norm(torch.zeros(0, 3, 4, 4)).shape == (0, 3, 4, 4)  # an empty batch has no range


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_normalize_checks_the_first_accelerator_batch_only():
    """On a GPU the range is read back once (a sync), on the first batch."""
    pixels = torch.from_numpy(_array(6, 8)).permute(2, 0, 1).cuda()
    with pytest.raises(UsageError, match="float images must be in"):
        Normalize()(pixels.float())
    norm = Normalize()
    assert norm(pixels.float() / 255).device.type == "cuda"
    assert norm(pixels.float()).device.type == "cuda"  # later batches are not read back


def test_pipeline_on_sample_dicts_collates(jpeg):
    t = train_transform(40, field="jpg", channels_last=True)
    torch.manual_seed(0)
    samples = [t({"jpg": jpeg, "cls": i, "__key__": f"k{i}"}) for i in range(3)]
    batch = PadCollate()(samples)
    assert batch["jpg"].shape == (3, 40, 40, 3) and batch["jpg"].dtype == torch.uint8
    assert batch["cls"].tolist() == [0, 1, 2] and batch["__key__"] == ["k0", "k1", "k2"]
    assert isinstance(Compose([Resize(10)]).transforms, tuple)
    with pytest.raises(UsageError, match="no such field"):
        ApplyTo("png", Resize(10))({"jpg": jpeg})


# -- explicit generators: NOTE [transform generators] -------------------------------------------


def _noise(x):
    """A user augmentation drawing from torch's global generator, as most do."""
    torch.rand(7)
    return x


def test_transforms_draw_from_the_generator_they_are_given(jpeg):
    t = train_transform(40, field="jpg")
    sample = {"jpg": jpeg, "cls": 1}

    def crop(seed: int, global_seed: int) -> torch.Tensor:
        torch.manual_seed(global_seed)  # torch's global generator plays no part
        return t(sample, generator=torch.Generator().manual_seed(seed))["jpg"]

    assert torch.equal(crop(3, 0), crop(3, 1))
    assert len({crop(s, 0).sum().item() for s in range(8)}) > 1  # the generator decides
    mixed = Compose([_noise, RandomResizedCrop(40), _noise, RandomHorizontalFlip()])
    g = torch.Generator().manual_seed(5)
    pure = Compose([RandomResizedCrop(40), RandomHorizontalFlip()])
    assert torch.equal(
        mixed(jpeg, generator=g), pure(jpeg, generator=torch.Generator().manual_seed(5))
    )
    own = RandomResizedCrop(40, generator=torch.Generator().manual_seed(9))
    again = RandomResizedCrop(40, generator=torch.Generator().manual_seed(9))
    assert torch.equal(own(jpeg, generator=torch.Generator().manual_seed(1)), again(jpeg))


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    from corpus import jpeg as make_jpeg
    from corpus import write

    from shardloader.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("pictures")
    for c in ("cat", "dog"):
        for i in range(9):
            write(str(root / "src"), f"{c}/{i}.jpg", make_jpeg(10 * len(c) + i, 64, 48))
    pack(str(root / "src"), str(root / "packed"), PackOptions(max_samples=5))
    return str(root / "packed")


def _crops(data, transform, num_workers=0, state=None):
    import shardloader as sl

    ds = sl.ShardedDataset(
        data,
        batch_size=4,
        shuffle=True,
        seed=3,
        decoder=sl.Decoder(image="raw"),
        transform=transform,
    )
    loader = sl.make_loader(ds, num_workers=num_workers)
    if state is not None:
        loader.load_state_dict({**loader.state_dict(), **state})
    return [(b["__key__"], b["image"]) for b in loader]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(
        ka == kb and torch.equal(xa, xb) for (ka, xa), (kb, xb) in zip(a, b, strict=True)
    )


def test_dataset_crops_come_from_a_per_batch_generator(pictures):
    """The same crops whatever num_workers, after resume, and whatever the user's own
    transforms draw from torch's global generator in between."""
    train = train_transform(24)
    reference = _crops(pictures, train)
    assert len(reference) == 5
    assert _same(_crops(pictures, train, num_workers=2), reference)
    assert _same(_crops(pictures, train, state={"position": 2}), reference[2:])
    noisy = ApplyTo(
        "image",
        Compose([_noise, RandomResizedCrop(24), _noise, RandomHorizontalFlip(), ToImageTensor()]),
    )
    assert _same(_crops(pictures, noisy, num_workers=2), reference)


def test_the_dataset_hands_transforms_the_documented_per_batch_generator(pictures):
    """``read.seeding.batch_generator`` (DESIGN.md, NOTE [transform generators]) is the rule:
    each sample of global batch ``b`` gets a generator seeded as it seeds one."""
    import shardloader as sl
    from shardloader.read.seeding import batch_generator

    seen: list[tuple[str, int]] = []

    def record(sample, generator=None):
        seen.append((sample["__key__"], generator.initial_seed()))
        return sample

    record.takes_generator = True
    ds = sl.ShardedDataset(
        pictures,
        batch_size=4,
        shuffle=True,
        seed=3,
        decoder=sl.Decoder(image="raw"),
        transform=record,
        collate_fn=lambda samples: [s["__key__"] for s in samples],
    )
    batches = list(sl.make_loader(ds, num_workers=0))
    assert len(batches) == 5 and len(seen) == 20
    want = [batch_generator(3, 0, b).initial_seed() for b, keys in enumerate(batches) for _ in keys]
    assert [seed for _, seed in seen] == want
    assert [key for key, _ in seen] == [key for keys in batches for key in keys]
