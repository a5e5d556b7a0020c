"""Image decoding for the vision transforms: drafted JPEG decode, crops, fast resize.

Every image is converted to RGB the way ``Decoder()`` does (:mod:`shardloader.imagemode`):
grey, palette and CMYK converted, 16-bit scaled to 8 bits, transparency composited over white.

The fast path is encoded bytes in (``Decoder(image="raw")`` on the dataset): a transform draws
its crop box from the image header (:func:`open_lazy`), the JPEG decoder then runs at the
smallest 1/2, 1/4 or 1/8 scale (PIL ``draft``) that still covers the output, only the box is
copied out of the decoded pixels (:func:`pixels`), and torch's vectorized uint8 antialiased
bilinear kernel resizes it (:func:`resize_chw`; measured several times faster than PIL's
resize; both are antialiased bilinear, results are close).  EXIF orientation is not applied, as
in most training pipelines.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from shardloader.errors import DecodeError, UsageError
from shardloader.imagemode import convert

__all__ = ["decode_image", "open_image", "ImageLike", "Size"]

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


def _draft_for(size: tuple[int, int], target: Size | None) -> tuple[int, int] | None:
    """PIL draft request (w, h) so the decoded image still covers ``target``."""
    if target is None:
        return None
    w, h = size
    if isinstance(target, (int, np.integer)):
        k = int(target) / min(w, h)  # shorter side to target
        return math.ceil(w * k), math.ceil(h * k)
    th, tw = hw_of(target, "target_size")
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
    return contiguous(pixels(open_image(data, target_size=target_size)), channels_last)


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


def size_of(img: ImageLike) -> tuple[int, int]:
    """(width, height); for an opened PIL image this reads only the header."""
    if isinstance(img, torch.Tensor):
        return int(img.shape[-1]), int(img.shape[-2])
    if isinstance(img, np.ndarray):
        return int(img.shape[1]), int(img.shape[0])
    if isinstance(img, Image.Image):
        return img.size
    raise UsageError(f"not an image: {type(img).__name__}")


def open_lazy(img: ImageLike) -> tuple[ImageLike, bool]:
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


def pixels(
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
        raise UsageError(f"not an image: {type(img).__name__}; open bytes with open_lazy")
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


def resize_chw(img: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
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
