"""The cheap check ``pack`` runs on every image: no pixel decoded, a few microseconds each.

It catches what a broken copy or a killed download leaves: an empty file, a header nothing can
identify, a file cut short.  JPEG and PNG (most images) are walked here, without PIL, which
takes ~20 us just to open a JPEG; other formats are opened (header only) by PIL.

- JPEG: the marker segments from SOI up to the first scan (SOS) must be whole and include a
  frame header (SOFn) of non-zero width; an end-of-image marker (``FFD9``) must follow the
  scan's start.  ``FFD9`` cannot occur inside entropy-coded data, so a truncated file has none
  there, while padding or a camera trailer after it is fine.
- PNG: the signature, an ``IHDR`` chunk of non-zero size, and an ``IEND`` chunk.
- WebP: the RIFF length must fit in the file.
- Anything else: PIL must identify it and parse its header.

``pack --validate`` decodes every image instead (what a damaged scan needs to be found).
"""

from __future__ import annotations

import io

from shardloader.errors import InputError

__all__ = ["check_image"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the IEND chunk: length 0, type, CRC
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # SOFn (not DHT, JPG, DAC)
_JPEG_STANDALONE = frozenset(range(0xD0, 0xD8)) | {0x01, 0xD8}  # RSTn, TEM, SOI: no length


def check_image(data: bytes) -> None:
    """Raise :class:`InputError` (the caller adds the file) if ``data`` is not a whole image."""
    if not data:
        raise InputError("empty file (0 bytes)")
    if data[:3] == b"\xff\xd8\xff":
        start = _jpeg_scan_start(data)
        if data.rfind(b"\xff\xd9", start) < 0:
            raise InputError(f"truncated JPEG: no end-of-image marker (FFD9) in {len(data)} bytes")
        return
    if data[:8] == _PNG_SIGNATURE:
        if len(data) < 33 or data[12:16] != b"IHDR":
            raise InputError("damaged PNG header: no IHDR chunk")
        if not int.from_bytes(data[16:20], "big") or not int.from_bytes(data[20:24], "big"):
            raise InputError("damaged PNG header: zero width or height")
        if data.rfind(_PNG_END) < 0:
            raise InputError(f"truncated PNG: no IEND chunk in {len(data)} bytes")
        return
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        want = 8 + int.from_bytes(data[4:8], "little")
        if len(data) < want:
            raise InputError(f"truncated WebP: {len(data)} bytes, its header says {want}")
    _identify(data)


def _jpeg_scan_start(data: bytes) -> int:
    """Offset of the first scan's entropy-coded data, after checking the segments before it."""
    n = len(data)
    pos = 2
    frame = False
    while True:
        if pos + 4 > n:
            raise InputError(f"damaged JPEG header: it ends (at byte {n}) before the image data")
        if data[pos] != 0xFF:
            raise InputError(f"damaged JPEG header: no marker at byte {pos}")
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if marker == 0xD9:
            raise InputError(f"damaged JPEG: it ends at byte {pos} before any image data")
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if length < 2:
            raise InputError(f"damaged JPEG header: segment of length {length} at byte {pos}")
        if marker in _JPEG_FRAMES:
            if length < 8 or pos + 9 > n or not int.from_bytes(data[pos + 7 : pos + 9], "big"):
                raise InputError(f"damaged JPEG header: bad frame header at byte {pos}")
            frame = True
        elif marker == 0xDA:
            if not frame:
                raise InputError("damaged JPEG header: image data before any frame header")
            return pos + 2 + length
        pos += 2 + length


def _identify(data: bytes) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)):
            pass
    except UnidentifiedImageError as err:
        raise InputError(f"not an image PIL can identify ({len(data)} bytes)") from err
    except Exception as err:  # a damaged header surfaces as many PIL and struct errors
        raise InputError(f"damaged image header: {err}") from err
