"""Per-field decoders from an allowlist (no pickle codec exists), and image checks.

:mod:`~shardloader.codecs.allowlist` holds the codecs and :class:`Decoder`;
:mod:`~shardloader.codecs.imagecheck` the cheap check ``pack`` runs on every image;
:mod:`~shardloader.codecs.imagemode` the one conversion of decoded images to a mode;
:mod:`~shardloader.codecs.jpeg` the native JPEG decoder (crops, scaled, whole images);
:mod:`~shardloader.codecs.sniff` the codec some bytes imply (table cells carry no extension);
:mod:`~shardloader.codecs.arrowcells` and :mod:`~shardloader.codecs.tableschema` what table
columns become.  Import from those modules; this file only names :class:`Decoder` here too.
"""

from shardloader.codecs.allowlist import Decoder

__all__ = ["Decoder"]
