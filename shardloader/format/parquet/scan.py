"""Index a Parquet file in place: what ``shardloader index`` asks the Parquet format.

The file is read once, row group by row group: every row becomes a sample keyed
``<file name without .parquet>/<row:09d>``, its sidecar entry the row number (offset), the
bytes of its cells as pack would store them (size) and the XXH3-64 of its key and cells
(:func:`~shardloader.format.arrow.writer.row_checksum`, as Arrow shards record it), which the
reader checks, and per column the same checksum of the key and that column's cell alone (of the
key only for a null), which a read of some columns checks (NOTE [projected checksums] in
reader.py).  The fields' codecs come from the column types and the Hugging Face features
(pack's conversion), the classes from a ``ClassLabel`` feature.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from shardloader.codecs.sniff import codec_of
from shardloader.codecs.tableschema import class_names, hf_features
from shardloader.format.arrow.writer import row_checksum
from shardloader.format.base import ScannedShard
from shardloader.format.compress import check_size, stage_stream
from shardloader.format.parquet.table import ParquetTable, open_parquet
from shardloader.manifest import FieldInfo, SampleIndex
from shardloader.storage.store import Store

__all__ = ["ParquetScan", "scan_parquet"]

_REMEDY = "pass a larger --max-member-size if cells this large are real"


@dataclass(frozen=True)
class ParquetScan(ScannedShard):
    """A scan plus what a Parquet file says about its fields: codecs, classes, row groups."""

    infos: dict[str, FieldInfo] = field(default_factory=dict)
    classes: tuple[str, ...] = ()
    row_groups: list[list[int]] = field(default_factory=list)  # [first byte, bytes, rows]


def scan_parquet(src: BinaryIO, url: str, max_member: int | None) -> ParquetScan:
    """Index the stored Parquet file ``src`` at ``url``.  A remote file is spooled to a
    temporary file as it streams (Parquet is read from its footer); a local one is opened where
    it is, and ``src`` is left for the caller to hash to its end."""
    with contextlib.ExitStack() as stack:
        if Store(url).is_local:
            tmp: Any = stack.enter_context(open(Store(url).local_path, "rb"))
        else:
            tmp = stack.enter_context(tempfile.TemporaryFile(prefix="shardloader-index-"))
            stage_stream(src, tmp, "none")  # Parquet is read from its end
            tmp.seek(0)
        pf = open_parquet(tmp)
        features = hf_features(pf.schema_arrow)
        classes = class_names(features, url)  # a damaged ClassLabel fails before any row
        table = ParquetTable(pf, url, features)
        keys: list[str] = []
        sizes: list[int] = []
        sums: list[int] = []
        per_field: dict[str, list[int]] = {n: [] for n in table.names}
        present = dict.fromkeys(table.names, 0)
        first: dict[str, bytes] = {}
        for row, (key, fields) in enumerate(table.samples()):
            for name, value in fields.items():
                present[name] += 1
                check_size(f"row {row}: column {name!r}", len(value), max_member, _REMEDY)
                first.setdefault(name, value)
            keys.append(key)
            sizes.append(sum(map(len, fields.values())))
            sums.append(row_checksum(key, fields))
            for name, column_sums in per_field.items():
                cell = {name: fields[name]} if name in fields else {}
                column_sums.append(row_checksum(key, cell))
        infos = {
            name: FieldInfo(codec_of(first.get(name), None)) if p.sniff else p.info
            for name, p in table.plans.items()
        }
        index = SampleIndex(
            keys,
            np.arange(len(keys), dtype=np.int64),
            np.asarray(sizes, np.int64),
            checksums=np.asarray(sums, np.uint64),
            field_checksums={n: np.asarray(c, np.uint64) for n, c in per_field.items()},
        )
        size = tmp.seek(0, 2)
        ranges = table.byte_ranges()
    return ParquetScan(
        index,
        present,
        size,
        infos=infos,
        classes=classes,
        row_groups=ranges,
    )
