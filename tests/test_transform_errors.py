"""An error while producing a sample names shard, sample key, rank and worker (issue 10 item 5).

Whether the decoder, a shardloader transform or the user's own transform raised it, and through
real DataLoader workers too; chained to the original.  ``on_error="skip"`` skips undecodable
data (a DecodeError, whoever raised it), never a bug in a transform (TransformError).
"""

from __future__ import annotations

import pytest
import torch
from corpus import jpeg
from synthetic import write_manifest, write_shard

import shardloader as sl
from shardloader import errors, vision
from shardloader.errors import DecodeError, UsageError
from shardloader.manifest import FieldInfo, Manifest

KEYS = [f"k/{i}" for i in range(6)]
BAD = "k/3"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """One tar shard of six JPEG samples, k/3 truncated (written past pack's checks, as a
    shard damaged later or packed by another tool would be)."""
    out = str(tmp_path_factory.mktemp("data"))
    fields = {"jpg": FieldInfo("image"), "cls": FieldInfo("int")}
    images = [jpeg(i, 40, 30) for i in range(len(KEYS))]
    samples = [
        (key, {"jpg": image[: len(image) // 2] if key == BAD else image, "cls": b"%d" % (i % 2)})
        for i, (key, image) in enumerate(zip(KEYS, images, strict=True))
    ]
    shard = write_shard(out, "shard-00000.tar", "tar", "none", fields, samples)
    write_manifest(out, Manifest("tar", "none", fields, [shard]))
    return out


def _place(message: str, workers: int = 1) -> bool:
    return (
        "shard-00000.tar" in message
        and f"sample '{BAD}'" in message
        and "rank 0/1" in message
        and f"/{workers}" in message
    )


def test_a_truncated_jpeg_in_the_vision_transform_names_its_place(data):
    ds = sl.ShardedDataset(
        data,
        batch_size=2,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(16, field="jpg"),
    )
    with pytest.raises(DecodeError) as err:
        list(ds)
    assert _place(str(err.value)), str(err.value)
    assert isinstance(err.value.__cause__, DecodeError)  # chained to the original
    assert "truncated" in str(err.value)


@pytest.mark.slow
def test_the_place_survives_dataloader_workers(data):
    ds = sl.ShardedDataset(
        data,
        batch_size=2,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(16, field="jpg"),
    )
    with pytest.raises(DecodeError) as err:
        list(sl.make_loader(ds, num_workers=2))
    message = str(err.value)
    assert _place(message, workers=2) and "worker 1/2" in message, message


class Fails:
    """A user transform with a bug on one sample."""

    def __call__(self, sample):
        if sample["__key__"] == BAD:
            return {"label": {}}["missing"]
        return sample


@pytest.mark.slow
def test_a_user_transform_error_becomes_a_transform_error(data):
    ds = sl.ShardedDataset(data, batch_size=2, decoder=sl.Decoder(image="raw"), transform=Fails())
    with pytest.raises(errors.TransformError) as err:
        list(ds)
    assert isinstance(err.value, RuntimeError) and isinstance(err.value, sl.ShardloaderError)
    assert _place(str(err.value)) and "KeyError" in str(err.value), str(err.value)
    assert isinstance(err.value.__cause__, KeyError)
    with pytest.raises(errors.TransformError):  # through workers: the class and the place survive
        list(
            sl.make_loader(
                sl.ShardedDataset(
                    data, batch_size=2, decoder=sl.Decoder(image="raw"), transform=Fails()
                ),
                num_workers=1,
            )
        )


def test_skip_skips_undecodable_images_but_not_transform_bugs(data):
    ds = sl.ShardedDataset(
        data,
        batch_size=2,
        decoder=sl.Decoder(image="raw"),
        transform=vision.train_transform(16, field="jpg"),
        on_error="skip",
    )
    batches = list(ds)
    keys = [
        k for b in batches for k, pad in zip(b["__key__"], b["__pad__"], strict=True) if not pad
    ]
    assert sorted(keys) == sorted(set(KEYS) - {BAD})
    assert all(b["jpg"].shape == (2, 3, 16, 16) for b in batches)
    with pytest.raises(errors.TransformError):
        list(
            sl.ShardedDataset(
                data,
                batch_size=2,
                decoder=sl.Decoder(image="raw"),
                transform=Fails(),
                on_error="skip",
            )
        )


def test_shardloader_errors_in_transforms_keep_their_class(data):
    ds = sl.ShardedDataset(data, batch_size=2, transform=vision.train_transform(16))
    with pytest.raises(UsageError) as err:  # no field "image" here: ApplyTo says so
        list(ds)
    message = str(err.value)
    assert "ApplyTo('image')" in message and "shard-00000.tar" in message
    assert "sample 'k/0'" in message and "rank 0/1, worker 0/1" in message


@pytest.mark.slow
def test_the_default_decoder_still_names_the_place(data):
    with pytest.raises(DecodeError) as err:
        list(sl.ShardedDataset(data, batch_size=2))
    assert _place(str(err.value)) and "'jpg'" in str(err.value)


def test_a_transform_that_returns_no_dict_names_the_place(data):
    ds = sl.ShardedDataset(data, batch_size=2, transform=lambda s: torch.zeros(1))
    with pytest.raises(UsageError, match=r"shard-00000.tar .*sample 'k/0'.*returned Tensor"):
        list(ds)
