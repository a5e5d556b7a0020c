"""Names as people have them: file and tar member names that are not UTF-8 (Linux allows any
bytes), extensions in any case, ``--alias`` without case."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile

import numpy as np
import pytest

import shardloader as sl
from shardloader.format.keys import escape_name, name_bytes
from shardloader.pack import pack


def _jpeg(seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((8, 10, 3)) * 255).astype(np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


def _write(root: bytes, rel: bytes, data: bytes) -> None:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardloader", *args],
        capture_output=True,
        text=True,
        errors="replace",
        timeout=120,
    )


def _keys(out) -> dict[str, dict]:
    return {s["__key__"]: s for s in sl.ShardedDataset(str(out), decoder=sl.Decoder())}


def test_escape_is_reversible_and_keeps_utf8_names():
    for raw in (b"caf\xe9", b"5%\xff off", b"\xc3\x28%41"):
        name = os.fsdecode(raw)
        escaped = escape_name(name)
        assert escaped.encode("utf-8")  # text now: goes into keys, JSON and tar headers
        assert name_bytes(escaped) == raw
    assert escape_name("Große Katze %41") == "Große Katze %41"  # UTF-8: unchanged


def test_non_utf8_file_names_pack_under_escaped_keys(tmp_path):
    """Old code: UnicodeEncodeError (surrogates not allowed) from the resume digest."""
    src = os.fsencode(tmp_path / "src")
    _write(src, b"caf\xe9/caf\xe9.jpg", _jpeg(1))  # a class folder too
    _write(src, b"caf\xe9/ok.jpg", _jpeg(2))
    _write(src, b"dog/r\xe9sum\xe9 100%.jpg", _jpeg(3))
    report = pack(os.fsdecode(src), str(tmp_path / "out"))
    assert report.manifest.classes == ("caf%E9", "dog")
    got = _keys(tmp_path / "out")
    assert sorted(got) == ["caf%E9/caf%E9", "caf%E9/ok", "dog/r%E9sum%E9 100%25"]
    assert name_bytes("dog/r%E9sum%E9 100%25") == b"dog/r\xe9sum\xe9 100%"
    assert got["dog/r%E9sum%E9 100%25"]["cls"] == 1
    assert tuple(got["caf%E9/caf%E9"]["image"].shape) == (3, 8, 10)


@pytest.mark.subprocess
def test_non_utf8_bad_file_is_skipped_and_listed_without_a_traceback(tmp_path):
    """Old code: a UnicodeEncodeError traceback, with --on-error skip too."""
    src = os.fsencode(tmp_path / "src")
    _write(src, b"cat/caf\xe9.jpg", _jpeg(1))
    _write(src, b"cat/bad\xff.jpg", b"not a jpeg")
    out = tmp_path / "out"
    r = _cli("pack", os.fsdecode(src), str(out), "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert "skipped 1" in r.stdout
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert [s["file"] for s in skipped] == ["cat/bad%FF.jpg"]
    assert sorted(_keys(out)) == ["cat/caf%E9"]
    r = _cli("pack", os.fsdecode(src), str(tmp_path / "out2"))  # without skip: one line, rc 1
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "cat/bad%FF" in r.stderr


@pytest.mark.subprocess
def test_index_refuses_a_non_utf8_tar_member_in_one_line(tmp_path):
    """Old code: a UnicodeEncodeError traceback from the sidecar's key column."""
    path = tmp_path / "00000.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT, errors="surrogateescape") as tar:
        for name, data in (("caf\udce9.jpg", _jpeg(1)), ("caf\udce9.txt", b"a cat")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(path) as tar:  # the bytes on disk are the raw name
        assert tar.getnames()[0].encode("utf-8", "surrogateescape") == b"caf\xe9.jpg"
    r = _cli("index", str(path), str(tmp_path))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "member name b'caf\\xe9.jpg' is not UTF-8" in r.stderr
    assert not (tmp_path / "index.json").exists()
