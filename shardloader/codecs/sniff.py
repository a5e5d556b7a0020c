"""The codec some bytes imply, from their leading bytes (magic) or else a file name.

Table cells carry no extension of their own: a Hugging Face ``Image``/``Audio`` cell is
``{bytes, path}``, and a binary column named ``image`` is just bytes.  Their field's codec comes
from the first value's magic, so an image field decodes as one; pack's check of every value
(``check_field``) then refuses a later value that is not an image, naming it.
"""

from __future__ import annotations

from shardloader.codecs.allowlist import codec_for_extension

__all__ = ["codec_of", "is_image"]

# Leading bytes of the image formats PIL reads that say so unambiguously.
_IMAGE_MAGIC = (
    b"\xff\xd8\xff",  # JPEG
    b"\x89PNG\r\n\x1a\n",
    b"GIF87a",
    b"GIF89a",
    b"II*\x00",  # TIFF, little-endian
    b"MM\x00*",  # TIFF, big-endian
    b"\x00\x00\x00\x0cjP  \r\n\x87\n",  # JPEG 2000
    b"qoif",
)


def is_image(data: bytes) -> bool:
    """Whether ``data`` starts like an image file (JPEG, PNG, GIF, WebP, TIFF, AVIF, ...)."""
    if data.startswith(_IMAGE_MAGIC):
        return True
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return True
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return True
    return data[:2] == b"BM" and len(data) > 26 and data[14] in (12, 40, 52, 56, 108, 124)


def codec_of(data: bytes | None, path: str | None) -> str:
    """``image`` for image bytes, else the codec of ``path``'s extension, else ``bytes``."""
    if data and is_image(data):
        return "image"
    base = (path or "").rsplit("/", 1)[-1]
    if "." in base.lstrip("."):
        codec = codec_for_extension(base.rsplit(".", 1)[-1])
        if codec != "image" or data is None:  # an image name on bytes that are not one: bytes
            return codec
    return "bytes"
