"""``--token-field``: token ids the input already holds, laid out as the ``tokens`` field.

Why a module of its own: a pre-tokenized corpus (``datasets.Dataset.map(tokenize)`` written with
``to_parquet``, Megatron or OLMo JSONL dumps) holds its ids as an integer-list column or a JSON
key, and needs no tokenizer, only a check and a dtype.  The dtype must be fixed before the
first shard is written, so every record file is scanned once here, in the main process: each
record's ids are checked (integers, ``0 <= id < --vocab-size``), records without them are
counted (``pack/field_check.py`` words the error or warning), and the largest id gives the
vocabulary size when ``--vocab-size`` is not given.  The records layout then reads the ids a
second time, record by record (``TokenRecords`` in ``pack/layouts/records.py``).

A table's list column is read here with pyarrow, apart from the other columns (which
``pack/layouts/tables.py`` encodes as it encodes any column): ids go from Arrow buffers to
the shard's dtype without a Python list.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from shardloader.errors import InputError, StorageError, UsageError, located
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.tables import batches, open_table, schema_of
from shardloader.pack.refs import InputFile, TextRule
from shardloader.storage.store import Store

__all__ = [
    "FileCount",
    "table_columns",
    "IdsRule",
    "check_ids",
    "ids_dtype",
    "ids_length",
    "json_ids",
    "scan_ids",
    "table_ids",
]

MAX_VOCAB = 1 << 32  # uint32 ids
JSON_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_IDS = msgspec.json.Decoder(list[int])
_ENCODE = msgspec.json.Encoder()
_BATCH = 4096  # table rows read at a time


@dataclass(frozen=True)
class IdsRule:
    """Where a record's ids are (``field``: a column or JSON key) and how they are stored."""

    field: str
    dtype: str  # uint16 or uint32
    vocab_size: int
    keep_json: bool  # JSON records keep their other keys in the ``json`` field

    def text_rule(self) -> TextRule:
        """The text rule the rest of the pack sees: lengths in ``tokens``, no text to find
        (a candidate kind no sample has; :func:`ids_length` measures instead)."""
        return TextRule((("ids", self.field),), "tokens")


@dataclass
class FileCount:
    """How many records of one file have a field (for ``pack/field_check.py``)."""

    rel: str
    url: str = ""  # the file, as messages name it
    records: int = 0
    missing: int = 0
    fields: set[str] = field(default_factory=set)  # field names the records have (a few)
    hi: int = -1  # largest id seen

    def saw(self, names: Any) -> None:
        if len(self.fields) < 64:
            self.fields.update(names)


def ids_dtype(vocab_size: int) -> str:
    """uint16 when every id fits (as ``--tokenizer`` chooses), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def ids_length(
    text: TextRule | None, fields: Mapping[str, FieldInfo], values: Mapping
) -> int | None:
    """A pre-tokenized sample's length: its ids, counted (None: not a pre-tokenized pack)."""
    if text is None or not text.candidates or text.candidates[0][0] != "ids":
        return None
    data = values.get("tokens", b"")
    return len(data) // np.dtype(fields["tokens"].dtype or "uint32").itemsize


def check_ids(ids: np.ndarray | None, vocab_size: int | None, name: str) -> None:
    """InputError unless every id is ``0 <= id < vocab_size`` (the caller names the record:
    :func:`~shardloader.errors.located`)."""
    if ids is None or not ids.size:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise InputError(f"{name!r} holds the negative token id {lo}; token ids count from 0")
    limit = MAX_VOCAB if vocab_size is None else vocab_size
    if hi >= limit:
        what = f"--vocab-size {vocab_size}" if vocab_size is not None else "2**32 (uint32)"
        raise InputError(
            f"{name!r} holds token id {hi}, not below {what}; pass the tokenizer's "
            "vocabulary size as --vocab-size (or fix the ids)"
        )


def json_ids(line: bytes, name: str) -> tuple[np.ndarray | None, dict | None]:
    """The ids under key ``name`` of JSON record ``line`` (None: key absent or null) and the
    record's other keys (raw JSON values, for the ``json`` field)."""
    try:
        record = JSON_OBJECT.decode(line)
    except msgspec.ValidationError as err:
        raise InputError(f"not a JSON object ({err})") from err
    except msgspec.DecodeError as err:
        raise InputError(f"invalid JSON ({err})") from err
    raw = record.pop(name, None)
    if raw is None or bytes(raw).strip() == b"null":
        return None, record
    try:
        ids = np.array(_IDS.decode(raw), np.int64)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise InputError(f"{name!r} is not a list of integer token ids ({err})") from err
    except OverflowError as err:
        raise InputError(f"{name!r} holds a token id past int64 ({err})") from err
    return ids, record


def json_rest(record: dict) -> bytes:
    """A record's other keys as compact JSON (their values byte for byte as in the input)."""
    return _ENCODE.encode(record)


def table_ids(f: InputFile, kind: str, store: Store, name: str) -> Iterator[Any]:
    """Column ``name`` of table file ``f``, batch by batch (pyarrow list arrays); nothing at
    all when the file has no such column.  A column that is not a list of integers is a
    :class:`UsageError` naming it and its Arrow type."""
    import pyarrow as pa

    table = open_table(f, kind, store)
    try:
        schema = schema_of(table, kind)
        if name not in schema.names:
            return
        typ = schema.field(name).type
        is_list = pa.types.is_list(typ) or pa.types.is_large_list(typ)
        if not (is_list or pa.types.is_fixed_size_list(typ)) or not pa.types.is_integer(
            typ.value_type
        ):
            raise UsageError(
                f"{f.url}: --token-field {name!r} is a column of Arrow type {typ}, not a list "
                "of integer token ids; name the column that holds the ids"
            )
        for batch in batches(table, [name], _BATCH):
            yield batch.column(name)
    finally:
        if kind == "parquet":
            table.close(force=True)


def batch_rows(column: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids as int64, offsets of each row's ids, null rows) of one batch of a list column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_fixed_size_list(column.type):
        column = column.cast(pa.list_(column.type.value_type))
    nulls = column.is_null().to_numpy(zero_copy_only=False)
    values = pc.list_flatten(column)  # the ids of every row, nulls and slicing taken care of
    if values.null_count:
        parent = pc.list_parent_indices(column).to_numpy()
        row = int(parent[np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False))[0]])
        raise InputError(f"row {row} of the batch: a token id is null")
    ids = values.to_numpy().astype(np.int64, copy=False)
    lengths = pc.fill_null(pc.list_value_length(column), 0).to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return ids, offsets, nulls


def scan_ids(f: InputFile, kind: str, store: Store, name: str, vocab_size: int | None) -> FileCount:
    """Check every record's ids in record file ``f`` and count those without any."""
    import pyarrow as pa

    import shardloader.pack.layouts.lines as lines

    count = FileCount(f.rel, f.url)
    try:
        if kind == "json":
            for sample in lines.samples(f, kind, "", store):
                with located(f"{f.url} {sample.where}"):
                    ids, rest = json_ids(sample.fields[0][1], name)  # type: ignore[arg-type]
                    check_ids(ids, vocab_size, name)
                count.records += 1
                count.saw(rest or ())
                if ids is None:
                    count.missing += 1
                elif ids.size:
                    count.hi = max(count.hi, int(ids.max()))
            return count
        if kind == "txt":
            raise UsageError(
                f"{f.url}: --token-field reads token ids from JSONL or Parquet/Arrow records; "
                "a .txt file holds text: tokenize it with --tokenizer, or leave it out"
            )
        row = 0
        found = False
        for column in table_ids(f, kind, store, name):
            found = True
            with located(f.url):
                ids, offsets, nulls = batch_rows(column)
            if ids.size:
                bad = (ids < 0) | (ids >= (MAX_VOCAB if vocab_size is None else vocab_size))
                if bad.any():
                    at = int(np.searchsorted(offsets, np.flatnonzero(bad)[0], "right")) - 1
                    with located(f"{f.url} row {row + at}"):
                        check_ids(ids[offsets[at] : offsets[at + 1]], vocab_size, name)
                count.hi = max(count.hi, int(ids.max()))
            count.records += len(column)
            count.missing += int(nulls.sum())
            row += len(column)
        if not found:
            return table_columns(f, kind, store, ())
        count.saw([name])
    except (OSError, pa.ArrowInvalid, StorageError) as err:
        raise InputError(f"{f.url}: cannot read ({err}); fix or remove the file") from err
    return count


def table_columns(f: InputFile, kind: str, store: Store, columns: Sequence[str]) -> FileCount:
    """The rows of table file ``f``, and those where none of ``columns`` holds a value: only
    those columns are read."""
    import pyarrow as pa

    table = open_table(f, kind, store)
    count = FileCount(f.rel, f.url)
    try:
        names = list(schema_of(table, kind).names)
        count.saw(names)
        wanted = [c for c in columns if c in names]
        if not wanted:  # a Parquet file says; an Arrow one is counted
            rows = table.metadata.num_rows if kind == "parquet" else sum(map(len, batches(table)))
            count.records = count.missing = int(rows)
            return count
        for batch in batches(table, wanted, _BATCH * 4):
            valid = np.zeros(batch.num_rows, bool)
            for c in wanted:
                valid |= batch.column(c).is_valid().to_numpy(zero_copy_only=False)
            count.records += batch.num_rows
            count.missing += batch.num_rows - int(valid.sum())
        return count
    except pa.ArrowInvalid as err:
        raise InputError(f"{f.url}: cannot read ({err}); fix or remove the file") from err
    finally:
        if kind == "parquet":
            table.close(force=True)
