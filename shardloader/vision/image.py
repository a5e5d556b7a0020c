"""Image decoding for the vision transforms: crop-aware JPEG decode, crops, fast resize.

Every image is converted to RGB the way ``Decoder()`` does (:mod:`shardloader.codecs.imagemode`):
grey, palette and CMYK converted, 16-bit scaled to 8 bits, transparency composited over white.

The fast path is encoded bytes in (``Decoder(image="raw")`` on the dataset): :func:`open_lazy`
reads only the header, a transform draws its crop box from the image size, and :func:`crop`
decodes that box alone.  A JPEG goes to the native decoder (:mod:`shardloader.codecs.jpeg`:
libjpeg-turbo decodes only the rows and MCU columns of the box, at the smallest 1/2, 1/4 or 1/8
DCT scale that still covers the output, mirrored on the way out if flipped); where it is not
built, or declines an image, or ``backend="pil"``, PIL decodes the whole image at the same scale
(``draft``) and the box is cut from it.  Other formats go through PIL.  The box is then resized
with Pillow's antialiased bilinear filter in SIMD C (:func:`resize_chw`, the extension's; in the
same call as the decode for a native random-resized crop), the same kernel on every path, so
both decoders give the same pixels; torch's uint8 kernel where the extension is not built.
EXIF orientation is not applied, as in most training pipelines.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from shardloader.codecs import jpeg
from shardloader.codecs.imagemode import convert
from shardloader.errors import DecodeError, UsageError

__all__ = ["decode_image", "open_image", "Encoded", "ImageLike", "Size"]

ImageLike = bytes | bytearray | memoryview | Image.Image | np.ndarray | torch.Tensor
Size = int | tuple[int, int]  # int: shorter side (Resize) / square; (height, width)


def hw_of(size: Size, name: str) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        h = w = int(size)
    elif isinstance(size, Sequence) and not isinstance(size, str) and len(size) == 2:
        try:
            h, w = (int(s) for s in size)
        except (TypeError, ValueError) as err:
            raise UsageError(f"{name} must be an int or (height, width), got {size!r}") from err
    else:
        raise UsageError(f"{name} must be an int or (height, width), got {size!r}")
    if h < 1 or w < 1:
        raise UsageError(f"{name} must be positive, got {size!r}")
    return h, w


def _request_for(size: tuple[int, int], target: Size | None) -> tuple[int, int] | None:
    """Draft request (w, h) so the decoded image still covers ``target``."""
    if target is None:
        return None
    if isinstance(target, (int, np.integer)):
        k = int(target) / min(size)  # shorter side to target
        return math.ceil(size[0] * k), math.ceil(size[1] * k)
    th, tw = hw_of(target, "target_size")
    return tw, th


def _open(data: bytes | bytearray | memoryview) -> Image.Image:
    try:
        return Image.open(io.BytesIO(data))
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DecodeError(f"cannot read image header ({len(data)} bytes): {err}") from err


class Encoded:
    """Encoded image bytes with only the header read: by the native JPEG decoder where it
    takes them (``backend="auto"``), else by PIL (opened lazily, ours to draft)."""

    __slots__ = ("data", "size", "native", "_image")

    def __init__(self, data: bytes | bytearray | memoryview, backend: str = "auto") -> None:
        self.data = data
        probed = jpeg.probe(data) if backend == "auto" else None
        self.native = probed is not None
        self._image: Image.Image | None = None
        if probed is not None:
            self.size = probed
        else:
            self._image = _open(data)
            self.size = self._image.size

    def pil(self) -> Image.Image:
        if self._image is None:
            self._image = _open(self.data)
        return self._image


def open_image(
    data: bytes | bytearray | memoryview, *, target_size: Size | None = None
) -> Image.Image:
    """Decode to an RGB PIL image, for JPEG at a reduced scale that still covers ``target_size``
    (an int is the shorter side, else (height, width)); other formats decode at full size.
    Other modes convert as ``Decoder(mode="RGB")`` does
    (:func:`shardloader.codecs.imagemode.convert`)."""
    lazy = _open(data)
    return _pil_box(lazy, None, _request_for(lazy.size, target_size), False)


def decode_image(
    data: bytes | bytearray | memoryview,
    *,
    target_size: Size | None = None,
    channels_last: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode to a uint8 tensor, CHW (or HWC with ``channels_last``).

    With ``target_size`` a JPEG decodes at the largest reduction (1/2, 1/4, 1/8) that keeps the
    image at least that big (int: shorter side; (h, w): both); the result is *not* resized to
    exactly ``target_size`` (that is the transform's job).  ``backend="pil"`` never uses the
    native JPEG decoder.
    """
    src = Encoded(data, backend)
    return contiguous(crop(src, None, _request_for(src.size, target_size)), channels_last)


def contiguous(x: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """CHW → contiguous CHW, or HWC with ``channels_last`` (free for HWC memory).  On the CPU
    numpy makes the copy: torch's uint8 permute-copy measured ~25x slower here."""
    if channels_last:
        return x.permute(1, 2, 0).contiguous()
    if x.is_contiguous():
        return x
    if x.device.type == "cpu" and not x.requires_grad:
        return torch.from_numpy(np.ascontiguousarray(x.numpy()))
    return x.contiguous()


def size_of(img: ImageLike | Encoded) -> tuple[int, int]:
    """(width, height); for encoded bytes this read only the header."""
    if isinstance(img, Encoded):
        return img.size
    if isinstance(img, torch.Tensor):
        return int(img.shape[-1]), int(img.shape[-2])
    if isinstance(img, np.ndarray):
        return int(img.shape[1]), int(img.shape[0])
    if isinstance(img, Image.Image):
        return img.size
    raise UsageError(f"not an image: {type(img).__name__}")


def open_lazy(img: ImageLike | Encoded, backend: str = "auto") -> ImageLike | Encoded:
    """Encoded bytes → :class:`Encoded` (header only); other images as they are."""
    if isinstance(img, (bytes, bytearray, memoryview)):
        return Encoded(img, backend)
    if not isinstance(img, (Encoded, Image.Image, np.ndarray, torch.Tensor)):
        raise UsageError(
            f"not an image: {type(img).__name__}; give bytes, a PIL image, a uint8 HWC numpy "
            "array or a uint8 CHW tensor (use ApplyTo(field, ...) for sample dicts)"
        )
    return img


def crop(
    img: ImageLike | Encoded,
    box: tuple[int, int, int, int] | None = None,
    wanted: tuple[int, int] | None = None,
    *,
    flip: bool = False,
) -> torch.Tensor:
    """The ``box`` (left, top, w, h in source pixels; default all) of ``img`` as a uint8 CHW
    tensor, mirrored left-right if ``flip``.  Encoded input decodes only what it must, JPEG at
    the reduction PIL ``draft(wanted)`` picks (``wanted``: (w, h) of the whole image, see
    :func:`shardloader.codecs.jpeg.request`); PIL/numpy input gives a tensor with HWC memory,
    cropped before the one copy."""
    if isinstance(img, Encoded):
        if img.native:
            hwc = jpeg.decode_box(img.data, img.size, box, wanted, flip=flip)
            if hwc is not None:
                return torch.from_numpy(hwc).permute(2, 0, 1)
        return _chw(_pil_box(img.pil(), box, wanted, flip))
    if isinstance(img, torch.Tensor):
        if img.ndim != 3:
            raise UsageError(f"image tensors must be CHW, got shape {tuple(img.shape)}")
        if box is not None:
            left, top, w, h = box
            img = img[:, top : top + h, left : left + w]
        return img.flip(-1) if flip else img
    if isinstance(img, np.ndarray):
        if img.dtype != np.uint8 or img.ndim not in (2, 3):
            raise UsageError(f"numpy images must be uint8 HWC, got {img.dtype}{img.shape}")
        if img.ndim == 3 and img.shape[2] == 3:
            if box is not None:
                left, top, w, h = box
                img = img[top : top + h, left : left + w]
            if flip:
                img = img[:, ::-1]
            return torch.from_numpy(np.array(img, copy=True)).permute(2, 0, 1)
        img = Image.fromarray(img)
    if not isinstance(img, Image.Image):
        raise UsageError(f"not an image: {type(img).__name__}; open bytes with open_lazy")
    return _chw(_pil_box(img, box, None, flip))


def _pil_box(
    image: Image.Image,
    box: tuple[int, int, int, int] | None,
    wanted: tuple[int, int] | None,
    flip: bool,
) -> Image.Image:
    """PIL's path: draft (an image we opened) for ``wanted``, decode, RGB (the Decoder's
    conversion: one rule for every path), crop, mirror."""
    factor = 1
    try:
        if wanted is not None and image.format == "JPEG":
            width = image.size[0]
            drafted = image.draft("RGB", wanted)
            factor = round(width / drafted[1][2]) if drafted is not None else 1
        full = image.size  # drafted: the scaled size
        image = convert(image, "RGB")
        if box is not None:
            image = image.crop(jpeg.scaled_box(box, factor, full))
        if flip:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise DecodeError(f"cannot decode image: {err}") from err
    return image


def _chw(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a uint8 CHW tensor over HWC memory (one copy)."""
    hwc = np.frombuffer(bytearray(image.tobytes()), np.uint8)
    return torch.from_numpy(hwc.reshape(image.size[1], image.size[0], 3)).permute(2, 0, 1)


def resize_chw(img: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear, antialiased resize of a CHW tensor; uint8 stays uint8.  Uint8 RGB on the CPU
    goes to the native kernel (:func:`shardloader.codecs.jpeg.resize`, contiguous CHW out,
    measured faster than torch's vectorized uint8 kernel with its copy to CHW); the rest, and
    everything where the extension is not built, to torch's."""
    if tuple(img.shape[-2:]) == hw:
        return img
    if (
        img.dtype == torch.uint8
        and img.ndim == 3
        and img.shape[0] == 3
        and img.device.type == "cpu"
    ):
        out = jpeg.resize(img.permute(1, 2, 0).numpy(), hw)  # free for HWC memory
        if out is not None:
            return torch.from_numpy(out)
    x = img[None]
    if x.dtype == torch.uint8:
        x = x.contiguous(memory_format=torch.channels_last)
    elif not x.is_floating_point():
        x = x.float()
    return torch.nn.functional.interpolate(x, size=hw, mode="bilinear", antialias=True)[0]
