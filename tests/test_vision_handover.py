"""Image batches cross from the workers through the loader's shared slots
(shardloader/deliver/slotcollate.py): the same batches as without workers, also while the loop holds
more batches than there are slots, and only for pipelines whose image shape is fixed."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import shardloader as sl
from shardloader import vision
from shardloader.deliver.slotcollate import fixed_output, image_ring

pytestmark = pytest.mark.slow  # DataLoader workers, a packed module fixture


def _jpeg(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    h, w = int(rng.integers(40, 90)), int(rng.integers(40, 90))
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    from corpus import write

    from shardloader.pack import PackOptions, pack

    root = tmp_path_factory.mktemp("handover")
    for i in range(40):
        write(str(root / "src"), f"c{i % 3}/{i}.jpg", _jpeg(i))
    pack(str(root / "src"), str(root / "packed"), PackOptions(max_samples=9))
    return str(root / "packed")


def _dataset(data: str, **kw) -> sl.ShardedDataset:
    kw.setdefault("transform", vision.train_transform(24))
    return sl.ShardedDataset(
        data, batch_size=4, shuffle=True, seed=5, decoder=sl.Decoder(image="raw"), **kw
    )


def test_batches_through_the_slots_equal_the_in_process_ones_even_when_all_are_held(packed):
    want = [b for _ in range(2) for b in sl.make_loader(_dataset(packed))]
    loader = sl.make_loader(_dataset(packed), num_workers=2)
    ring = loader.worker_init_fn.ring
    assert ring is not None and ring.slot_bytes == 4 * 3 * 24 * 24
    got = [b for _ in range(2) for b in loader]  # every batch held: slots run out, then fresh
    assert len(got) == len(want) == 20
    for a, b in zip(got, want, strict=True):
        assert list(a) == list(b) and a["__key__"] == b["__key__"]
        assert a["image"].shape == (4, 3, 24, 24) and torch.equal(a["image"], b["image"])
        assert torch.equal(a["cls"], b["cls"])
    assert 0 < ring.received < len(got)  # some through the slots, the rest the usual way
    del got  # freed batches give their slots back, though every slot was held when the
    before = ring.received  # workers last looked: a batch that came the usual way frees them
    assert sum(1 for _ in loader) + sum(1 for _ in loader) == 20
    assert ring.received > before


def test_only_fixed_shape_pipelines_with_the_default_collate_get_slots(packed):
    assert fixed_output(vision.train_transform(24)) == ("image", (3, 24, 24))
    assert fixed_output(vision.eval_transform(20, channels_last=True)) == ("image", (20, 20, 3))
    assert fixed_output(vision.train_transform(24, field=None)) is None  # not a sample dict
    odd = vision.ApplyTo("image", vision.Compose([vision.RandomResizedCrop(8), lambda x: x]))
    assert fixed_output(odd) is None  # a transform that does not say its shape
    assert image_ring(_dataset(packed), 2, 4) is not None
    assert image_ring(_dataset(packed, transform=odd), 2, 4) is None
    assert image_ring(_dataset(packed, collate_fn=list), 2, 4) is None


def test_spawned_workers_map_the_same_slots(packed):
    import multiprocessing

    want = [b["image"] for b in sl.make_loader(_dataset(packed))]
    spawn = multiprocessing.get_context("spawn")
    loader = sl.make_loader(_dataset(packed), num_workers=2, multiprocessing_context=spawn)
    got = [b["image"] for b in loader]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert loader.worker_init_fn.ring.received > 0
