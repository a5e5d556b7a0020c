"""``records``: every file is a line file or a table, read here into one sample per record.

Line files (``.jsonl``, ``.txt``, optionally ``.gz``/``.zst``) give one sample per non-empty line
(:mod:`.lines`), tables (``.parquet``, Arrow IPC ``.arrow``/``.feather``/``.ipc``) one per row
(:mod:`.tables`); one source may hold both, so this is one layout that dispatches on each
file's suffix.  A record file is known by its last extension (after ``.gz``/``.zst``), whatever
dots come before it: ``train.00.jsonl``, ``part.0.parquet``, ``gir1.2-glib-2.0.txt``.  Keys
follow webdataset's rule (no dot in the key's basename): ``docs/part-0.jsonl.gz`` line 123 is
``docs/part-0/000000123``, row 7 of ``train.00.parquet`` is ``train.00/000000007``.

A ``.txt``/``.jsonl`` that shares its key with a file that is not a record file (a caption
next to its image) is a field of a key group, not a record file.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import numpy as np

import shardloader.pack.layouts.lines as lines
import shardloader.pack.layouts.tables as tables
import shardloader.pack.token_ids as token_ids
from shardloader.errors import StorageError, UsageError, located
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import (
    NO_FIT,
    Description,
    Inputs,
    Layout,
    OnSkip,
    Source,
    Verdict,
    each_file,
    mixed,
)
from shardloader.pack.refs import InputFile, LineRun, SampleRef
from shardloader.pack.token_ids import IdsRule
from shardloader.storage.store import Store

__all__ = ["Records", "TokenRecords", "record_kind"]


def record_kind(rel: str) -> tuple[str, str] | None:
    """``(kind, stem)`` of a record file: kind ``json``/``txt``/``parquet``/``arrow``."""
    base = rel.rsplit("/", 1)[-1].lower()
    trimmed = rel
    suffixes: dict[str, str] = {**lines.SUFFIXES, **tables.SUFFIXES}
    for comp in lines.COMPRESSED:
        if base.endswith(comp):
            base, trimmed, suffixes = base[: -len(comp)], rel[: -len(comp)], lines.SUFFIXES
            break
    for suffix, kind in suffixes.items():
        if base.endswith(suffix) and len(base) > len(suffix):
            return kind, trimmed[: -len(suffix)]
    return None


def _is_line_kind(kind: str) -> bool:
    return kind in lines.SUFFIXES.values()


class Records(Layout):
    name = "records"

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Record files, known by their last extension (after ``.gz``/``.zst``) whatever dots
        come before it (``train.00.jsonl``, ``part.0.parquet``); one that shares its
        webdataset key with a file that is not a record file (``0001.txt`` beside
        ``0001.jpg``: a caption) is a field of a key group instead."""
        from shardloader.format.tar.format import split_key

        others = {
            parts[0]
            for f in files
            if not record_kind(f.rel) and (parts := split_key(f.rel)) is not None
        }

        def is_record(f: InputFile) -> bool:
            parts = split_key(f.rel)
            return bool(record_kind(f.rel)) and (parts is None or parts[0] not in others)

        records = [f for f in files if is_record(f)]
        if not records:
            return NO_FIT
        if len(records) == len(files):
            kinds = sorted({record_kind(f.rel)[0] for f in records})  # type: ignore[index]
            return Verdict(
                True,
                reading=f"one sample per line or row of {len(records):,} record files "
                f"({', '.join(kinds)})",
            )
        other = next(f for f in files if not is_record(f))
        return mixed("record files", records[0].rel, other.rel)

    def describe(self, inputs: Inputs) -> Description:
        """``json``/``txt`` for line files, one field per column for tables."""
        fields: dict[str, FieldInfo] = {}
        stems: dict[str, str] = {}
        classes: tables.Classes = None
        for f in inputs.files:
            kind_stem = record_kind(f.rel)
            if kind_stem is None:
                raise UsageError(
                    f"{inputs.url}: {f.rel!r} is not a record file (.jsonl, .txt, optionally "
                    ".gz/.zst; .parquet, .arrow); pass --layout key-groups to pack files as they "
                    "are"
                )
            kind, stem = kind_stem
            if stem in stems:
                raise UsageError(
                    f"{inputs.url}: {stems[stem]!r} and {f.rel!r} both give sample keys "
                    f"{stem + '/...'!r}; rename one of them"
                )
            stems[stem] = f.rel
            if _is_line_kind(kind):
                for name, codec in lines.fields(kind).items():
                    fields.setdefault(name, codec)
                continue
            table = tables.describe(f, kind, inputs.open(f))
            classes = tables.same_classes(classes, table, f, inputs.url)
            for name, codec in table.fields.items():
                known = fields.setdefault(name, codec)
                if known != codec:
                    raise UsageError(
                        f"{inputs.url}: column {name!r} of {f.rel!r} decodes as {codec.codec!r} "
                        f"but as {known.codec!r} in an earlier file; make the column types agree"
                    )
        return Description(fields, classes[1] if classes else ())

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef | LineRun]:
        """File after file; a file that fails mid-way fails the pack or, with ``on_skip``, has
        the rest of it skipped.  Plain line files give :class:`LineRun` s (NOTE [line runs] in
        :mod:`.lines`), everything else one :class:`SampleRef` per record."""
        import pyarrow as pa
        import zstandard

        def items(f: InputFile) -> Iterator[SampleRef | LineRun]:
            kind, stem = record_kind(f.rel)  # type: ignore[misc]
            return self._file_items(f, kind, stem, source.inputs.open(f), on_skip)

        errors = (OSError, EOFError, zstandard.ZstdError, pa.ArrowInvalid, StorageError)
        return each_file(source, on_skip, errors, items)

    def _file_items(
        self, f: InputFile, kind: str, stem: str, store: Store, on_skip: OnSkip | None
    ) -> Iterator[SampleRef | LineRun]:
        """The records of one file: runs of a plain line file, samples of anything else; a
        table row with a cell pack cannot keep is skipped and reported through ``on_skip``."""
        if _is_line_kind(kind) and not lines.is_compressed(f.rel):
            return lines.runs(f, kind, stem, store)
        if _is_line_kind(kind):
            return lines.samples(f, kind, stem, store)
        return tables.samples(f, kind, stem, store, on_skip)


class TokenRecords(Records):
    """Records whose token ids become the ``tokens`` field (``--token-field``, see
    pack/token_ids.py): JSON records keep their other keys in ``json``, table rows their
    other columns; made by pack/tokenizer.py once the ids are scanned."""

    def __init__(self, rule: IdsRule) -> None:
        self.rule = rule

    def _file_items(
        self, f: InputFile, kind: str, stem: str, store: Store, on_skip: OnSkip | None
    ) -> Iterator[SampleRef | LineRun]:
        if kind == "json":
            return (self._json_sample(f, s) for s in lines.samples(f, kind, stem, store))
        return self._table_samples(f, kind, stem, store, on_skip)

    def _tokens(self, ids: np.ndarray | None) -> bytes:
        token_ids.check_ids(ids, self.rule.vocab_size, self.rule.field)
        if ids is None:
            return b""
        return ids.astype(np.dtype(self.rule.dtype).newbyteorder("<")).tobytes()

    def _json_sample(self, f: InputFile, sample: SampleRef) -> SampleRef:
        line = sample.fields[0][1]
        with located(f"{f.url} {sample.where}"):
            ids, rest = token_ids.json_ids(line, self.rule.field)  # type: ignore[arg-type]
            fields: tuple[tuple[str, bytes], ...] = (("tokens", self._tokens(ids)),)
        if self.rule.keep_json:
            fields = (("json", token_ids.json_rest(rest or {})), *fields)
        return sample._replace(fields=fields)

    def _table_samples(
        self, f: InputFile, kind: str, stem: str, store: Store, on_skip: OnSkip | None
    ) -> Iterator[SampleRef]:
        name = self.rule.field
        rows = enumerate(self._row_ids(f, kind, store))
        for sample in tables.samples(f, kind, stem, store, on_skip, leave_out=name):
            row = int(sample.key.rsplit("/", 1)[1])  # rows skipped before it: passed over
            ids = next(ids for at, ids in rows if at == row)
            with located(f"{f.url} {sample.where}"):
                fields = [*sample.fields, ("tokens", self._tokens(ids))]
            yield sample._replace(fields=tuple(sorted(fields, key=lambda nv: nv[0])))

    def _row_ids(self, f: InputFile, kind: str, store: Store) -> Iterator[np.ndarray | None]:
        """Each row's ids (None: null, or no such column in this file), then None forever."""
        for column in token_ids.table_ids(f, kind, store, self.rule.field):
            with located(f.url):
                ids, offsets, nulls = token_ids.batch_rows(column)
            for i in range(len(offsets) - 1):
                yield None if nulls[i] else ids[offsets[i] : offsets[i + 1]]
        yield from itertools.repeat(None)
