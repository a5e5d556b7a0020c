"""Plain line files travel as runs of byte ranges (NOTE [line runs] in pack/layouts/lines.py):
the scan finds exactly the lines the splitting path finds, the planner cuts runs exactly where
it cuts the same samples one by one, and a worker notices a file changed since the scan."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardloader.pack.layouts.lines as lines
from shardloader.errors import InputError
from shardloader.pack.plan import Planner
from shardloader.pack.refs import InputFile, LineRun, SampleRef
from shardloader.storage.store import Store

BOM = b"\xef\xbb\xbf"  # the UTF-8 byte order mark
LINE = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
    st.sampled_from([b"", b" ", b"\t \x0b", b"\r", b"{}", b'{"text": "a"}', b"x" * 700]),
)


def _bytes(parts: list[bytes], terminators: list[bytes], last: bool) -> bytes:
    body = b"".join(p + t for p, t in zip(parts, terminators, strict=False))
    return body if last else body.rstrip(b"\n")


def _expected(path: str, kind: str) -> list[tuple[str, bytes, str]]:
    f = InputFile("f.jsonl", path, os.path.getsize(path))
    return [(s.key, s.fields[0][1], s.where) for s in lines.samples(f, kind, "f", Store(path))]


def _from_runs(store: Store, path: str, kind: str) -> list[tuple[str, bytes, str]]:
    f = InputFile("f.jsonl", store.url, os.path.getsize(path))
    out = []
    for run in list(lines.runs(f, kind, "f", store)):  # memory:// files share one cursor
        if isinstance(run, SampleRef):  # after a lone CR (NOTE [lone CR])
            out.append((run.key, run.fields[0][1], run.where))
            continue
        for s in lines.run_samples(run, lines.read_run(run, store)):
            out.append((s.key, s.fields[0][1], s.where))
    return out


@settings(max_examples=120, deadline=None)
@given(
    parts=st.lists(LINE, max_size=60),
    crlf=st.lists(st.booleans(), max_size=60),
    last=st.booleans(),
    kind=st.sampled_from(["json", "txt"]),
    window=st.sampled_from([7, 64, 300, 16 << 20]),
    bom=st.booleans(),
)
def test_runs_find_the_lines_that_splitting_finds(
    tmp_path_factory, parts, crlf, last, kind, window, bom
):
    terms = [b"\r\n" if c else b"\n" for c in crlf] + [b"\n"] * len(parts)
    data = (BOM if bom else b"") + _bytes(parts, terms, last)
    path = str(tmp_path_factory.mktemp("lines") / "f.jsonl")
    with open(path, "wb") as fh:
        fh.write(data)
    expected = _expected(path, kind)
    memory = Store(f"memory://lines/{os.path.basename(os.path.dirname(path))}.jsonl")
    memory.write_bytes_atomic(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lines, "_SCAN_CHUNK", window)  # lines across windows and chunks
        try:
            assert _from_runs(Store(path), path, kind) == expected  # memory-mapped
            assert _from_runs(memory, path, kind) == expected  # streamed (a remote store)
        finally:
            memory.remove()


def _universal(data: bytes) -> list[bytes]:
    """The lines Python reads from ``data`` with the utf-8-sig codec and universal newlines
    (surrogateescape: any bytes), without their terminators."""
    import io

    text = io.TextIOWrapper(io.BytesIO(data), "utf-8-sig", "surrogateescape", newline=None)
    return [line.rstrip("\n").encode("utf-8", "surrogateescape") for line in text]


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize(
    "data",
    [
        BOM + b"first\nsecond\n",  # a BOM is not part of the first line
        b"one\rtwo\r\rfour\r",  # classic Mac OS: CR only
        BOM + b"one\r\ntwo\r\nthree",  # Windows, with a BOM
        b"a\nb\r\nc\rd",  # all three in one file
        BOM,  # nothing but a BOM
        b"x" * 20 + b"\ny\rz\r\n",  # a lone CR after the first window
    ],
)
def test_line_files_split_as_utf8_sig_and_universal_newlines(tmp_path, data, compressed):
    """Each non-empty line is one sample, keyed by its 1-based number, as Python reads it."""
    import gzip

    name = "f.txt.gz" if compressed else "f.txt"
    path = str(tmp_path / name)
    with open(path, "wb") as fh:
        fh.write(gzip.compress(data) if compressed else data)
    f = InputFile(name, path, os.path.getsize(path))
    want = [(f"f/{n:09d}", line) for n, line in enumerate(_universal(data), 1) if line]
    got = [(s.key, s.fields[0][1]) for s in lines.samples(f, "txt", "f", Store(path))]
    assert got == want
    if not compressed:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lines, "_SCAN_CHUNK", 16)  # the remote scan reads small chunks
            assert [(k, v) for k, v, _ in _from_runs(Store(path), path, "txt")] == want
            memory = Store(f"memory://lines/{tmp_path.name}.txt")
            memory.write_bytes_atomic(data)
            try:
                assert [(k, v) for k, v, _ in _from_runs(memory, path, "txt")] == want
            finally:
                memory.remove()


@pytest.mark.subprocess
def test_pack_of_a_bom_and_cr_text_file_gives_the_lines_python_reads(tmp_path):
    """End to end through the CLI: a Notepad-style BOM + CRLF .txt and a CR-only .txt."""
    import subprocess
    import sys

    from corpus import read_back

    src = tmp_path / "src"
    src.mkdir()
    files = {"win.txt": BOM + b"alpha\r\nbeta\r\n", "mac.txt": b"gamma\rdelta\r"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    done = subprocess.run(
        [sys.executable, "-m", "shardloader", "pack", str(src), str(tmp_path / "out"), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    _, samples = read_back(str(tmp_path / "out"))
    assert {k: f["txt"] for k, f in samples} == {
        "mac/000000001": b"gamma",
        "mac/000000002": b"delta",
        "win/000000001": b"alpha",
        "win/000000002": b"beta",
    }


def _runs(sizes: list[int]) -> list[LineRun]:
    """Runs over lines of the given sizes, split into runs of up to 5 lines."""
    starts = np.cumsum([0] + [s + 1 for s in sizes])[:-1]
    out = []
    for lo in range(0, len(sizes), 5):
        hi = min(lo + 5, len(sizes))
        out.append(
            LineRun(
                "/x/f.jsonl",
                "f.jsonl",
                "json",
                "f",
                0,
                np.arange(lo + 1, hi + 1, dtype=np.int64),
                starts[lo:hi].astype(np.int64),
                np.array(sizes[lo:hi], np.int64),
            )
        )
    return out


def _one_by_one(runs: list[LineRun]) -> list[SampleRef]:
    return [
        SampleRef(r.key(i), (("json", b"x" * int(r.lengths[i])),), "f.jsonl", "")
        for r in runs
        for i in range(r.num_lines)
    ]


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3000), max_size=40),
    shard_size=st.sampled_from([0, 600, 2048, 5000, 20000]),
    max_samples=st.sampled_from([None, 1, 3, 7]),
)
def test_runs_are_cut_where_the_same_samples_are_cut(sizes, shard_size, max_samples):
    runs = _runs(sizes)
    by_run = list(Planner("tar", shard_size, max_samples).shards(runs))
    by_sample = list(Planner("tar", shard_size, max_samples).shards(_one_by_one(runs)))
    keys_run = [[p.key(i) for p in plan.samples for i in range(p.num_lines)] for plan in by_run]
    keys_sample = [[s.key for s in plan.samples] for plan in by_sample]
    assert keys_run == keys_sample
    assert [p.raw_bytes for p in by_run] == [p.raw_bytes for p in by_sample]
    assert [p.num_samples for p in by_run] == [len(k) for k in keys_sample]


def test_a_line_file_changed_after_the_scan_is_refused(tmp_path):
    path = str(tmp_path / "f.jsonl")
    with open(path, "wb") as fh:
        fh.write(b'{"a": 1}\n{"a": 22}\n{"a": 3}\n')
    f = InputFile("f.jsonl", path, os.path.getsize(path))
    (run,) = lines.runs(f, "json", "f", Store(path))
    assert lines.read_run(run, Store(path)).startswith(b'{"a": 1}')
    with open(path, "wb") as fh:  # same size, a line end moved
        fh.write(b'{"a": 12}\n{"a": 2}\n{"a": 3}\n')
    with pytest.raises(InputError, match="line 1 is not where it was"):
        lines.read_run(run, Store(path))
    with open(path, "ab") as fh:  # grown
        fh.write(b"{}\n")
    with pytest.raises(InputError, match="has 31 bytes but had 28"):
        lines.read_run(run, Store(path))
