"""The opt-in GPU path (shardloader.vision.gpu): the workers draw the same crops as the CPU path.

Decoding on a device needs CUDA and torchvision; shardloader's machines have neither, so those
tests skip with the reason (the path is documented as unmeasured).  With torchvision but no GPU,
DeviceDecode runs on the CPU device and is compared with the CPU pipeline.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import shardloader as sl
from shardloader import vision
from shardloader.errors import UsageError
from shardloader.vision.gpu import CropPlan, DeviceDecode, plan_key

try:
    import torchvision  # noqa: F401

    NO_TORCHVISION = None
except ImportError:
    NO_TORCHVISION = "torchvision is not installed (DeviceDecode needs torchvision.io.decode_jpeg)"
NO_CUDA = None if torch.cuda.is_available() else "no CUDA device on this machine"


def _jpeg(h: int, w: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], -1) + rng.integers(0, 20, (h, w, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_the_plan_is_the_cpu_transforms_draw():
    data = _jpeg(150, 200, 0)
    plan = CropPlan(64)
    flips = set()
    for seed in range(10):
        got = plan({"image": data, "cls": 1}, generator=torch.Generator().manual_seed(seed))
        box, flip = vision.RandomResizedCrop(64, flip=0.5).draw(
            200, 150, generator=torch.Generator().manual_seed(seed)
        )
        assert got[plan_key("image")].tolist() == [*box, int(flip)]
        assert got["image"] is data and got["cls"] == 1
        flips.add(flip)
    assert flips == {True, False}
    with pytest.raises(UsageError, match="encoded bytes"):
        plan({"image": torch.zeros(3, 4, 4, dtype=torch.uint8)})


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from corpus import write

    from shardloader.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("gpu")
    for i in range(8):
        write(str(root / "src"), f"c{i % 2}/{i}.jpg", _jpeg(60 + 5 * i, 80, i))
    pack(str(root / "src"), str(root / "packed"), PackOptions(max_samples=3))
    return str(root / "packed")


def _plans(data: str, workers: int) -> list[list[list[int]]]:
    ds = sl.ShardedDataset(
        data,
        batch_size=3,
        shuffle=True,
        seed=5,
        decoder=sl.Decoder(image="raw"),
        transform=CropPlan(32),
    )
    return [b[plan_key("image")].tolist() for b in sl.make_loader(ds, num_workers=workers)]


@pytest.mark.slow
def test_the_plans_do_not_depend_on_num_workers(packed):
    reference = _plans(packed, 0)
    assert len(reference) == 3 and all(len(b) == 3 for b in reference[:2])
    assert _plans(packed, 2) == reference


@pytest.mark.skipif(NO_TORCHVISION is not None, reason=str(NO_TORCHVISION))
def test_device_decode_on_the_cpu_matches_the_cpu_pipeline():
    """Boxes under twice the output (the CPU path drafts nothing): the same decode and box,
    a float resize rounded back against torch's uint8 kernel."""
    images = [_jpeg(120 + 10 * i, 160, i) for i in range(4)]
    samples = [
        CropPlan(96)({"image": d}, generator=torch.Generator().manual_seed(i))
        for i, d in enumerate(images)
    ]
    batch = {
        "image": [s["image"] for s in samples],
        plan_key("image"): torch.stack([s[plan_key("image")] for s in samples]),
    }
    got = DeviceDecode(96, device="cpu")(batch)
    want = torch.stack(
        [
            vision.RandomResizedCrop(96, flip=0.5)(d, generator=torch.Generator().manual_seed(i))
            for i, d in enumerate(images)
        ]
    )
    assert got.shape == want.shape == (4, 3, 96, 96) and got.dtype == torch.uint8
    assert (got.int() - want.int()).abs().max() <= 2  # float resize on the device, rounded


@pytest.mark.skipif(
    NO_TORCHVISION is not None or NO_CUDA is not None, reason=str(NO_TORCHVISION or NO_CUDA)
)
def test_device_decode_on_cuda():
    images = [_jpeg(120, 160, i) for i in range(3)]
    samples = [
        CropPlan(32)({"image": d}, generator=torch.Generator().manual_seed(i))
        for i, d in enumerate(images)
    ]
    batch = {
        "image": [s["image"] for s in samples],
        plan_key("image"): torch.stack([s[plan_key("image")] for s in samples]),
    }
    out = DeviceDecode(32, device="cuda")(batch)
    assert out.device.type == "cuda" and out.shape == (3, 3, 32, 32)
