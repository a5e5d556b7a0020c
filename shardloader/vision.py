"""Image decoding and the standard train/eval transforms, without torchvision.

Transforms take an image as encoded ``bytes``, a ``PIL.Image``, a numpy uint8 HWC array or a
uint8 CHW tensor, and return a uint8 CHW tensor (often with channels-last memory, a free view of
the decoded pixels); :class:`ToImageTensor` ends a pipeline with a contiguous CHW tensor, or HWC
with ``channels_last=True``.  Float conversion and normalization are left to
:class:`Normalize`, best run on the GPU on the whole batch.  They work on one image; for the
dataset's sample dicts wrap them in :class:`ApplyTo`; ``train_transform`` / ``eval_transform``
do so for the field ``image`` (what a class-folder pack holds, whatever the extensions) unless
given another ``field`` (``field=None``: a transform of one image).

Every image is converted to RGB the way ``Decoder()`` does (:mod:`shardloader.imagemode`):
grey, palette and CMYK converted, 16-bit scaled to 8 bits, transparency composited over white.

The fast path is encoded bytes in (``Decoder(image="raw")`` on the dataset): the crop box is
drawn from the image header, the JPEG decoder then runs at the smallest 1/2, 1/4 or 1/8 scale
(PIL ``draft``) that still covers the output, only the box is copied out of the decoded
pixels, and torch's vectorized uint8 antialiased bilinear kernel resizes it (measured several
times faster than PIL's resize; both are antialiased bilinear, results are close).  EXIF orientation
is not applied, as in most training pipelines.

Randomness comes only from torch: the global generator (which ShardedDataset seeds from
(seed, epoch, batch) before each batch's transforms) or an explicit ``torch.Generator`` given
to the transform.  Transforms are plain top-level classes, so they pickle into workers.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from shardloader.errors import DecodeError, UsageError
from shardloader.imagemode import convert

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "decode_image",
    "open_image",
    "RandomResizedCrop",
    "RandomHorizontalFlip",
    "Resize",
    "CenterCrop",
    "ToImageTensor",
    "Normalize",
    "Compose",
    "ApplyTo",
    "train_transform",
    "eval_transform",
    "image_field",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ImageLike = bytes | bytearray | memoryview | Image.Image | np.ndarray | torch.Tensor
Size = int | tuple[int, int]  # int: shorter side (Resize) / square; (height, width)


def _hw(size: Size, name: str) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        h = w = int(size)
    elif isinstance(size, Sequence) and len(size) == 2:
        h, w = (int(s) for s in size)
    else:
        raise UsageError(f"{name} must be an int or (height, width), got {size!r}")
    if h < 1 or w < 1:
        raise UsageError(f"{name} must be positive, got {size!r}")
    return h, w


def _draft_for(size: tuple[int, int], target: Size | None) -> tuple[int, int] | None:
    """PIL draft request (w, h) so the decoded image still covers ``target``."""
    if target is None:
        return None
    w, h = size
    if isinstance(target, (int, np.integer)):
        k = int(target) / min(w, h)  # shorter side to target
        return math.ceil(w * k), math.ceil(h * k)
    th, tw = _hw(target, "target_size")
    return tw, th


def open_image(
    data: bytes | bytearray | memoryview, *, target_size: Size | None = None
) -> Image.Image:
    """Decode to an RGB PIL image, for JPEG at a reduced scale that still covers ``target_size``
    (an int is the shorter side, else (height, width)); other formats decode at full size.
    Other modes convert as ``Decoder(mode="RGB")`` does (:func:`shardloader.imagemode.convert`)."""
    try:
        lazy = Image.open(io.BytesIO(data))
        request = _draft_for(lazy.size, target_size)
        if request is not None and lazy.format == "JPEG":
            lazy.draft("RGB", request)
        return _rgb(lazy)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DecodeError(f"cannot decode image ({len(data)} bytes): {err}") from err


def _rgb(image: Image.Image) -> Image.Image:
    return convert(image, "RGB")  # the Decoder's conversion: one rule for every path


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    target_size: Size | None = None,
    channels_last: bool = False,
) -> torch.Tensor:
    """Decode to a uint8 tensor, CHW (or HWC with ``channels_last``).

    With ``target_size`` a JPEG decodes at the largest reduction (1/2, 1/4, 1/8) that keeps the
    image at least that big (int: shorter side; (h, w): both); the result is *not* resized to
    exactly ``target_size`` (that is the transform's job).
    """
    return _contiguous(_pixels(open_image(data, target_size=target_size)), channels_last)


def _contiguous(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """CHW → contiguous CHW, or HWC with ``channels_last`` (free for HWC memory).  On the CPU
    numpy makes the copy: torch's uint8 permute-copy measured ~25x slower here."""
    if channels_last:
        return x.permute(1, 2, 0).contiguous()
    if x.is_contiguous():
        return x
    if x.device.type == "cpu" and not x.requires_grad:
        return torch.from_numpy(np.ascontiguousarray(x.numpy()))
    return x.contiguous()


def _size_of(img: ImageLike) -> tuple[int, int]:
    """(width, height); for an opened PIL image this reads only the header."""
    if isinstance(img, torch.Tensor):
        return int(img.shape[-1]), int(img.shape[-2])
    if isinstance(img, np.ndarray):
        return int(img.shape[1]), int(img.shape[0])
    if isinstance(img, Image.Image):
        return img.size
    raise UsageError(f"not an image: {type(img).__name__}")


def _open_lazy(img: ImageLike) -> tuple[ImageLike, bool]:
    """Encoded bytes → a PIL image with only the header read (ours to draft); else as is."""
    if isinstance(img, (bytes, bytearray, memoryview)):
        try:
            return Image.open(io.BytesIO(img)), True
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise DecodeError(f"cannot read image header ({len(img)} bytes): {err}") from err
    if not isinstance(img, (Image.Image, np.ndarray, torch.Tensor)):
        raise UsageError(
            f"not an image: {type(img).__name__}; give bytes, a PIL image, a uint8 HWC numpy "
            "array or a uint8 CHW tensor (use ApplyTo(field, ...) for sample dicts)"
        )
    return img, False


def _draft(
    image: Image.Image, box: tuple[int, int, int, int] | None, out_hw: tuple[int, int]
) -> float:
    """Let a JPEG decode at a reduced scale that keeps ``box`` (left, top, w, h in source
    pixels; default all) at least ``out_hw``; return the scale of the decoded image."""
    if image.format != "JPEG":
        return 1.0
    width, height = image.size
    bw, bh = (box[2], box[3]) if box else (width, height)
    request = (math.ceil(width * out_hw[1] / bw), math.ceil(height * out_hw[0] / bh))
    drafted = image.draft("RGB", request)
    return drafted[1][2] / width if drafted is not None else 1.0


def _pixels(
    img: ImageLike,
    box: tuple[int, int, int, int] | None = None,
    out_hw: tuple[int, int] | None = None,
    *,
    ours: bool = False,
) -> torch.Tensor:
    """The ``box`` (left, top, w, h in source pixels; default all) of ``img`` as a uint8 CHW
    tensor.  PIL/numpy input gives a tensor with HWC memory, cropped before the one copy; an
    image we opened ourselves (``ours``) is drafted for ``out_hw`` first."""
    if isinstance(img, torch.Tensor):
        if img.ndim != 3:
            raise UsageError(f"image tensors must be CHW, got shape {tuple(img.shape)}")
        if box is None:
            return img
        left, top, w, h = box
        return img[:, top : top + h, left : left + w]
    if isinstance(img, np.ndarray):
        if img.dtype != np.uint8 or img.ndim not in (2, 3):
            raise UsageError(f"numpy images must be uint8 HWC, got {img.dtype}{img.shape}")
        if img.ndim == 2 or img.shape[2] != 3:
            img = Image.fromarray(img)
        else:
            if box is not None:
                left, top, w, h = box
                img = img[top : top + h, left : left + w]
            return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)
    if not isinstance(img, Image.Image):
        raise UsageError(f"not an image: {type(img).__name__}; open bytes with _open_lazy")
    image = img
    scale = _draft(image, box, out_hw) if ours and out_hw is not None else 1.0
    try:
        image = _rgb(image)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DecodeError(f"cannot decode image: {err}") from err
    if box is not None:
        left, top, w, h = box
        x0, y0 = math.floor(left * scale), math.floor(top * scale)
        x1 = min(max(math.ceil((left + w) * scale), x0 + 1), image.size[0])
        y1 = min(max(math.ceil((top + h) * scale), y0 + 1), image.size[1])
        image = image.crop((x0, y0, x1, y1))
    hwc = np.frombuffer(bytearray(image.tobytes()), np.uint8)
    return torch.from_numpy(hwc.reshape(image.size[1], image.size[0], 3)).permute(2, 0, 1)


def _resize(img: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased resize of a CHW tensor; uint8 stays uint8 (torch's vectorized
    uint8 kernel, several times faster than PIL's resize on channels-last memory)."""
    if tuple(img.shape[-2:]) == hw:
        return img
    x = img[None]
    if x.dtype == torch.uint8:
        x = x.contiguous(memory_format=torch.channels_last)
    elif not x.is_floating_point():
        x = x.float()
    return torch.nn.functional.interpolate(x, size=hw, mode="bilinear", antialias=True)[0]


def _uniform(generator: torch.Generator | None, n: int) -> list[float]:
    return torch.rand(n, generator=generator, dtype=torch.float64).tolist()


# ---------------------------------------------------------------------------------------------
# transforms


@dataclass(frozen=True)
class RandomResizedCrop:
    """Crop a random area (``scale`` of the image) and aspect ratio (``ratio``, log-uniform),
    then resize it to ``size``; 10 tries, then a centred crop of the nearest allowed ratio.

    The box is drawn from the image header, so JPEG bytes decode drafted (see module doc)."""

    size: Size
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        _hw(self.size, "size")
        lo, hi = self.scale
        if not 0 < lo <= hi <= 1:
            raise UsageError(f"scale must satisfy 0 < min <= max <= 1, got {self.scale!r}")
        if not 0 < self.ratio[0] <= self.ratio[1]:
            raise UsageError(f"ratio must satisfy 0 < min <= max, got {self.ratio!r}")

    def params(self, width: int, height: int) -> tuple[int, int, int, int]:
        """(left, top, width, height) of the crop in source pixels."""
        area = width * height
        lo, hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for _ in range(10):
            u_area, u_ratio, u_top, u_left = _uniform(self.generator, 4)
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

    def __call__(self, img: ImageLike) -> torch.Tensor:
        out_hw = _hw(self.size, "size")
        src, ours = _open_lazy(img)
        box = self.params(*_size_of(src))
        return _resize(_pixels(src, box, out_hw, ours=ours), out_hw)


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Mirror left-right with probability ``p``."""

    p: float = 0.5
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.p <= 1:
            raise UsageError(f"p must be in [0, 1], got {self.p!r}")

    def __call__(self, img: ImageLike) -> torch.Tensor:
        flip = _uniform(self.generator, 1)[0] < self.p
        x = _pixels(_open_lazy(img)[0])
        return x.flip(-1) if flip else x


@dataclass(frozen=True)
class Resize:
    """Resize so the shorter side is ``size`` (int, aspect kept) or to exactly (height, width).

    JPEG bytes decode at the largest reduction that stays at least that big."""

    size: Size

    def __post_init__(self) -> None:
        _hw(self.size, "size")

    def output_size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) of the result for a source of ``width`` x ``height``."""
        if isinstance(self.size, (int, np.integer)):
            s = int(self.size)
            if width <= height:
                return max(round(height * s / width), 1), s
            return s, max(round(width * s / height), 1)
        return _hw(self.size, "size")

    def __call__(self, img: ImageLike) -> torch.Tensor:
        src, ours = _open_lazy(img)
        out_hw = self.output_size(*_size_of(src))
        return _resize(_pixels(src, None, out_hw, ours=ours), out_hw)


@dataclass(frozen=True)
class CenterCrop:
    """Crop the centre ``size`` (int: square); a smaller image is padded with zeros."""

    size: Size

    def __post_init__(self) -> None:
        _hw(self.size, "size")

    def __call__(self, img: ImageLike) -> torch.Tensor:
        out_h, out_w = _hw(self.size, "size")
        img, _ = _open_lazy(img)
        width, height = _size_of(img)
        if width < out_w or height < out_h:
            x = _pixels(img)
            pad_w, pad_h = max(out_w - width, 0), max(out_h - height, 0)
            x = torch.nn.functional.pad(
                x, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2)
            )
            width, height = width + pad_w, height + pad_h
            return x[:, (height - out_h) // 2 :, (width - out_w) // 2 :][:, :out_h, :out_w]
        box = ((width - out_w) // 2, (height - out_h) // 2, out_w, out_h)
        return _pixels(img, box)  # no draft: the crop keeps source pixels


@dataclass(frozen=True)
class ToImageTensor:
    """End of a pipeline: a uint8 tensor, contiguous CHW, or HWC with ``channels_last`` (no
    copy after the transforms above; stack to NHWC and ``permute(0, 3, 1, 2)`` on the GPU for
    a channels_last NCHW view)."""

    channels_last: bool = False

    def __call__(self, img: ImageLike) -> torch.Tensor:
        return _contiguous(_pixels(_open_lazy(img)[0]), self.channels_last)


@dataclass(frozen=True)
class Normalize:
    """``(x / 255 - mean) / std`` for uint8 input, ``(x - mean) / std`` for float input (taken
    as already in [0, 1]); works on one image or a batch, on any device, in ``dtype``."""

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    channels_last: bool = False  # channel dimension last (HWC / NHWC) instead of -3
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
        object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise UsageError(f"mean {self.mean} and std {self.std} need equal lengths, std > 0")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise UsageError(
                f"Normalize takes a tensor, got {type(x).__name__}; ToImageTensor first"
            )
        shape = (-1,) if self.channels_last else (-1, 1, 1)
        mean = torch.tensor(self.mean, dtype=self.dtype, device=x.device).view(shape)
        std = torch.tensor(self.std, dtype=self.dtype, device=x.device).view(shape)
        y = x.to(self.dtype)
        if x.dtype == torch.uint8:
            y = y / 255
        return (y - mean) / std


@dataclass(frozen=True)
class Compose:
    """Apply transforms in order."""

    transforms: tuple[Callable[[Any], Any], ...]

    def __init__(self, transforms: Iterable[Callable[[Any], Any]]) -> None:
        object.__setattr__(self, "transforms", tuple(transforms))

    def __call__(self, img: Any) -> Any:
        for t in self.transforms:
            img = t(img)
        return img


@dataclass(frozen=True)
class ApplyTo:
    """Run ``transform`` on one field of a sample dict (e.g. ``"image"``); other fields pass."""

    field: str
    transform: Callable[[Any], Any]

    def __call__(self, sample: Mapping[str, Any]) -> dict[str, Any]:
        if not isinstance(sample, Mapping) or self.field not in sample:
            have = ", ".join(sample) if isinstance(sample, Mapping) else type(sample).__name__
            raise UsageError(f"ApplyTo({self.field!r}): the sample has no such field ({have})")
        out = dict(sample)
        out[self.field] = self.transform(sample[self.field])
        return out


def image_field(fields: Mapping[str, Any]) -> str | None:
    """The field a vision transform should apply to, from a manifest's ``fields``: ``image``
    (class-folder packs, ``--alias image=...``) if there is one, else the first image field."""
    images = [name for name, info in sorted(fields.items()) if info.codec == "image"]
    return "image" if "image" in images else next(iter(images), None)


def _maybe_field(t: Compose, field: str | None) -> Compose | ApplyTo:
    return t if field is None else ApplyTo(field, t)


def train_transform(
    size: Size,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    field: str | None = "image",
    channels_last: bool = False,
) -> Compose | ApplyTo:
    """Random resized crop to ``size``, random flip, uint8 tensor (normalize on the GPU).

    It transforms the ``field`` of a sample dict (the dataset's ``transform=``); with
    ``field=None`` it transforms one image."""
    t = Compose(
        [RandomResizedCrop(size, scale), RandomHorizontalFlip(), ToImageTensor(channels_last)]
    )
    return _maybe_field(t, field)


def eval_transform(
    size: Size,
    *,
    resize: int | None = None,
    field: str | None = "image",
    channels_last: bool = False,
) -> Compose | ApplyTo:
    """Resize the shorter side to ``resize`` (default ``size / 0.875``), centre crop ``size``,
    uint8 tensor; of the ``field`` of a sample dict, or of one image with ``field=None``."""
    short = min(_hw(size, "size"))
    t = Compose(
        [
            Resize(resize if resize is not None else round(short / 0.875)),
            CenterCrop(size),
            ToImageTensor(channels_last),
        ]
    )
    return _maybe_field(t, field)
