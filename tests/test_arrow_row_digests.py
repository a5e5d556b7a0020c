"""The Arrow reader checks each row against the sidecar's ``row_checksum`` by C-level maps
(``ArrowShardReader._digests``): rows with nulls, field names holding ``%``, non-ASCII keys
and a damaged value must give exactly what ``row_checksum`` gives, row by row."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardloader.errors import ChecksumError
from shardloader.format.arrow.reader import ArrowShardReader
from shardloader.format.arrow.writer import ArrowShardWriter
from shardloader.format.base import Rows
from shardloader.manifest import FieldInfo


def _rows(n: int) -> list[tuple[str, dict[str, bytes]]]:
    out = []
    for i in range(n):
        fields = {"a%d": b"x" * (i * 7 % 50), "txt": f"row {i}".encode()}
        if i % 3 == 1:
            del fields["txt"]  # a null in the column
        out.append((f"k/é{i:03d}", fields))
    return out


def _write(tmp_path: Path, rows: list[tuple[str, dict[str, bytes]]]) -> tuple[str, object]:
    path = tmp_path / "shard.arrow"
    with open(path, "wb") as f:
        writer = ArrowShardWriter(f, "none", {"a%d": FieldInfo("bytes"), "txt": FieldInfo("bytes")})
        for key, fields in rows:
            writer.add(key, fields)
        written = writer.close()
    return str(path), written.index


@pytest.mark.parametrize("nulls", [True, False])
def test_rows_read_whole_with_and_without_nulls(tmp_path: Path, nulls: bool) -> None:
    rows = _rows(24)
    if not nulls:
        rows = [(k, {**f, "txt": f.get("txt", b"")}) for k, f in rows]
    path, index = _write(tmp_path, rows)
    reader = ArrowShardReader(path, index)  # type: ignore[arg-type]
    try:
        picked = [5, 0, 23, 7, 7, 12]
        into = Rows(len(picked))
        reader.read_rows(picked, into, list(range(len(picked))))
        assert not into.errors
        assert into.keys == [rows[i][0] for i in picked]
        for name in ("a%d", "txt"):
            assert into.fields[name] == [rows[i][1].get(name) for i in picked]
    finally:
        reader.close()


@pytest.mark.parametrize("nulls", [True, False])
def test_a_damaged_value_fails_its_row_only(tmp_path: Path, nulls: bool) -> None:
    rows = _rows(12)
    if not nulls:
        rows = [(k, {**f, "txt": f.get("txt", b"")}) for k, f in rows]
    path, index = _write(tmp_path, rows)
    data = bytearray(Path(path).read_bytes())
    at = data.find(b"row 5")
    assert at > 0
    data[at + 4] ^= 1  # "row 5" -> "row 4": same size, another value
    Path(path).write_bytes(bytes(data))
    reader = ArrowShardReader(path, index)  # type: ignore[arg-type]
    try:
        into = Rows(3)
        reader.read_rows([3, 5, 6], into, [0, 1, 2])
        assert list(into.errors) == [1] and isinstance(into.errors[1], ChecksumError)
        assert repr(rows[5][0]) in str(into.errors[1])
        assert into.fields["txt"][0] == rows[3][1].get("txt")
    finally:
        reader.close()
