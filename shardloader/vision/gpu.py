"""Opt-in GPU decoding: DataLoader workers only read each JPEG's header and draw its crop; the
training process decodes the batch on the accelerator (``torchvision.io.decode_jpeg`` on a CUDA
device, nvJPEG), crops, resizes and mirrors there.

UNMEASURED: shardloader's development and CI machines have no GPU, so this path has no speed
figures and its tests skip there (``tests/test_vision_gpu.py``, with the reason).  What is
tested everywhere is what it shares with the CPU path: :class:`CropPlan` draws exactly the
boxes and flips that ``train_transform`` draws for the same (seed, epoch, batch), whatever
``num_workers`` is (NOTE [transform generators] in :mod:`shardloader.vision.transforms`).
Pixels may differ from the CPU path: the device decodes at full scale where the CPU path
drafts a box at least twice the output, nvJPEG's IDCT and upsampling are not libjpeg-turbo's,
and the resize runs in float, rounded back to uint8 (on the CPU device, with no draft, within 2
grey levels of the CPU path: tests/test_vision_gpu.py).

    ds = ShardedDataset(url, batch_size=256, decoder=Decoder(image="raw"),
                        transform=vision.gpu.CropPlan(224))        # field "image"
    decode = vision.gpu.DeviceDecode(224, device="cuda")            # needs torchvision
    for batch in make_loader(ds, num_workers=8):
        x = vision.Normalize()(decode(batch))                       # float NCHW on the GPU

Images that are not JPEG, or that the device decoder refuses, are decoded on the CPU with
:func:`shardloader.vision.decode_image` and moved over.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardloader.errors import DecodeError, UsageError
from shardloader.vision.image import decode_image, hw_of, open_lazy, size_of
from shardloader.vision.transforms import RandomResizedCrop

__all__ = ["CropPlan", "DeviceDecode", "plan_key"]

_SOI = b"\xff\xd8\xff"


def plan_key(field: str) -> str:
    """The sample key a :class:`CropPlan` adds next to ``field``."""
    return f"{field}.crop"


@dataclass(frozen=True)
class CropPlan:
    """Worker side of the GPU path: keep ``field``'s encoded bytes, add ``"<field>.crop"`` =
    int64 [left, top, width, height, flip] drawn as ``RandomResizedCrop(size, scale, ratio,
    flip=flip)`` draws it (same generator, same order), from the header alone."""

    size: Any
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: float = 0.5
    field: str = "image"
    takes_generator = True  # NOTE [transform generators]

    def __post_init__(self) -> None:
        RandomResizedCrop(self.size, self.scale, self.ratio, flip=self.flip)  # checks options

    def __call__(
        self, sample: Mapping[str, Any], *, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        if not isinstance(sample, Mapping) or self.field not in sample:
            raise UsageError(f"CropPlan({self.field!r}): the sample has no such field")
        data = sample[self.field]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise UsageError(
                f"CropPlan needs encoded bytes in {self.field!r} (Decoder(image='raw')), got "
                f"{type(data).__name__}"
            )
        crop = RandomResizedCrop(self.size, self.scale, self.ratio, flip=self.flip)
        box, flip = crop.draw(*size_of(open_lazy(data)), generator=generator)
        out = dict(sample)
        out[plan_key(self.field)] = torch.tensor([*box, int(flip)], dtype=torch.int64)
        return out


class DeviceDecode:
    """Training-process side: a collated batch from :class:`CropPlan` → uint8 NCHW on
    ``device`` (``size`` x ``size``, or (height, width)).  Needs torchvision."""

    def __init__(self, size: Any, *, device: str | torch.device = "cuda", field: str = "image"):
        try:
            from torchvision.io import decode_jpeg  # noqa: F401
        except ImportError as err:
            raise UsageError(
                "DeviceDecode needs torchvision (pip install the torchvision that matches your "
                "torch); or decode on the CPU with vision.train_transform"
            ) from err
        self.hw = hw_of(size, "size")
        self.device = torch.device(device)
        self.field = field

    def __call__(self, batch: Mapping[str, Any]) -> torch.Tensor:
        data, plans = batch[self.field], batch[plan_key(self.field)]
        images = self._decode(list(data))
        out = torch.empty((len(images), 3, *self.hw), dtype=torch.uint8, device=self.device)
        for i, (image, plan) in enumerate(zip(images, plans.tolist(), strict=True)):
            left, top, w, h, flip = plan
            x = image[None, :, top : top + h, left : left + w].float()
            y = torch.nn.functional.interpolate(x, self.hw, mode="bilinear", antialias=True)
            out[i] = (y.flip(-1) if flip else y)[0].round_().clamp_(0, 255).to(torch.uint8)
        return out

    def _decode(self, data: list[bytes]) -> list[torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        out: list[torch.Tensor | None] = [None] * len(data)
        jpegs = [i for i, d in enumerate(data) if bytes(d[:3]) == _SOI]
        if jpegs:
            raw = [torch.frombuffer(bytearray(data[i]), dtype=torch.uint8) for i in jpegs]
            try:
                decoded = decode_jpeg(raw, mode=ImageReadMode.RGB, device=self.device)
            except RuntimeError:  # one bad file fails the batch: all go the CPU way below
                decoded = [None] * len(jpegs)
            for i, x in zip(jpegs, decoded, strict=True):
                out[i] = x
        for i, x in enumerate(out):
            if x is None:  # not a JPEG, or refused on the device: PIL's verdict, on the CPU
                try:
                    out[i] = decode_image(data[i]).to(self.device)
                except DecodeError as err:
                    raise DecodeError(f"batch item {i}: {err}") from err
        return [x for x in out if x is not None]
