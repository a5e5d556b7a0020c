"""What each Arrow column type becomes in a shard: a field codec, and a batch's cells as bytes.

NOTE [faithful cells]: every cell that pack stores comes back from ``Decoder()`` equal to what
pyarrow's ``to_pylist()`` gives for it (arrays: ``.tolist()`` equal, dtype kept), or pack
refuses the column (or the cell) naming its Arrow type; nothing goes through ``str()``.

============================================  =======================  ==========================
Arrow type                                    stored as (codec)        decoded to
============================================  =======================  ==========================
binary, large/fixed-size binary               the bytes (by name;      bytes, or an image
                                              ``image``: by magic)
struct ``{bytes, path}`` (HF Image/Audio)     the bytes (codec from    an image (HF ``Image``),
                                              the magic or the path)   else by the codec
string, large string, string view             UTF-8 (``text``)         str
integers                                      ASCII digits (``int``)   int
bool                                          ``true``/``false``       bool
                                              (``json``)
float16/32/64                                 JSON number (``json``)   float (NaN, ±Infinity)
timestamp[s/ms/us/ns, tz]                     ISO-8601 with offset     ``datetime`` (aware when
                                              (``datetime``)           the column has a tz)
date32/64, time32/64                          ISO-8601 (``date``,      ``date``, ``time``
                                              ``time``)
decimal128/256                                exact text (``decimal``) ``Decimal``
list/large list of integers (HF Sequence)     token ids (``tokens``,   1-D integer array
                                              the column's dtype)
fixed-size lists, lists of floats/bools,      ``.npy`` (``npy``, the   array, dtype kept
lists of lists of numbers (rectangular)       leaf dtype)
struct/list of strings, numbers, bools        JSON (``json``)          dict/list
dictionary (pandas ``category``)              as its values' type      the value
============================================  =======================  ==========================

A null is a missing value: the sample has no such member (tar) / a null (arrow), while the
field stays in the manifest; readers give ``None`` for it (``shardloader/read/fields.py``).
Anything else (maps, unions, durations, intervals, binary or temporal values inside lists and
structs) is refused: :func:`plan` returns None and the caller names the file, column and type.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.manifest import FieldInfo

__all__ = [
    "Cells",
    "ColumnPlan",
    "IMAGE_NAMES",
    "plan",
]


Cells = list[bytes | None]
# reads the file a ``{bytes: null, path}`` cell names (HF's form for images not embedded)
ReadPath = Callable[[str], bytes]
# binary columns named so are images when their first value's magic says so
IMAGE_NAMES = frozenset({"image", "img", "picture", "photo", "images"})


class _CellError(Exception):
    """Cell ``row`` (in its batch) of a column cannot be stored faithfully, because ``reason``;
    :mod:`.tables` turns it into an InputError naming file, row, column and type."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(reason)
        self.row, self.reason = row, reason


@dataclass(frozen=True)
class ColumnPlan:
    """A column's field and its encoder.  ``sniff``: the codec is the one the first value's
    magic or path gives (:func:`shardloader.codecs.sniff.codec_of`: ``bytes``, as ``info``
    says, when neither tells)."""

    info: FieldInfo
    encode: Callable[[pa.Array, ReadPath], Cells]
    sniff: bool = False


def _storage(typ: pa.DataType) -> pa.DataType:
    """The type whose values a column holds: extension types' storage, dictionaries' values."""
    while True:
        if isinstance(typ, pa.ExtensionType):
            typ = typ.storage_type
        elif pa.types.is_dictionary(typ):
            typ = typ.value_type
        else:
            return typ


def _values(arr: pa.Array) -> pa.Array:
    """``arr`` with extension and dictionary encodings taken off (pandas ``category``)."""
    while True:
        if isinstance(arr, pa.ExtensionArray):
            arr = arr.storage
        elif pa.types.is_dictionary(arr.type):
            arr = arr.dictionary_decode()
        else:
            return arr


def _is_binary(t: pa.DataType) -> bool:
    return (
        pa.types.is_binary(t)
        or pa.types.is_large_binary(t)
        or pa.types.is_fixed_size_binary(t)
        or pa.types.is_binary_view(t)
    )


def _is_string(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_var_list(t: pa.DataType) -> bool:
    return (
        pa.types.is_list(t)
        or pa.types.is_large_list(t)
        or pa.types.is_list_view(t)
        or pa.types.is_large_list_view(t)
    )


def _is_list(t: pa.DataType) -> bool:
    return _is_var_list(t) or pa.types.is_fixed_size_list(t)


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _leaf(t: pa.DataType) -> pa.DataType:
    while _is_list(t):
        t = _storage(t.value_type)
    return t


def _json_safe(t: pa.DataType) -> bool:
    """Whether JSON holds every value of ``t`` exactly (json.loads gives what to_pylist does)."""
    t = _storage(t)
    if _is_string(t) or _is_number(t) or pa.types.is_null(t):
        return True
    if _is_list(t):
        return _json_safe(t.value_type)
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        return len(set(names)) == len(names) and all(_json_safe(t.field(i).type) for i in names)
    return False


def _is_bytes_path(t: pa.DataType) -> bool:
    """A ``struct<bytes: binary, path: string>``: how Hugging Face stores images and audio
    (either child may be of type null, as pyarrow infers it from cells that are all None)."""
    t = _storage(t)
    if not pa.types.is_struct(t):
        return False
    if sorted(t.field(i).name for i in range(t.num_fields)) != ["bytes", "path"]:
        return False
    data, path = _storage(t.field("bytes").type), _storage(t.field("path").type)
    return (_is_binary(data) or pa.types.is_null(data)) and (
        _is_string(path) or pa.types.is_null(path)
    )


def plan(name: str, typ: pa.DataType, feature: dict[str, Any] | None) -> ColumnPlan | None:
    """How column ``name`` of Arrow type ``typ`` is stored (``feature``: its Hugging Face
    feature from the schema metadata, if any); None when it cannot be stored faithfully."""
    t = _storage(typ)
    kind = (feature or {}).get("_type")
    by_name = codec_for_extension(name)
    if _is_bytes_path(t):
        if kind == "Image":
            return ColumnPlan(FieldInfo("image"), _bytes_path)
        return ColumnPlan(FieldInfo("bytes"), _bytes_path, sniff=True)
    if _is_binary(t):
        sniff = by_name == "bytes" and name.lower() in IMAGE_NAMES
        return ColumnPlan(FieldInfo(by_name), _binary, sniff=sniff)
    if _is_string(t):
        return ColumnPlan(FieldInfo(by_name if by_name in ("text", "json") else "text"), _string)
    if pa.types.is_boolean(t):
        return ColumnPlan(FieldInfo("json"), _bool)
    if pa.types.is_integer(t):
        return ColumnPlan(FieldInfo("int"), _digits)
    if pa.types.is_floating(t):
        return ColumnPlan(FieldInfo("json"), _float)
    if pa.types.is_null(t):
        return ColumnPlan(FieldInfo("json"), _null)
    if pa.types.is_timestamp(t):
        return ColumnPlan(FieldInfo("datetime"), _iso(pa.timestamp("us", t.tz)))
    if pa.types.is_date(t):
        return ColumnPlan(FieldInfo("date"), _iso(None))
    if pa.types.is_time(t):
        return ColumnPlan(FieldInfo("time"), _iso(pa.time64("us")))
    if pa.types.is_decimal(t):
        return ColumnPlan(FieldInfo("decimal"), _digits)
    if _is_list(t) and _is_number(_leaf(t)):
        leaf = _leaf(t)
        if _is_var_list(t) and pa.types.is_integer(_storage(t.value_type)):
            return ColumnPlan(FieldInfo("tokens", str(leaf)), _tokens)
        return ColumnPlan(FieldInfo("npy"), _npy)
    if (_is_list(t) or pa.types.is_struct(t)) and _json_safe(t):
        return ColumnPlan(FieldInfo("json"), _json)
    return None


# -- encoders: one batch's column (an Array) → one bytes-or-None per row ------------------------


def _binary(arr: pa.Array, read: ReadPath) -> Cells:
    return _values(arr).to_pylist()  # type: ignore[no-any-return]


def _string(arr: pa.Array, read: ReadPath) -> Cells:
    return [None if v is None else v.encode("utf-8") for v in _values(arr).to_pylist()]


def _bool(arr: pa.Array, read: ReadPath) -> Cells:
    return [None if v is None else (b"true" if v else b"false") for v in _values(arr).to_pylist()]


def _digits(arr: pa.Array, read: ReadPath) -> Cells:
    """Integers and decimals: their exact digits."""
    return [None if v is None else str(v).encode("ascii") for v in _values(arr).to_pylist()]


def _float(arr: pa.Array, read: ReadPath) -> Cells:
    return [None if v is None else json.dumps(float(v)).encode() for v in _values(arr).to_pylist()]


def _null(arr: pa.Array, read: ReadPath) -> Cells:
    return [None] * len(arr)


def _json(arr: pa.Array, read: ReadPath) -> Cells:
    return [
        None if v is None else json.dumps(v, sort_keys=True, ensure_ascii=False).encode("utf-8")
        for v in _values(arr).to_pylist()
    ]


def _iso(exact: pa.DataType | None) -> Callable[[pa.Array, ReadPath], Cells]:
    """ISO-8601 text of temporal cells; ``exact``: the microsecond type a finer unit (ns) must
    cast to without loss, since Python's ``datetime``/``time`` hold microseconds."""

    def encode(arr: pa.Array, read: ReadPath) -> Cells:
        arr = _values(arr)
        if exact is not None and arr.type != exact:
            try:
                arr = pc.cast(arr, exact, safe=True)
            except pa.ArrowInvalid:
                for row in range(len(arr)):
                    try:
                        pc.cast(arr.slice(row, 1), exact, safe=True)
                    except pa.ArrowInvalid:
                        raise _CellError(
                            row,
                            f"{arr[row]} is finer than a microsecond, which Python's datetime "
                            f"cannot hold; cast the column to {exact} (rounding) before packing",
                        ) from None
                raise
        try:
            values = arr.to_pylist()
        except (ValueError, OverflowError):
            values = []
            for row in range(len(arr)):
                try:
                    values.append(arr[row].as_py())
                except (ValueError, OverflowError) as err:
                    raise _CellError(row, f"out of Python's datetime range ({err})") from err
        return [None if v is None else v.isoformat().encode("ascii") for v in values]

    return encode


def _bytes_path(arr: pa.Array, read: ReadPath) -> Cells:
    out: Cells = []
    for row, cell in enumerate(_values(arr).to_pylist()):
        data = None if cell is None else cell.get("bytes")
        path = None if cell is None else cell.get("path")
        if data is None and path:
            try:
                data = read(path)
            except Exception as err:  # any store, any reason: named with the remedy
                raise _CellError(
                    row,
                    f"holds no bytes, only the path {path!r}, which cannot be read ({err}); "
                    "embed the files' bytes in the table before writing it, as push_to_hub "
                    "does (datasets: ds.with_format('arrow').map(datasets.table."
                    "embed_table_storage, batched=True)), or keep the files in the table's "
                    "folder under relative paths",
                ) from err
        out.append(data)
    return out


def _has_null(values: pa.Array) -> bool:
    """Whether ``values`` (a list cell's child array) hold a null at any depth."""
    if values.null_count:
        return True
    return _is_list(values.type) and _has_null(_values(values.flatten()))


def _ndarray(cell: pa.Array, t: pa.DataType) -> np.ndarray:
    """One list cell's values (``cell``: the list's child array) as an array of its leaf dtype."""
    t = _storage(t)
    if not _is_list(t):
        return cell.to_numpy(zero_copy_only=False)
    parts = [_ndarray(_values(cell[i].values), t.value_type) for i in range(len(cell))]
    if not parts:
        return np.zeros((0,), _leaf(t).to_pandas_dtype())
    if len({p.shape for p in parts}) > 1:
        shapes = sorted({str(p.shape) for p in parts})
        raise ValueError(f"its lists differ in length ({', '.join(shapes[:3])})")
    return np.stack(parts)


def _list_cells(arr: pa.Array, encode: Callable[[np.ndarray], bytes]) -> Cells:
    arr = _values(arr)
    t = arr.type
    if not _is_list(_storage(t.value_type)) and not pa.types.is_list_view(t):
        flat = _values(arr.flatten())  # one level: the batch's values at once, then cut
        if not flat.null_count:
            lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False)
            rows = np.split(flat.to_numpy(zero_copy_only=False), np.cumsum(lengths)[:-1])
            valid = arr.is_valid().to_numpy(zero_copy_only=False)
            return [encode(r) if ok else None for r, ok in zip(rows, valid, strict=True)]
    out: Cells = []
    for row in range(len(arr)):
        cell = arr[row]
        if not cell.is_valid:
            out.append(None)
            continue
        values = _values(cell.values)
        if _has_null(values):
            raise _CellError(
                row,
                "a null inside the list cannot be stored in an array; fill or drop the nulls "
                "(pyarrow.compute.fill_null) before packing",
            )
        try:
            array = _ndarray(values, t.value_type)
        except ValueError as err:
            raise _CellError(row, f"{err}; an array needs equal lengths at every level") from err
        out.append(encode(array))
    return out


_NPY_HEADERS: dict[tuple[tuple[int, ...], str], bytes] = {}


def _npy_bytes(array: np.ndarray) -> bytes:
    """``np.save``'s bytes (no pickle), its header made once per shape and dtype."""
    array = np.ascontiguousarray(array)
    key = (array.shape, array.dtype.str)
    header = _NPY_HEADERS.get(key)
    if header is None:
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        header = buf.getvalue()[: buf.tell() - array.nbytes]
        if len(_NPY_HEADERS) < 4096:
            _NPY_HEADERS[key] = header
    return header + array.tobytes()


def _npy(arr: pa.Array, read: ReadPath) -> Cells:
    return _list_cells(arr, _npy_bytes)


def _tokens(arr: pa.Array, read: ReadPath) -> Cells:
    dtype = np.dtype(str(_leaf(_storage(arr.type)))).newbyteorder("<")
    return _list_cells(arr, lambda a: a.astype(dtype, copy=False).tobytes())
