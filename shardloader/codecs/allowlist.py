"""Per-field encode checks and decoders, chosen from an allowlist by file extension.

A field's extension (the part of a member name after the sample key, e.g. ``jpg`` or
``seg.png``; its last dotted component decides) maps to a codec name.  The codec name is
recorded in the manifest, so readers never guess.  There is no pickle codec: ``.pkl``/``.pth``
fields are stored as opaque bytes and decoding them is an error that names the remedy.

Table columns add the codecs their Arrow types need (``shardloader/codecs/arrowcells.py``):
``datetime``/``date``/``time`` (ISO-8601 text, decoded by :mod:`datetime`'s ``fromisoformat``)
and ``decimal`` (the exact decimal text, decoded to :class:`decimal.Decimal`).
"""

from __future__ import annotations

import datetime
import decimal
import functools
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shardloader.codecs.imagecheck import check_image
from shardloader.codecs.imagemode import check_mode, convert
from shardloader.errors import DecodeError, InputError, UsageError

__all__ = [
    "IMAGE_EXTENSIONS",
    "PICKLE_EXTENSIONS",
    "codec_for_extension",
    "check_field",
    "decode_field",
    "Decoder",
    "parse_typed",
    "typed_text",
]

# Extensions of images that PIL reads (JPEG's .jfif/.jpe, Netpbm's .pgm/.pbm/.pnm, AVIF, ...).
IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "jpe", "jfif", "png", "apng", "webp", "bmp", "dib", "gif", "tif", "tiff"}
    | {"ppm", "pgm", "pbm", "pnm", "avif", "ico", "tga", "qoi", "jp2", "j2k"}
)
PICKLE_EXTENSIONS = frozenset({"pkl", "pickle", "pyd", "pth", "pt", "ckpt"})
# a field's last extension -> its codec; any other is "bytes"
_BY_EXTENSION = {
    **dict.fromkeys(IMAGE_EXTENSIONS, "image"),
    **dict.fromkeys(("txt", "text", "md", "html", "xml", "csv", "tsv", "caption"), "text"),
    **dict.fromkeys(("json", "jsonl"), "json"),
    **dict.fromkeys(("cls", "cls2", "index", "label", "int", "id"), "int"),
    **dict.fromkeys(("tokens", "ids"), "tokens"),
    **dict.fromkeys(PICKLE_EXTENSIONS, "opaque"),
    "npy": "npy",
}
_BASE_CODECS = ("image", "text", "json", "int", "npy", "tokens", "bytes", "opaque")
# Table cells of Arrow types without a JSON form, as their ISO-8601 / exact decimal text
# (``codecs/arrowcells.py``); decoded to the value pyarrow gives for the cell.
_TYPED: dict[str, Callable[[str], Any]] = {
    "datetime": datetime.datetime.fromisoformat,
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "decimal": decimal.Decimal,
}
_CODECS: tuple[str, ...] = (*_BASE_CODECS, *_TYPED)


def codec_for_extension(ext: str) -> str:
    """Return the codec name for a field extension (``"seg.png"`` decides on ``png``)."""
    return _BY_EXTENSION.get(ext.rsplit(".", 1)[-1].lower(), "bytes")


def check_field(codec: str, data: bytes, *, validate_images: bool = False) -> None:
    """Raise :class:`InputError` (without location; the caller adds it) if ``data`` is invalid:
    a value codec's bytes are decoded as a reader decodes them (JSON from UTF-8 text only),
    an image is checked (:func:`check_image`) or, with ``validate_images``, decoded."""
    try:
        if codec == "image" and validate_images:
            from PIL import Image

            if not data:
                raise InputError("empty file (0 bytes)")
            with Image.open(io.BytesIO(data)) as im:
                im.load()
        elif codec == "image":
            check_image(data)
        elif codec == "json":
            json.loads(data.decode("utf-8"))
        elif codec in _VALUES:
            _VALUES[codec](data)
    except UnicodeDecodeError as err:
        raise InputError(f"invalid UTF-8 at byte {err.start}") from err
    except json.JSONDecodeError as err:
        raise InputError(f"invalid JSON ({err.msg} at char {err.pos})") from err
    except InputError:
        raise
    except Exception as err:  # PIL and numpy raise many types for corrupt data
        raise InputError(f"invalid {codec} data: {err}") from err


def _load_npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def typed_text(value: Any) -> tuple[str, str] | None:
    """The codec and text of a ``datetime``/``date``/``time``/``Decimal`` value (what a table
    cell of such a type is stored as, and how ``shardloader serve`` sends it); None for others."""
    if isinstance(value, decimal.Decimal):
        return "decimal", str(value)
    for codec in ("datetime", "date", "time"):  # datetime first: it is a date too
        if isinstance(value, getattr(datetime, codec)):
            return codec, value.isoformat()
    return None


def _decode_typed(codec: str, data: bytes) -> Any:
    """A ``datetime``/``date``/``time``/``decimal`` field: its text parsed back to the value."""
    return parse_typed(codec, data.decode("ascii"))


def parse_typed(codec: str, text: str) -> Any:
    """The value :func:`typed_text` gave ``text`` for (a :class:`DecodeError` when it is not
    one: an unknown codec, a malformed text, a decimal that is not finite)."""
    if codec not in _TYPED:
        raise DecodeError(f"{codec!r} is not one of the typed codecs {tuple(_TYPED)}")
    try:
        value = _TYPED[codec](text)
    except (ValueError, decimal.InvalidOperation) as err:
        what = "a decimal number" if codec == "decimal" else f"an ISO-8601 {codec}"
        raise DecodeError(f"{text!r} is not {what}") from err
    if codec == "decimal" and not value.is_finite():
        raise DecodeError(f"{text!r} is not a finite decimal")
    return value


def _text(data: bytes) -> str:
    return data.decode("utf-8")


# The codecs whose bytes alone make the value: readers decode them, and pack checks them, so.
_VALUES: dict[str, Callable[[bytes], Any]] = {
    "text": _text,
    "json": json.loads,
    "int": int,
    "npy": _load_npy,
    **{codec: functools.partial(_decode_typed, codec) for codec in _TYPED},
}


def _decode_image(data: bytes, kind: str, mode: str | None) -> Any:
    """An image as ``kind``.  An RGB tensor of a JPEG comes from the native decoder
    (libjpeg-turbo, the whole image, into memory the tensor then owns) where it is built and
    takes the file, else from PIL: both give the same pixels (max difference 0 on
    tests/test_vision_fast.py's set and on JPEGs from other encoders:
    tests/test_native_decode.py)."""
    from shardloader.codecs import jpeg

    size = jpeg.probe(data) if kind == "tensor" and mode == "RGB" else None
    hwc = None if size is None else jpeg.decode_box(data, size, None, None)
    if hwc is None:
        from PIL import Image

        image: Image.Image = Image.open(io.BytesIO(data))
        if mode is not None:
            image = convert(image, mode)
        else:
            image.load()
        if kind == "pil":
            return image
        hwc = np.asarray(image)
        if hwc.ndim == 2:  # one band (L, P, I;16... kept with mode=None): HW1
            hwc = hwc[:, :, None]
        if not hwc.dtype.isnative:
            hwc = hwc.astype(hwc.dtype.newbyteorder("="))
        if kind == "numpy":
            return hwc
        hwc = hwc.copy()
    import torch

    return torch.from_numpy(hwc).permute(2, 0, 1)  # CHW over HWC memory


@dataclass(frozen=True)
class Decoder:
    """How to turn stored bytes into Python values, per codec.

    ``image``: ``"tensor"`` (uint8 CHW), ``"numpy"`` (uint8 HWC), ``"pil"`` or ``"raw"`` (bytes).
    ``mode``: every decoded image is converted to ``"RGB"`` (default), ``"RGBA"`` or ``"L"``
    (grey): 16-bit images are scaled to 8 bits, transparency is composited over white (kept in
    ``"RGBA"``), CMYK and palette images converted (:mod:`shardloader.codecs.imagemode`).  ``None``
    keeps each image's stored mode (e.g. palette indices of segmentation masks; 16-bit stays
    uint16), so shapes and dtypes may then differ between images.  RGB tensors of JPEGs come
    from the native decoder where it is built (:func:`_decode_image`: PIL's pixels, half its CPU).
    ``custom`` maps a field (or member extension) to a function of the bytes; it is the only
    way to read an opaque (pickled) field, and the choice of trusting that data is then the
    caller's.
    ``fill`` and ``required`` say what a sample that lacks a field (or holds a null) gets: a
    value filled in, or refusal (skipped under ``on_error="skip"``); see
    :mod:`shardloader.read.fields`.
    """

    image: str = "tensor"
    custom: Mapping[str, Callable[[bytes], Any]] = field(default_factory=dict)
    mode: str | None = "RGB"
    fill: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.image not in ("tensor", "numpy", "pil", "raw"):
            raise UsageError(
                f"Decoder(image={self.image!r}) is not one of 'tensor', 'numpy', 'pil', 'raw'"
            )
        if not isinstance(self.custom, Mapping):
            raise UsageError(
                f"Decoder(custom=...) maps a field to a function of its bytes, got "
                f"{type(self.custom).__name__}"
            )
        for name, fn in self.custom.items():
            if not callable(fn):
                raise UsageError(
                    f"Decoder(custom={{{name!r}: ...}}) must be a function of the bytes, got "
                    f"{type(fn).__name__}"
                )
        check_mode(self.mode, "Decoder")
        if not isinstance(self.fill, Mapping) or not all(
            isinstance(k, str) and k for k in self.fill
        ):
            raise UsageError(
                f"Decoder(fill=...) maps a field name to the value a sample lacking it gets, "
                f"e.g. fill={{'txt': ''}}; got {self.fill!r}"
            )
        required = (self.required,) if isinstance(self.required, str) else self.required
        if not all(isinstance(k, str) and k for k in required):
            raise UsageError(
                f"Decoder(required=...) is a tuple of field names, e.g. ('jpg',); got "
                f"{self.required!r}"
            )
        object.__setattr__(self, "required", tuple(required))
        both = sorted(set(self.fill) & set(self.required))
        if both:
            raise UsageError(
                f"Decoder: field {both[0]!r} is both filled and required; a filled field is "
                "never missing, so give it in one of fill= and required="
            )


def decode_field(
    ext: str,
    codec: str,
    data: bytes,
    decoder: Decoder,
    *,
    dtype: str | None = None,
    member: str | None = None,
) -> Any:
    """Decode one field's bytes according to its codec (recorded in the manifest).

    ``ext`` is the field's name; ``member`` the extension of the stored member when the field
    is an alias of several (``image`` ← ``png``); a custom decoder may be keyed by either.
    """
    custom = decoder.custom.get(ext)
    if custom is None and member is not None:
        custom = decoder.custom.get(member)
    if custom is not None:
        return custom(data)
    if codec == "image":
        if decoder.image == "raw":
            return data
        return _decode_image(data, decoder.image, decoder.mode)
    value = _VALUES.get(codec)
    if value is not None:
        return value(data)
    if codec == "tokens":
        # a writable copy: torch warns on (and may not share) read-only buffers
        return np.frombuffer(bytearray(data), dtype=np.dtype(dtype or "uint32").newbyteorder("<"))
    if codec == "bytes":
        return data
    if codec == "opaque":
        raise DecodeError(
            f"field {ext!r} holds pickled data, which shardloader never unpickles; "
            f"pass Decoder(custom={{{ext!r}: your_function}}) if you trust its source"
        )
    raise DecodeError(f"unknown codec {codec!r} for field {ext!r}; known: {', '.join(_CODECS)}")
