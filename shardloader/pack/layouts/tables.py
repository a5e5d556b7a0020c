"""Table files for the ``records`` layout: Parquet (streamed) and Arrow IPC (file or stream:
``datasets.Dataset.save_to_disk`` writes streams, ``data-00000-of-00001.arrow``).

One sample per row, key ``<path without suffix>/<row:09d>`` (0-based).  Columns become one field
each, stored as their Arrow type says (:mod:`.arrowcells`, NOTE [faithful cells]: every cell
decodes back equal to what pyarrow reads; a type that cannot is an error naming the column).
A null is a missing value: the row's sample has no such field, the manifest still lists it.

Files written by Hugging Face ``datasets`` carry their features in the schema metadata (key
``huggingface``): an ``Image`` column becomes an ``image``-codec field, and the names of a
``ClassLabel`` column become the manifest's ``classes`` (the column stays an integer field).
A ``save_to_disk`` Arrow file without that metadata takes them from ``dataset_info.json``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from shardloader.codecs.arrowcells import ColumnPlan, ReadPath, _CellError
from shardloader.codecs.sniff import codec_of
from shardloader.codecs.tableschema import class_names, hf_features, plan_columns
from shardloader.errors import InputError, StorageError, UsageError, located
from shardloader.format.tar.layout import EMPTY
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import OnSkip
from shardloader.pack.refs import InputFile, SampleRef
from shardloader.storage.store import Store, join

__all__ = [
    "SUFFIXES",
    "Classes",
    "Table",
    "batches",
    "describe",
    "open_table",
    "samples",
    "same_classes",
    "schema_of",
]

log = logging.getLogger(__name__)

SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Table:
    """What one table file gives: its fields (one per column) and class names (ClassLabel)."""

    fields: dict[str, FieldInfo]
    classes: tuple[str, ...] = ()


def open_table(f: InputFile, kind: str, store: Store) -> Any:
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


def schema_of(table: Any, kind: str) -> Any:
    return table.schema_arrow if kind == "parquet" else table.schema


def batches(table: Any, columns: list[str] | None = None, size: int = 1024) -> Iterator[Any]:
    if hasattr(table, "iter_batches"):  # parquet
        try:
            yield from table.iter_batches(batch_size=size, columns=columns)
        finally:
            table.close(force=True)
    elif hasattr(table, "num_record_batches"):  # IPC file
        for i in range(table.num_record_batches):
            yield table.get_batch(i)
    else:  # IPC stream
        yield from table


_SAVED_INFO = "dataset_info.json"  # save_to_disk writes it beside its data-*.arrow files
_INFO_MOST = 16 << 20  # bytes of it read at most: features, never data


def _features(f: InputFile, schema: Any, store: Store) -> dict[str, Any]:
    """The file's Hugging Face features: from its schema metadata, else (an Arrow file of a
    ``save_to_disk`` folder written without it) from the ``dataset_info.json`` beside it."""
    features = hf_features(schema)
    name = f.rel.rpartition("/")[2]
    if features or not (name.startswith("data-") and name.endswith(".arrow")):
        return features
    info = Store(join(store.url.rsplit("/", 1)[0], _SAVED_INFO), store.options, store.retry)
    try:
        if not info.exists():
            return {}
        found = json.loads(info.read_bytes(_INFO_MOST)).get("features")
    except (OSError, StorageError, ValueError, AttributeError) as err:
        log.warning("%s: ignoring unreadable %s (%s)", f.url, _SAVED_INFO, err)
        return {}
    return found if isinstance(found, dict) else {}


def _plans(f: InputFile, schema: Any, features: Mapping[str, Any]) -> dict[str, ColumnPlan]:
    """Each column's plan, sorted by name; a column pack cannot store is an InputError, a name
    no field may have a UsageError."""
    for column in schema:
        if column.name == EMPTY:
            raise UsageError(
                f"{f.url}: column {column.name!r} is the name tar shards reserve for the marker "
                "of a sample with no fields (a row of nulls); rename the column"
            )
        if not _FIELD_NAME.match(column.name):
            raise UsageError(
                f"{f.url}: column {column.name!r} cannot be a field name (letters, digits, "
                "'_', '.', '-'; not starting with '.' or '-'); rename the column"
            )

    def unsupported(message: str) -> InputError:
        return InputError(
            f"{message}; cast it to strings, numbers, lists of numbers, or structs and lists "
            "of those, or drop the column before packing"
        )

    with located(f.url):
        return plan_columns(schema, features, unsupported)


def describe(f: InputFile, kind: str, store: Store) -> Table:
    """Fields from the schema (and the first values of byte columns whose codec their magic
    or path decides); classes from a ClassLabel feature.  ``store``: the file's own."""
    import pyarrow as pa

    try:
        table = open_table(f, kind, store)
        schema = schema_of(table, kind)
        if kind == "parquet":
            table.close(force=True)
    except (OSError, pa.ArrowInvalid, StorageError) as err:
        raise InputError(f"{f.url}: cannot read table schema ({err})") from err
    features = _features(f, schema, store)
    plans = _plans(f, schema, features)
    fields = {name: p.info for name, p in plans.items()}
    sniff = [name for name, p in plans.items() if p.sniff]
    if sniff:
        fields.update(_sniffed(f, kind, store, sniff))
    return Table(fields, class_names(features, f.url))


Classes = tuple[str, tuple[str, ...]] | None  # (the first file naming classes, its names)


def same_classes(seen: Classes, table: Table, f: InputFile, src: str) -> Classes:
    """The classes of the files so far, checked against ``table``'s: files of one source that
    name classes (ClassLabel) must name the same ones, or a label would mean two things."""
    if not table.classes:
        return seen
    if seen is None:
        return (f.rel, table.classes)
    if seen[1] != table.classes:
        raise UsageError(
            f"{src}: {f.rel!r} names classes {list(table.classes)[:5]} (ClassLabel) but "
            f"{seen[0]!r} names {list(seen[1])[:5]}; make the ClassLabel names agree"
        )
    return seen


def _sniffed(f: InputFile, kind: str, store: Store, names: list[str]) -> dict[str, FieldInfo]:
    """The codec of each byte column in ``names``, from its first value (bytes or path)."""
    import pyarrow as pa

    first: dict[str, tuple[bytes | None, str | None]] = {}
    try:
        for batch in batches(open_table(f, kind, store), names, 64):
            for name in names:
                if name in first:
                    continue
                for value in batch.column(name).to_pylist():
                    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
                        first[name] = (value.get("bytes"), value.get("path"))
                        break
                    if isinstance(value, bytes):
                        first[name] = (value, None)
                        break
            if len(first) == len(names):
                break
    except (OSError, pa.ArrowInvalid, StorageError) as err:
        raise InputError(f"{f.url}: cannot read the table ({err})") from err
    return {name: FieldInfo(codec_of(*first.get(name, (None, None)))) for name in names}


def _path_reader(store: Store) -> ReadPath:
    """Reads the file a ``{bytes: null, path}`` cell names (``to_parquet`` of images loaded from
    files writes that), only inside the table's own folder: a relative path without ``..``, or
    a local table's absolute path below its folder.  A table could name any file on the
    machine (a key, a password file), which packing would copy into shards."""
    folder = store.url.rsplit("/", 1)[0]

    def read(path: str) -> bytes:
        if "://" in path or "\\" in path or "\0" in path or ".." in path.split("/"):
            raise InputError("a path pack does not follow")
        if store.is_local:
            base = os.path.realpath(Store(folder).local_path)
            real = os.path.realpath(os.path.join(base, path))  # an absolute path stays as is
            if os.path.commonpath([base, real]) != base:
                raise InputError(f"outside the table's folder {base}, which pack does not read")
            with open(real, "rb") as fh:
                return fh.read()
        if os.path.isabs(path):
            raise InputError(f"a local path in a table at {store.url}")
        return Store(join(folder, path), store.options, store.retry).read_bytes()

    return read


def samples(
    f: InputFile,
    kind: str,
    stem: str,
    store: Store,
    on_skip: OnSkip | None = None,
    leave_out: str | None = None,
) -> Iterator[SampleRef]:
    """One sample per row.  A cell pack cannot keep (a null inside an array, a nanosecond) is
    an InputError naming file, row, column and type; with ``on_skip`` (``--on-error skip``) its
    row is skipped and reported so instead, and the other rows are packed.  Column
    ``leave_out`` is neither read nor encoded (``--token-field`` reads its ids apart)."""
    table = open_table(f, kind, store)
    schema = schema_of(table, kind)
    plans = _plans(f, schema, _features(f, schema, store))
    plans.pop(leave_out or "", None)
    read = _path_reader(store)

    def reason(name: str, err: _CellError) -> str:
        return f"column {name!r} ({schema.field(name).type}): {err.reason}"

    def rows(batch: Any, first: int) -> Iterator[tuple[int, tuple[tuple[str, bytes], ...]]]:
        """``(row, fields)`` of each row of ``batch`` (``first``: the row of its first) that
        every column can keep; the rows around a bad cell are encoded again without it (a
        prefix can fail only in a later column: the depth stays below the column count)."""
        start = 0
        while start < batch.num_rows:
            part = batch.slice(start) if start else batch
            columns = []
            for name, p in plans.items():
                try:
                    columns.append((name, p.encode(part.column(name), read)))
                except _CellError as err:
                    at = first + start + err.row
                    if on_skip is None:
                        raise InputError(
                            f"{f.url} row {at}: {reason(name, err)}; or pass --on-error skip "
                            "to skip such rows"
                        ) from err
                    yield from rows(part.slice(0, err.row), first + start)
                    log.warning("%s row %d: %s; skipping the row", f.url, at, reason(name, err))
                    on_skip(f.rel, f"row {at}", reason(name, err))
                    start += err.row + 1
                    break
            else:
                for i in range(part.num_rows):
                    cells = tuple((n, c[i]) for n, c in columns if c[i] is not None)
                    yield first + start + i, cells  # type: ignore[misc]
                return

    row = 0
    for batch in batches(table, None if leave_out is None else list(plans)):
        for at, cells in rows(batch, row):
            yield SampleRef(f"{stem}/{at:09d}", cells, f.rel, f"row {at}")  # type: ignore[arg-type]
        row += batch.num_rows
