"""Line files for the ``records`` layout: ``.jsonl`` and ``.txt``, optionally ``.gz``/``.zst``.

One sample per non-empty line (JSON: not only whitespace), key ``<path without suffixes>/<line
number:09d>`` (1-based, so a key says where the line is); the line without its terminator
becomes the field ``json`` or ``txt``.  Lines are what Python's ``utf-8-sig`` and universal
newlines give: a UTF-8 byte order mark at the start of the file is not part of the first line,
and ``\n``, ``\r\n`` and a lone ``\r`` (classic Mac OS) each end a line.

NOTE [line runs]: a plain (uncompressed) line file is scanned here, in the main process, only
for where its lines are: :func:`runs` yields :class:`~shardloader.pack.refs.LineRun` s (line
numbers, offsets and lengths as arrays), from which the planner cuts shards exactly.  The pack
worker writing a shard reads each run's byte range itself and checks that the lines are still
where the scan found them (:func:`read_run`), so record bytes never travel from the main
process to a worker, a pickle each way.  Compressed files cannot be read by range: their lines
are split here and travel as :class:`~shardloader.pack.refs.SampleRef` s (:func:`samples`).

NOTE [lone CR]: runs are cut at ``\n`` only (a ``\r`` before it is dropped), which is all the
worker's check in :func:`read_run` knows.  A file with a lone ``\r`` (not before a ``\n``) is
split here instead, as a compressed file is: the scan looks for one in each chunk before it
cuts runs from it, and from there on gives the rest of the file as samples.  Lines before it
stay in runs: their line ends are ``\n`` whatever follows.
"""

from __future__ import annotations

import gzip
import itertools
import mmap
import os
import re
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import numpy as np

from shardloader.errors import InputError
from shardloader.manifest import FieldInfo
from shardloader.pack.refs import InputFile, LineRun, SampleRef
from shardloader.storage.store import Store

__all__ = [
    "SUFFIXES",
    "COMPRESSED",
    "fields",
    "is_compressed",
    "iter_lines",
    "samples",
    "runs",
    "read_run",
    "run_samples",
]

SUFFIXES = {".jsonl": "json", ".txt": "txt"}  # suffix → kind (= field name)
COMPRESSED = (".gz", ".zst", ".zstd")
_READ_CHUNK = 4 << 20
_SCAN_CHUNK = 16 << 20  # bytes scanned for line ends at a time (a run per chunk)
_WHITESPACE = np.zeros(256, bool)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.strip() strips
BOM = b"\xef\xbb\xbf"  # UTF-8 byte order mark: what the utf-8-sig codec drops at the start
_EOL = re.compile(rb"\r\n|\r|\n")  # universal newlines


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


def _split_lines(chunks: Iterable[bytes], bom: bool) -> Iterator[bytes]:
    """The lines of ``chunks`` (consecutive bytes) as universal newlines split them, without
    their terminators; ``bom``: the chunks start the file, so a UTF-8 BOM there is dropped."""
    rest = b""
    for chunk in chunks:
        buf = rest + chunk
        if bom:
            if len(buf) < len(BOM) and BOM.startswith(buf):
                rest = buf  # too short to tell yet
                continue
            bom = False
            if buf.startswith(BOM):
                buf = buf[len(BOM) :]
        hold = b""
        if buf.endswith(b"\r"):  # maybe the first half of a "\r\n" split across chunks
            buf, hold = buf[:-1], b"\r"
        lines = buf.split(b"\n") if b"\r" not in buf else _EOL.split(buf)
        rest = lines.pop() + hold
        yield from lines
    if bom and rest.startswith(BOM):  # a file of at most a BOM
        rest = rest[len(BOM) :]
    if rest:
        lines = _EOL.split(rest)
        if not lines[-1]:  # the file ends with a terminator
            lines.pop()
        yield from lines


def samples(f: InputFile, kind: str, stem: str, store: Store) -> Iterator[SampleRef]:
    """The samples of line file ``f``, read through ``store`` (the file's own)."""
    yield from _numbered(f, kind, stem, iter_lines(f, store), 0)


def iter_lines(f: InputFile, store: Store) -> Iterator[bytes]:
    """Every line of line file ``f`` (blank ones too) without its terminator, read in big
    chunks (a leading BOM dropped)."""
    with store.open_read() as raw:
        stream = _decompressed(raw, f.rel)
        read = getattr(stream, "read1", stream.read)  # read1: keep what decoded before an error
        yield from _split_lines(iter(lambda: read(_READ_CHUNK), b""), bom=True)


def _numbered(
    f: InputFile, kind: str, stem: str, lines: Iterable[bytes], before: int
) -> Iterator[SampleRef]:
    """Samples of ``lines``, numbered after the ``before`` lines that came first."""
    for number, line in enumerate(lines, start=before + 1):
        if not line or (kind == "json" and not line.strip()):
            continue  # blank lines separate nothing in JSONL and carry nothing in text
        yield SampleRef(f"{stem}/{number:09d}", ((kind, line),), f.rel, f"line {number}")


def is_compressed(rel: str) -> bool:
    return rel.lower().endswith(COMPRESSED)


def runs(f: InputFile, kind: str, stem: str, store: Store) -> Iterator[LineRun | SampleRef]:
    """Where the samples of plain line file ``f`` are (NOTE [line runs]), one run per chunk.

    The same lines as :func:`samples` would give, found without splitting them out: a local
    file is memory-mapped (no copy), a remote one streamed.  From a lone ``\r`` on, the
    samples themselves (NOTE [lone CR]).
    """
    if store.is_local:
        with open(store.local_path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size == 0:
                return
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                yield from _scan(f, kind, stem, [mm])
        return
    with store.open_read() as stream:
        read = getattr(stream, "read1", stream.read)
        yield from _scan(f, kind, stem, iter(lambda: read(_SCAN_CHUNK), b""))


def _lone_cr(chunk: bytes | mmap.mmap, start: int, after_cr: bool) -> bool:
    """Whether ``chunk[start:]`` holds a ``\r`` that ends a line by itself (not before a
    ``\n``); ``after_cr``: the previous chunk ended with ``\r``.  A ``\r`` that ends the
    chunk is left to the next one (``after_cr``); at the end of the file it ends a line
    either way."""
    if after_cr and chunk[start : start + 1] != b"\n":
        return True
    at = chunk.find(b"\r", start)
    while 0 <= at < len(chunk) - 1:
        stop = min(at + _SCAN_CHUNK, len(chunk) - 1)  # a window: no file-sized arrays
        view = np.frombuffer(chunk, np.uint8, count=stop + 1 - at, offset=at)
        try:
            cr = np.flatnonzero(view[:-1] == 13)
            if cr.size and bool((view[cr + 1] != 10).any()):
                return True
        finally:
            del view  # an mmap cannot close while an array still points into it
        at = chunk.find(b"\r", stop)
    return False


def _scan(
    f: InputFile, kind: str, stem: str, chunks: Iterable[bytes | mmap.mmap]
) -> Iterator[LineRun | SampleRef]:
    """Line runs over ``chunks`` (the file's bytes in order), at most ``_SCAN_CHUNK`` bytes
    of lines each; a line longer than that makes its own run.  A BOM at the start is skipped;
    from a chunk with a lone ``\r`` on, samples (NOTE [lone CR])."""
    pending: list[bytes] = []  # an unfinished line from the previous chunk, in pieces
    pos = 0  # file offset of the first pending byte
    number = 0  # lines completed so far
    first, after_cr = True, False
    chunks = iter(chunks)
    for chunk in chunks:
        start = 0
        if first:
            first = False
            if chunk[: len(BOM)] == BOM:
                start = pos = len(BOM)
        if _lone_cr(chunk, start, after_cr):
            rest = [b"".join(pending)] if pending else []
            more = (bytes(c) for c in chunks)
            here = (chunk[a : a + _READ_CHUNK] for a in range(start, len(chunk), _READ_CHUNK))
            lines = _split_lines(itertools.chain(rest, here, more), bom=False)
            yield from _numbered(f, kind, stem, lines, number)
            return
        after_cr = chunk[-1:] == b"\r"
        if pending:  # finish the pending line first (joins only that line, not the chunk)
            nl = chunk.find(b"\n")
            if nl < 0:
                pending.append(bytes(chunk))
                continue
            buf = b"".join([*pending, chunk[: nl + 1]])
            run = _run(f, kind, stem, buf, 0, pos, number, np.array([len(buf) - 1]))
            if run is not None:
                yield run
            number += 1
            pos += len(buf)
            pending, done = [], nl + 1
        else:
            done = start
        view = np.frombuffer(chunk, np.uint8)
        try:
            while done < len(chunk):
                stop = min(done + _SCAN_CHUNK, len(chunk))
                ends = _line_ends(chunk, done, stop)
                if not len(ends):
                    if stop < len(chunk):  # a line longer than a window: look further
                        stop = chunk.find(b"\n", stop)
                        if stop >= 0:
                            ends = np.array([stop], np.int64)
                    if not len(ends):
                        pending.append(bytes(chunk[done:]))
                        break
                run = _run(f, kind, stem, view, done, pos - done, number, ends)
                if run is not None:
                    yield run
                number += len(ends)
                pos += int(ends[-1]) + 1 - done
                done = int(ends[-1]) + 1
        finally:
            del view  # an mmap cannot close while an array still points into it
    if pending:  # a last line without a terminator
        buf = b"".join(pending)
        run = _run(f, kind, stem, buf, 0, pos, number, np.array([len(buf)], np.int64))
        if run is not None:
            yield run


def _line_ends(buf: bytes | mmap.mmap, start: int, stop: int) -> np.ndarray:
    """Offsets of every ``\n`` in ``buf[start:stop]`` (offsets into ``buf``): a ``find`` loop
    while lines are long (memchr, few steps), numpy once they turn out short (one Python step
    per line would cost more)."""
    out: list[int] = []
    find, i = buf.find, start - 1
    budget = (stop - start) // 256  # more lines than this: average under 256 bytes
    while len(out) < budget:
        i = find(b"\n", i + 1, stop)
        if i < 0:
            return np.array(out, np.int64)
        out.append(i)
    rest = np.frombuffer(buf, np.uint8, count=stop - (i + 1), offset=i + 1)
    more = np.flatnonzero(rest == 10) + (i + 1)
    del rest
    return np.concatenate([np.array(out, np.int64), more])


def _run(
    f: InputFile,
    kind: str,
    stem: str,
    buf: bytes | np.ndarray,
    first: int,
    base: int,
    number: int,
    ends: np.ndarray,
) -> LineRun | None:
    """The non-blank lines of ``buf`` from offset ``first`` to the line ends ``ends`` (offsets
    into ``buf``, which starts at file offset ``base``); ``number`` lines came before."""
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
    ends = ends.astype(np.int64)
    starts = np.empty_like(ends)
    starts[0] = first
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts
    cr = lengths > 0
    cr[cr] = arr[ends[cr] - 1] == 13  # "\r\n": the "\r" is not part of the line
    lengths -= cr
    keep = lengths > 0
    if kind == "json":  # a line of only whitespace is blank too
        maybe = np.flatnonzero(keep & _WHITESPACE[arr[np.minimum(starts, len(arr) - 1)]])
        for i in maybe:
            s = int(starts[i])
            keep[i] = bool(arr[s : s + int(lengths[i])].tobytes().strip())
    numbers = np.arange(number + 1, number + 1 + len(ends), dtype=np.int64)
    if not keep.any():
        return None
    return LineRun(
        f.url, f.rel, kind, stem, f.size, numbers[keep], starts[keep] + base, lengths[keep]
    )


def read_run(run: LineRun, store: Store) -> bytes:
    """The byte range of ``run`` (from its first line's start to its last line's end), checked
    against the scan: the file has its listed size and a line ends where each line should.

    A file changed since the scan is an :class:`InputError` naming it and the line.
    """
    first, end = run.span
    try:
        with open(store.local_path, "rb") if store.is_local else store.open_read() as fh:
            if store.is_local:
                size = os.fstat(fh.fileno()).st_size
            else:
                known = getattr(fh, "size", None)
                size = run.size if known is None else int(known)
            fh.seek(first)
            data = _read_all(fh, end - first)
    except OSError as err:
        raise InputError(f"{run.url}: cannot read lines {int(run.numbers[0])}.. ({err})") from err
    if size != run.size or len(data) != end - first:
        raise InputError(
            f"{run.url}: has {size} bytes but had {run.size} when the pack started; do not "
            "change the input while packing, then re-run"
        )
    arr = np.frombuffer(data, np.uint8)
    rel_ends = run.starts + run.lengths - first
    inner = rel_ends < len(data)  # the last line of a file may have no terminator
    after = arr[rel_ends[inner]]
    bad = np.flatnonzero((after != 10) & (after != 13))
    expected = int(run.numbers[-1] - run.numbers[0])  # line ends between first and last line
    if bad.size or data.count(b"\n") != expected:
        line = int(run.numbers[bad[0]]) if bad.size else int(run.numbers[0])
        raise InputError(
            f"{run.url}: line {line} is not where it was when the pack started; do not change "
            "the input while packing, then re-run"
        )
    return data


def run_samples(run: LineRun, data: bytes) -> Iterator[SampleRef]:
    """The run's samples as :func:`samples` gives them (``data``: from :func:`read_run`)."""
    first = int(run.starts[0])
    for n, s, k in zip(
        run.numbers.tolist(), run.starts.tolist(), run.lengths.tolist(), strict=True
    ):
        o = s - first
        yield SampleRef(f"{run.stem}/{n:09d}", ((run.kind, data[o : o + k]),), run.rel, f"line {n}")


def _read_all(fh: BinaryIO, n: int) -> bytes:
    parts = []
    while n > 0:
        got = fh.read(n)
        if not got:
            break
        parts.append(got)
        n -= len(got)
    return parts[0] if len(parts) == 1 else b"".join(parts)
