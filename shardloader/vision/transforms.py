"""The standard train/eval image transforms, without torchvision.

Transforms take an image as encoded ``bytes``, a ``PIL.Image``, a numpy uint8 HWC array or a
uint8 CHW tensor, and return a uint8 CHW tensor (often with channels-last memory, a free view of
the decoded pixels); :class:`ToImageTensor` ends a pipeline with a contiguous CHW tensor, or HWC
with ``channels_last=True``.  Float conversion and normalization are left to
:class:`Normalize` (:mod:`.normalize`), best run on the GPU on the whole batch.  They work on
one image; for the dataset's sample dicts wrap them in :class:`ApplyTo`; ``train_transform`` /
``eval_transform`` do so for the field ``image`` (what a class-folder pack holds, whatever the
extensions) unless given another ``field`` (``field=None``: a transform of one image).
Decoding, drafting and resizing are :mod:`shardloader.vision.image`'s.

NOTE [transform generators]
    Randomness comes only from a ``torch.Generator``, never from numpy's or Python's.  A
    transform that draws (:class:`RandomResizedCrop`, :class:`RandomHorizontalFlip`), and the
    ones that wrap others (:class:`Compose`, :class:`ApplyTo`), declare ``takes_generator =
    True`` and accept ``generator=`` when called: ShardedDataset then hands them a generator
    seeded from (seed, epoch, global batch index)
    (:func:`shardloader.read.seeding.batch_generator`), one per batch, used by the batch's samples
    in planned order.  So crops repeat exactly on a rerun, after resume and whatever
    ``num_workers`` is, and a user transform that draws from torch's global generator (which the
    dataset also seeds per batch) or another pipeline in the same process cannot shift them.
    Wrappers pass the generator on only to transforms that declare ``takes_generator``.
    Precedence: a ``generator`` given to the transform itself (a field), then the one passed in the
    call, then torch's global generator (a transform called by hand).  Transforms are plain
    top-level classes, so they pickle into workers.

NOTE [output shapes]
    Transforms whose every result has one shape say so: ``out_shape(shape_before)`` gives the
    uint8 shape after them (None: not fixed), and :meth:`ApplyTo.fixed_output` declares the
    field's shape of a dataset's ``ApplyTo`` pipeline.  A
    :class:`~shardloader.deliver.loader.ShardLoader` sizes the shared slots its workers stack
    image batches into from it (:mod:`shardloader.deliver.slotcollate`); a
    batch that turns out otherwise is collated as usual, so a wrong answer costs speed only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shardloader.codecs import jpeg
from shardloader.errors import UsageError
from shardloader.vision.image import (
    Encoded,
    ImageLike,
    Size,
    contiguous,
    crop,
    hw_of,
    open_lazy,
    resize_chw,
    size_of,
)
from shardloader.vision.normalize import IMAGENET_MEAN, IMAGENET_STD, Normalize
from shardloader.vision.normalize import as_numbers as _numbers

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ResizeCenterCrop",
    "ToImageTensor",
    "Normalize",
    "Compose",
    "ApplyTo",
    "train_transform",
    "eval_transform",
    "image_field",
]


def _uniform(generator: torch.Generator | None, n: int) -> list[float]:
    return torch.rand(n, generator=generator, dtype=torch.float64).tolist()


def _check_backend(backend: str) -> None:
    if backend not in jpeg.BACKENDS:
        raise UsageError(f"backend={backend!r} is not one of {', '.join(jpeg.BACKENDS)}")


def _check_probability(name: str, p: float) -> None:
    _numbers(name, (p,), 1)
    if not 0 <= p <= 1:
        raise UsageError(f"{name} must be a probability in [0, 1], got {p!r}")


def _call(t: Callable[..., Any], x: Any, generator: torch.Generator | None) -> Any:
    """``t(x)``, handing ``generator`` on where ``t`` declares ``takes_generator``."""
    if generator is not None and getattr(t, "takes_generator", False):
        return t(x, generator=generator)
    return t(x)


# ---------------------------------------------------------------------------------------------
# transforms


@dataclass(frozen=True)
class RandomResizedCrop:
    """Crop a random area (``scale`` of the image) and aspect ratio (``ratio``, log-uniform),
    then resize it to ``size``; 10 tries, then a centred crop of the nearest allowed ratio.
    With ``flip`` > 0 the crop is also mirrored left-right with that probability, drawn after
    the box from the same generator: the draws and the result of ``RandomHorizontalFlip(flip)``
    after it, at no cost (the decoder writes the rows mirrored).

    The box is drawn from the image header, so JPEG bytes decode only the box, drafted (see
    :mod:`shardloader.vision.image`); ``backend="pil"`` keeps to PIL's decoder."""

    size: Size
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    generator: torch.Generator | None = None
    flip: float = 0.0
    backend: str = "auto"
    takes_generator = True  # NOTE [transform generators]

    def __post_init__(self) -> None:
        hw_of(self.size, "size")
        _check_probability("flip", self.flip)
        _check_backend(self.backend)
        lo, hi = _numbers("scale", self.scale, 2)
        _numbers("ratio", self.ratio, 2)
        if not 0 < lo <= hi <= 1:
            raise UsageError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise UsageError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")

    def params(
        self, width: int, height: int, *, generator: torch.Generator | None = None
    ) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the crop in source pixels."""
        g = self.generator if self.generator is not None else generator
        area = width * height
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            u_area, u_ratio, u_top, u_left = _uniform(g, 4)
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u_area)
            aspect = math.exp(lo + (hi - lo) * u_ratio)
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(u_top * (height - h + 1))
                left = int(u_left * (width - w + 1))
                return left, top, w, h
        aspect = min(max(width / height, self.ratio[0]), self.ratio[1])
        if width / height > aspect:
            h, w = height, round(height * aspect)
        else:
            w, h = width, round(width / aspect)
        return (width - w) // 2, (height - h) // 2, max(w, 1), max(h, 1)

    def draw(
        self, width: int, height: int, *, generator: torch.Generator | None = None
    ) -> tuple[tuple[int, int, int, int], bool]:
        """The box (:meth:`params`) and whether to mirror it: every random choice of one call,
        in order (the GPU path, :mod:`shardloader.vision.gpu`, draws the same)."""
        box = self.params(width, height, generator=generator)
        g = self.generator if self.generator is not None else generator
        return box, self.flip > 0 and _uniform(g, 1)[0] < self.flip

    def out_shape(self, _: tuple[int, ...] | None) -> tuple[int, ...]:
        """The (3, height, width) of every result (NOTE [output shapes])."""
        return (3, *hw_of(self.size, "size"))

    def __call__(self, img: ImageLike, *, generator: torch.Generator | None = None) -> torch.Tensor:
        out_hw = hw_of(self.size, "size")
        src = open_lazy(img, self.backend)
        size = size_of(src)
        box, flip = self.draw(*size, generator=generator)
        wanted = jpeg.request(size, box, out_hw)
        if isinstance(src, Encoded) and src.native:  # one native call: decode box, resize
            out = jpeg.decode_box(src.data, size, box, wanted, flip=flip, out_hw=out_hw)
            if out is not None:
                return torch.from_numpy(out)
        return resize_chw(crop(src, box, wanted, flip=flip), out_hw)


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    p: float = 0.5
    generator: torch.Generator | None = None
    takes_generator = True  # NOTE [transform generators]

    def __post_init__(self) -> None:
        _check_probability("p", self.p)

    def __call__(self, img: ImageLike, *, generator: torch.Generator | None = None) -> torch.Tensor:
        flip = _uniform(self.generator if self.generator is not None else generator, 1)[0] < self.p
        return crop(open_lazy(img), flip=flip)


@dataclass(frozen=True)
class Resize:
    """Resize so the shorter side is ``size`` (int, aspect kept) or to exactly (height, width).

    JPEG bytes decode at the largest reduction that stays at least that big."""

    size: Size
    backend: str = "auto"

    def __post_init__(self) -> None:
        hw_of(self.size, "size")
        _check_backend(self.backend)

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the result for a source of ``width`` x ``height``."""
        if isinstance(self.size, (int, np.integer)):
            s = int(self.size)
            if width <= height:
                return max(round(height * s / width), 1), s
            return s, max(round(width * s / height), 1)
        return hw_of(self.size, "size")

    def __call__(self, img: ImageLike | Encoded) -> torch.Tensor:
        src = open_lazy(img, self.backend)
        size = size_of(src)
        out_hw = self.output_size(*size)
        return resize_chw(crop(src, None, jpeg.request(size, None, out_hw)), out_hw)


@dataclass(frozen=True)
class CenterCrop:
    """Crop the centre ``size`` (int: square); a smaller image is padded with zeros."""

    size: Size

    def __post_init__(self) -> None:
        hw_of(self.size, "size")

    def __call__(self, img: ImageLike | Encoded) -> torch.Tensor:
        out_h, out_w = hw_of(self.size, "size")
        img = open_lazy(img)
        width, height = size_of(img)
        if width < out_w or height < out_h:
            x = crop(img)
            pad_w, pad_h = max(out_w - width, 0), max(out_h - height, 0)
            x = torch.nn.functional.pad(
                x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
            )
            width, height = width + pad_w, height + pad_h
            return x[:, (height - out_h) // 2 :, (width - out_w) // 2 :][:, :out_h, :out_w]
        box = ((width - out_w) // 2, (height - out_h) // 2, out_w, out_h)
        return crop(img, box)  # no draft: the crop keeps source pixels


@dataclass(frozen=True)
class ResizeCenterCrop:
    """What ``Resize(resize)`` then ``CenterCrop(size)`` give, cut crop first: the centred box
    of the source that becomes the crop is decoded alone (JPEG: only its rows and MCU columns,
    drafted when it is at least twice ``size``) and resized to ``size``.  The box is rounded to
    whole source pixels, so the result can sit up to half a source pixel off the resize-first
    one.  ``resize`` (the shorter side before cropping) defaults to ``size / 0.875``; a
    ``resize`` smaller than ``size`` falls back to resize, then pad, as ``CenterCrop`` does."""

    size: Size
    resize: int | None = None
    backend: str = "auto"

    def __post_init__(self) -> None:
        hw_of(self.size, "size")
        if self.resize is not None:
            hw_of(self.resize, "resize")
        _check_backend(self.backend)

    out_shape = RandomResizedCrop.out_shape  # (3, height, width): the same rule

    def __call__(self, img: ImageLike | Encoded) -> torch.Tensor:
        out_hw = hw_of(self.size, "size")
        short = self.resize if self.resize is not None else round(min(out_hw) / 0.875)
        src = open_lazy(img, self.backend)
        width, height = size_of(src)
        rh, rw = Resize(short).output_size(width, height)
        if out_hw[0] > rh or out_hw[1] > rw:
            return CenterCrop(self.size)(Resize(short, self.backend)(src))
        bw = min(width, max(1, round(out_hw[1] * width / rw)))
        bh = min(height, max(1, round(out_hw[0] * height / rh)))
        box = ((width - bw) // 2, (height - bh) // 2, bw, bh)
        return resize_chw(crop(src, box, jpeg.request((width, height), box, out_hw)), out_hw)


@dataclass(frozen=True)
class ToImageTensor:
    """End of a pipeline: a uint8 tensor, contiguous CHW, or HWC with ``channels_last`` (no
    copy after the transforms above; stack to NHWC and ``permute(0, 3, 1, 2)`` on the GPU for
    a channels_last NCHW view)."""

    channels_last: bool = False

    def out_shape(self, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """``shape`` (CHW), as HWC with ``channels_last`` (NOTE [output shapes])."""
        if shape is None or not self.channels_last:
            return shape
        return (*shape[1:], shape[0])

    def __call__(self, img: ImageLike) -> torch.Tensor:
        return contiguous(crop(open_lazy(img)), self.channels_last)


@dataclass(frozen=True)
class Compose:
    """Apply transforms in order (``generator`` goes to those that take one)."""

    transforms: tuple[Callable[[Any], Any], ...]
    takes_generator = True  # NOTE [transform generators]

    def __init__(self, transforms: Iterable[Callable[[Any], Any]]) -> None:
        object.__setattr__(self, "transforms", tuple(transforms))

    def out_shape(self, shape: tuple[int, ...] | None) -> tuple[int, ...] | None:
        """The shape every result has, if each transform says (NOTE [output shapes])."""
        for t in self.transforms:
            step = getattr(t, "out_shape", None)
            if step is None:
                return None
            shape = step(shape)
        return shape

    def __call__(self, img: Any, *, generator: torch.Generator | None = None) -> Any:
        for t in self.transforms:
            img = _call(t, img, generator)
        return img


@dataclass(frozen=True)
class ApplyTo:
    """Run ``transform`` on one field of a sample dict (e.g. ``"image"``); other fields pass."""

    field: str
    transform: Callable[[Any], Any]
    takes_generator = True  # NOTE [transform generators]

    def __call__(
        self, sample: Mapping[str, Any], *, generator: torch.Generator | None = None
    ) -> dict[str, Any]:
        if not isinstance(sample, Mapping) or self.field not in sample:
            have = ", ".join(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise UsageError(f"ApplyTo({self.field!r}): the sample has no such field ({have})")
        out = dict(sample)
        out[self.field] = _call(self.transform, sample[self.field], generator)
        return out

    def fixed_output(self) -> tuple[str, tuple[int, ...]] | None:
        """(field, uint8 shape) of every result when the transforms fix it (NOTE [output
        shapes]), else None: read by :func:`shardloader.deliver.slotcollate.fixed_output`."""
        step = getattr(self.transform, "out_shape", None)
        shape = step(None) if step is not None else None
        return (self.field, shape) if shape is not None else None


def image_field(fields: Mapping[str, Any]) -> str | None:
    """The field a vision transform should apply to, from a manifest's ``fields``: ``image``
    (class-folder packs, ``--alias image=...``) if there is one, else the first image field."""
    images = [name for name, info in sorted(fields.items()) if info.codec == "image"]
    return "image" if "image" in images else next(iter(images), None)


def train_transform(
    size: Size,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    field: str | None = "image",
    channels_last: bool = False,
    backend: str = "auto",
) -> Compose | ApplyTo:
    """Random resized crop to ``size``, random flip, uint8 tensor (normalize on the GPU).

    It transforms the ``field`` of a sample dict (the dataset's ``transform=``); with
    ``field=None`` it transforms one image.  The flip is the crop's own (``flip=0.5``): the
    same draws and pixels as a ``RandomHorizontalFlip()`` after it, without the copy."""
    t = Compose(
        [
            RandomResizedCrop(size, scale, flip=0.5, backend=backend),
            ToImageTensor(channels_last),
        ]
    )
    return t if field is None else ApplyTo(field, t)


def eval_transform(
    size: Size,
    *,
    resize: int | None = None,
    field: str | None = "image",
    channels_last: bool = False,
    backend: str = "auto",
) -> Compose | ApplyTo:
    """Resize the shorter side to ``resize`` (default ``size / 0.875``), centre crop ``size``,
    uint8 tensor; of the ``field`` of a sample dict, or of one image with ``field=None``.
    The crop is cut first (:class:`ResizeCenterCrop`): only it is decoded and resized."""
    t = Compose([ResizeCenterCrop(size, resize, backend), ToImageTensor(channels_last)])
    return t if field is None else ApplyTo(field, t)
