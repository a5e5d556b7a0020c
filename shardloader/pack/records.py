"""Record inputs: line files (``.jsonl``, ``.txt``, optionally ``.gz``/``.zst``) and tables
(Parquet, Arrow IPC), read in the main process into one sample per record.

Keys follow webdataset's rule (no dot in the key's basename): ``docs/part-0.jsonl.gz`` line 123
is ``docs/part-0/000000123`` (1-based line numbers; blank lines give no sample), row 7 of
``t.parquet`` is ``t/000000007`` (0-based).  Table columns become one field each: binary as is,
strings as UTF-8, integers/booleans as ASCII digits, anything else as JSON; nulls are left out.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, BinaryIO

from shardloader.codecs import codec_for_extension
from shardloader.errors import InputError, StorageError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.refs import InputFile, SampleRef
from shardloader.storage import open_read

__all__ = ["OnSkip", "record_kind", "record_fields", "record_samples"]

log = logging.getLogger(__name__)

Options = Mapping[str, Any] | None
OnSkip = Callable[[str, str, str], None]  # (file, where, reason)

_LINE_SUFFIXES = {".jsonl": "json", ".txt": "txt"}
_TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow"}
_COMPRESSED = (".gz", ".zst", ".zstd")
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
_READ_CHUNK = 4 << 20


def record_kind(rel: str) -> tuple[str, str] | None:
    """``(kind, stem)`` of a record file: kind ``json``/``txt``/``parquet``/``arrow``."""
    base = rel.rsplit("/", 1)[-1].lower()
    trimmed = rel
    suffixes: dict[str, str] = {**_LINE_SUFFIXES, **_TABLE_SUFFIXES}
    for comp in _COMPRESSED:
        if base.endswith(comp):
            base, trimmed, suffixes = base[: -len(comp)], rel[: -len(comp)], _LINE_SUFFIXES
            break
    for suffix, kind in suffixes.items():
        if base.endswith(suffix) and len(base) > len(suffix):
            return kind, trimmed[: -len(suffix)]
    return None


def record_fields(
    src: str, files: list[InputFile], storage_options: Mapping[str, Any] | None
) -> dict[str, FieldInfo]:
    """Fields of record files: ``json``/``txt`` for lines, one per column for tables."""
    fields: dict[str, FieldInfo] = {}
    stems: dict[str, str] = {}
    for f in files:
        kind_stem = record_kind(f.rel)
        if kind_stem is None:
            raise UsageError(
                f"{src}: {f.rel!r} is not a record file (.jsonl, .txt, optionally .gz/.zst; "
                ".parquet, .arrow); pass --layout key-groups to pack files as they are"
            )
        kind, stem = kind_stem
        if stem in stems:
            raise UsageError(
                f"{src}: {stems[stem]!r} and {f.rel!r} both give sample keys {stem + '/...'!r}; "
                "rename one of them"
            )
        stems[stem] = f.rel
        if kind in ("json", "txt"):
            fields.setdefault(kind, FieldInfo("json" if kind == "json" else "text"))
            continue
        for name, codec in _table_fields(f, kind, storage_options).items():
            known = fields.setdefault(name, codec)
            if known != codec:
                raise UsageError(
                    f"{src}: column {name!r} of {f.rel!r} decodes as {codec.codec!r} but as "
                    f"{known.codec!r} in an earlier file; make the column types agree"
                )
    return fields


def _open_table(f: InputFile, kind: str, storage_options: Options) -> Any:
    """A Parquet file (streamed) or an Arrow IPC reader (file or stream format, read whole)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = open_read(f.url, storage_options)
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


def _table_batches(table: Any) -> Iterator[Any]:
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
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_fixed_size_binary(
        typ
    ):
        return FieldInfo(by_name)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return FieldInfo(by_name if by_name in ("text", "json") else "text")
    if pa.types.is_integer(typ) or pa.types.is_boolean(typ):
        return FieldInfo("int")
    return FieldInfo("json")


def _table_fields(
    f: InputFile, kind: str, storage_options: Mapping[str, Any] | None
) -> dict[str, FieldInfo]:
    import pyarrow as pa

    try:
        table = _open_table(f, kind, storage_options)
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


def _decompressed(stream: BinaryIO, rel: str) -> BinaryIO:
    lower = rel.lower()
    if lower.endswith(".gz"):
        return gzip.GzipFile(fileobj=stream, mode="rb")  # type: ignore[return-value]
    if lower.endswith((".zst", ".zstd")):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)  # type: ignore[return-value]
    return stream


def _iter_lines(stream: BinaryIO) -> Iterator[bytes]:
    """Lines without their terminator (``\\n`` or ``\\r\\n``), read in big chunks."""
    read = getattr(stream, "read1", stream.read)  # read1: keep what decoded before an error
    rest = b""
    while True:
        chunk = read(_READ_CHUNK)
        if not chunk:
            break
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line[:-1] if line.endswith(b"\r") else line
    if rest:
        yield rest[:-1] if rest.endswith(b"\r") else rest


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


def _line_samples(f: InputFile, kind: str, stem: str, so: Options) -> Iterator[SampleRef]:
    with open_read(f.url, so) as raw:
        stream = _decompressed(raw, f.rel)
        number = 0
        for number, line in enumerate(_iter_lines(stream), start=1):  # noqa: B007
            if not line or (kind == "json" and not line.strip()):
                continue  # blank lines separate nothing in JSONL and carry nothing in text
            yield SampleRef(f"{stem}/{number:09d}", ((kind, line),), f.rel, f"line {number}")


def _table_samples(f: InputFile, kind: str, stem: str, so: Options) -> Iterator[SampleRef]:
    row = 0
    for batch in _table_batches(_open_table(f, kind, so)):
        for record in batch.to_pylist():
            fields = []
            for name in sorted(record):
                data = _encode_value(record[name])
                if data is not None:
                    fields.append((name, data))
            yield SampleRef(f"{stem}/{row:09d}", tuple(fields), f.rel, f"row {row}")
            row += 1


def record_samples(
    files: Iterable[InputFile], so: Options, on_skip: OnSkip | None
) -> Iterator[SampleRef]:
    """One sample per non-empty line / per row, file after file (see the module docstring)."""
    import pyarrow as pa
    import zstandard

    for f in files:
        kind, stem = record_kind(f.rel)  # type: ignore[misc]
        read = _line_samples if kind in ("json", "txt") else _table_samples
        gen = read(f, kind, stem, so)
        last = ""
        try:
            for sample in gen:
                last = sample.where
                yield sample
        except (OSError, EOFError, zstandard.ZstdError, pa.ArrowInvalid, StorageError) as err:
            after = f" after {last}" if last else ""
            reason = f"cannot read{after} ({err})"
            if on_skip is None:
                raise InputError(f"{f.url}: {reason}; fix or remove the file, or pass "
                                 "--on-error skip") from err
            log.warning("%s: %s; skipping the rest of the file", f.url, reason)
            on_skip(f.rel, last, reason)
