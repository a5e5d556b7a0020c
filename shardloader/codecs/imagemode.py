"""One conversion of decoded images to the mode training wants, for ``Decoder`` and ``vision``.

Real image folders mix modes: grey, RGBA, palette (with a transparent colour), CMYK, 16-bit
grey.  PIL's plain ``convert("RGB")`` gets two of them wrong: it *clips* 16-bit values to 255
(a 16-bit grey scan comes out white) and exposes the undefined colour of transparent pixels
(often black: black text on a transparent logo vanishes).  Here:

- 16-bit (and 32-bit integer) grey is *scaled* to 8 bits (``v * 255 / 65535``, rounded);
- transparency (RGBA, LA, palette with a transparent index) is composited over white, the
  background an image viewer shows, unless the target mode is ``"RGBA"``;
- CMYK, YCbCr, bilevel and the rest use PIL's conversion.

A decoded image already in the target mode is returned as is: the common case costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from shardloader.errors import UsageError

if TYPE_CHECKING:  # PIL is imported where images are decoded, not by every importer
    from PIL import Image

__all__ = ["MODES", "BACKGROUND", "check_mode", "convert"]

MODES = ("RGB", "RGBA", "L")
BACKGROUND = (255, 255, 255)  # what transparent pixels become in RGB and L
_WIDE_GREY = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_ALPHA = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})


def check_mode(mode: str | None, what: str) -> None:
    if mode is not None and mode not in MODES:
        raise UsageError(f"{what} mode={mode!r} is not one of {', '.join(MODES)} or None")


def convert(image: Image.Image, mode: str) -> Image.Image:
    """``image`` in ``mode`` (one of :data:`MODES`), decoded; see the module doc for how."""
    if image.mode == mode:
        image.load()
        return image
    if image.mode in _WIDE_GREY:
        image = _eight_bit(image)
    elif image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in _ALPHA:
        from PIL import Image

        rgba = image.convert("RGBA")
        if mode == "RGBA":
            return rgba
        background = Image.new("RGBA", rgba.size, (*BACKGROUND, 255))
        image = Image.alpha_composite(background, rgba)
    return image if image.mode == mode else image.convert(mode)


def _eight_bit(image: Image.Image) -> Image.Image:
    """16-bit grey (or 32-bit integer, read as 16-bit) scaled, not clipped, to 8-bit ``L``."""
    from PIL import Image

    wide = np.asarray(image).astype(np.int64)
    scaled = (np.clip(wide, 0, 65535) * 255 + 32767) // 65535
    return Image.fromarray(scaled.astype(np.uint8))  # 2-D uint8: mode L
