"""Crop-aware JPEG decoding: only the crop box, at the smallest DCT scale that covers the output.

A random-resized crop is drawn from the image size, which the JPEG header gives before any
pixel is decoded.  The native decoder (:mod:`shardloader.codecs._jpeg`, C over the system's
libjpeg-turbo) then skips the rows above the box, never decodes the rows below it, runs the
inverse DCT and colour conversion only for the MCU columns the box touches, at scale 1/2, 1/4 or
1/8 when the box is that much larger than the output, and mirrors the rows while copying them
out when the crop is flipped.

The scale and the box in scaled pixels are the ones the PIL path uses (PIL ``draft``: the same
power of two from the same request), so both paths cut the same pixels from the same decode;
they differ only by libjpeg versions and the smoothing at MCU edges (README *Vision* gives the
measured tolerance; tests/test_vision_fast.py checks it).  Anything the native decoder does not
take (CMYK, 12-bit, corrupt data, a warning from libjpeg, more pixels than PIL's decompression
bomb limit) returns ``None`` and the caller decodes with PIL, whose verdict stands.
"""

from __future__ import annotations

import logging
import math

import numpy as np
from PIL import Image

__all__ = [
    "BACKENDS",
    "native_reason",
    "probe",
    "request",
    "scaled_box",
    "decode_box",
    "resize",
]

log = logging.getLogger(__name__)

try:
    import shardloader.codecs._jpeg as _jpeg
except ImportError as _err:  # built only where a C compiler and libjpeg headers were found
    _jpeg = None  # type: ignore[assignment]
    _WHY_NOT: str | None = (
        f"shardloader.codecs._jpeg is not built ({_err}); it needs a C compiler and "
        "libjpeg-turbo's headers at install (Debian: gcc libjpeg62-turbo-dev), then reinstall "
        "shardloader (README Dependencies); JPEGs decode through PIL meanwhile"
    )
else:
    _WHY_NOT = None

# the resize, for every path alike: whether the decoder is used or not (backend="pil", files it
# declines), the same kernel makes the same pixels from the same box
_RESIZE = _jpeg
BACKENDS = ("auto", "pil")  # auto: the native decoder where built and able, else PIL
_NATIVE_SPACES = frozenset({"YCbCr", "L", "RGB"})  # what libjpeg converts to RGB itself
_SOI = b"\xff\xd8\xff"


def native_reason() -> str | None:
    """Why the native decoder is not available here, or None when it is."""
    return _WHY_NOT


def probe(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(width, height) when the native decoder takes ``data`` (an 8-bit grey/YCbCr/RGB JPEG
    whose header reads, within PIL's pixel limit), else None: PIL decides."""
    if _jpeg is None or bytes(data[:3]) != _SOI:
        return None
    try:
        width, height, _, space = _jpeg.header(data)
    except _jpeg.JpegError:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if space not in _NATIVE_SPACES or (limit is not None and width * height > limit):
        return None  # PIL warns about or refuses what looks like a decompression bomb
    return width, height


def request(
    size: tuple[int, int], box: tuple[int, int, int, int] | None, out_hw: tuple[int, int]
) -> tuple[int, int]:
    """The (width, height) to draft the whole image to so that ``box`` (left, top, w, h;
    default all) still covers ``out_hw`` (height, width)."""
    width, height = size
    bw, bh = (box[2], box[3]) if box is not None else size
    return math.ceil(width * out_hw[1] / bw), math.ceil(height * out_hw[0] / bh)


def scaled_box(
    box: tuple[int, int, int, int], factor: int, scaled_size: tuple[int, int]
) -> tuple[int, int, int, int]:
    """``box`` (left, top, w, h in source pixels) as (x0, y0, x1, y1) in the image decoded at
    1/``factor`` (``scaled_size`` pixels): outward to whole pixels, at least one, inside."""
    scale = 1 / factor
    left, top, w, h = box
    x0, y0 = math.floor(left * scale), math.floor(top * scale)
    x1 = min(max(math.ceil((left + w) * scale), x0 + 1), scaled_size[0])
    y1 = min(max(math.ceil((top + h) * scale), y0 + 1), scaled_size[1])
    return x0, y0, x1, y1


def decode_box(
    data: bytes | bytearray | memoryview,
    size: tuple[int, int],
    box: tuple[int, int, int, int] | None,
    wanted: tuple[int, int] | None,
    *,
    flip: bool = False,
    out_hw: tuple[int, int] | None = None,
) -> np.ndarray | None:
    """The ``box`` (default all) of a JPEG ``probe`` accepted, as uint8 HWC RGB (mirrored if
    ``flip``), decoded at the scale PIL would draft to for ``wanted`` (:func:`request`); None
    if libjpeg objects.  With ``out_hw``: what :func:`resize` then gives, uint8 CHW, in the
    same native call (no Python object in between)."""
    assert _jpeg is not None, "probe() first"
    width, height = size
    # PIL draft(mode, wanted)'s reduction: the largest of 8, 4, 2 that keeps both sides at
    # least ``wanted``, else 1
    w, h = wanted or (width, height)
    slack = min(width // max(w, 1), height // max(h, 1))
    factor = next((f for f in (8, 4, 2) if slack >= f), 1)
    scaled = (-(-width // factor), -(-height // factor))
    x0, y0, x1, y1 = scaled_box(box or (0, 0, width, height), factor, scaled)
    try:
        if out_hw is None:
            buf = _jpeg.decode(data, 8 // factor, x0, y0, x1, y1, flip)
            return np.frombuffer(buf, np.uint8).reshape(y1 - y0, x1 - x0, 3)
        buf = _jpeg.decode_resize(data, 8 // factor, x0, y0, x1, y1, flip, out_hw[1], out_hw[0])
        return np.frombuffer(buf, np.uint8).reshape(3, *out_hw)
    except _jpeg.JpegError as err:
        log.debug("native JPEG decode declined (%s); decoding with PIL", err)
        return None


def resize(hwc: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray | None:
    """Antialiased bilinear resize of uint8 RGB pixels (HWC) to uint8 CHW: Pillow's filter in
    SIMD C (:mod:`shardloader.codecs._jpeg`); None where the extension is not built."""
    if _RESIZE is None:
        return None
    h, w = hwc.shape[:2]
    buf = _RESIZE.resize(np.ascontiguousarray(hwc).data, w, h, out_hw[1], out_hw[0])
    return np.frombuffer(buf, np.uint8).reshape(3, *out_hw)
