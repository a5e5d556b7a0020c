"""Per-field decoders from an allowlist (no pickle codec exists), and image checks.

:mod:`~shardloader.codecs.allowlist` holds the codecs and :class:`Decoder`;
:mod:`~shardloader.codecs.imagecheck` the cheap check ``pack`` runs on every image;
:mod:`~shardloader.codecs.imagemode` the one conversion of decoded images to a mode;
:mod:`~shardloader.codecs.sniff` the codec some bytes imply (table cells carry no extension).
This file only re-exports.
"""

from shardloader.codecs.allowlist import (
    IMAGE_EXTENSIONS,
    PICKLE_EXTENSIONS,
    Decoder,
    check_field,
    check_image,
    codec_for_extension,
    decode_field,
)

__all__ = [
    "IMAGE_EXTENSIONS",
    "PICKLE_EXTENSIONS",
    "codec_for_extension",
    "check_field",
    "check_image",
    "decode_field",
    "Decoder",
]
