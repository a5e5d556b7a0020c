"""Table files for the ``records`` layout: Parquet (streamed) and Arrow IPC (file or stream).

One sample per row, key ``<path without suffix>/<row:09d>`` (0-based).  Columns become one field
each: binary as is, strings as UTF-8, integers/booleans as ASCII digits, anything else as JSON;
nulls are left out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.errors import InputError, StorageError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.refs import InputFile, SampleRef
from shardloader.storage.store import Store

__all__ = ["SUFFIXES", "fields", "samples"]

SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def _open(f: InputFile, kind: str, store: Store) -> Any:
    """A Parquet file (streamed) or an Arrow IPC reader (file or stream format, read whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = store.open_read()
    if kind == "parquet":
        try:
            return pq.ParquetFile(stream)
        except BaseException:
            stream.close()
            raise
    with stream:
        data = pa.py_buffer(stream.read())
    try:
        return pa.ipc.open_file(data)
    except pa.ArrowInvalid:
        return pa.ipc.open_stream(data)


def _batches(table: Any) -> Iterator[Any]:
    if hasattr(table, "iter_batches"):  # parquet
        try:
            yield from table.iter_batches(batch_size=1024)
        finally:
            table.close(force=True)
    elif hasattr(table, "num_record_batches"):  # IPC file
        for i in range(table.num_record_batches):
            yield table.get_batch(i)
    else:  # IPC stream
        yield from table


def _column_codec(name: str, typ: Any) -> FieldInfo:
    import pyarrow as pa

    by_name = codec_for_extension(name)
    if (
        pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_fixed_size_binary(typ)
    ):
        return FieldInfo(by_name)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return FieldInfo(by_name if by_name in ("text", "json") else "text")
    if pa.types.is_integer(typ) or pa.types.is_boolean(typ):
        return FieldInfo("int")
    return FieldInfo("json")


def fields(f: InputFile, kind: str, store: Store) -> dict[str, FieldInfo]:
    """One field per column, from the schema alone (``store``: the file's own)."""
    import pyarrow as pa

    try:
        table = _open(f, kind, store)
        schema = table.schema_arrow if kind == "parquet" else table.schema
        if kind == "parquet":
            table.close(force=True)
    except (OSError, pa.ArrowInvalid, StorageError) as err:
        raise InputError(f"{f.url}: cannot read table schema ({err})") from err
    out = {}
    for column in schema:
        if not _FIELD_NAME.match(column.name):
            raise UsageError(
                f"{f.url}: column {column.name!r} cannot be a field name (letters, digits, "
                "'_', '.', '-'; not starting with '.' or '-'); rename the column"
            )
        out[column.name] = _column_codec(column.name, column.type)
    return out


def _encode_value(value: Any) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, int):
        return str(value).encode("ascii")
    return json.dumps(value, sort_keys=True, default=str).encode("utf-8")


def samples(f: InputFile, kind: str, stem: str, store: Store) -> Iterator[SampleRef]:
    row = 0
    for batch in _batches(_open(f, kind, store)):
        for record in batch.to_pylist():
            out = []
            for name in sorted(record):
                data = _encode_value(record[name])
                if data is not None:
                    out.append((name, data))
            yield SampleRef(f"{stem}/{row:09d}", tuple(out), f.rel, f"row {row}")
            row += 1
