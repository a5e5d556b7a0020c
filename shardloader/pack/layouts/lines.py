"""Line files for the ``records`` layout: ``.jsonl`` and ``.txt``, optionally ``.gz``/``.zst``.

One sample per non-empty line, key ``<path without suffixes>/<line number:09d>`` (1-based, so a
key says where the line is); the line becomes the field ``json`` or ``txt``.  Lines are split
here, in the main process: that is cheap next to compressing them.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from typing import BinaryIO

from shardloader.manifest import FieldInfo
from shardloader.pack.refs import InputFile, SampleRef
from shardloader.storage.store import Store

__all__ = ["SUFFIXES", "COMPRESSED", "fields", "samples"]

SUFFIXES = {".jsonl": "json", ".txt": "txt"}  # suffix → kind (= field name)
COMPRESSED = (".gz", ".zst", ".zstd")
_READ_CHUNK = 4 << 20


def fields(kind: str) -> dict[str, FieldInfo]:
    return {kind: FieldInfo("json" if kind == "json" else "text")}


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


def samples(f: InputFile, kind: str, stem: str, store: Store) -> Iterator[SampleRef]:
    """The samples of line file ``f``, read through ``store`` (the file's own)."""
    with store.open_read() as raw:
        stream = _decompressed(raw, f.rel)
        number = 0
        for number, line in enumerate(_iter_lines(stream), start=1):  # noqa: B007
            if not line or (kind == "json" and not line.strip()):
                continue  # blank lines separate nothing in JSONL and carry nothing in text
            yield SampleRef(f"{stem}/{number:09d}", ((kind, line),), f.rel, f"line {number}")
