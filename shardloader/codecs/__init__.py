"""Per-field decoders from an allowlist (no pickle codec exists), and image checks.

:mod:`~shardloader.codecs.allowlist` holds the codecs and :class:`Decoder`;
:mod:`~shardloader.codecs.imagecheck` the cheap check ``pack`` runs on every image;
:mod:`~shardloader.codecs.imagemode` the one conversion of decoded images to a mode;
:mod:`~shardloader.codecs.jpeg` the native JPEG decoder (crops, scaled, whole images);
:mod:`~shardloader.codecs.sniff` the codec some bytes imply (table cells carry no extension);
:mod:`~shardloader.codecs.arrowcells` and :mod:`~shardloader.codecs.tableschema` what table
columns become.  This file only re-exports what is used as ``codecs.NAME``.
"""

from shardloader.codecs.allowlist import Decoder, check_field
from shardloader.codecs.imagecheck import check_image

__all__ = ["Decoder", "check_field", "check_image"]
