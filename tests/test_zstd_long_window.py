"""``zstd --long=31`` shards are refused with the remedy, not read (a documented refusal).

A frame whose window is past the 128 MiB zstd decodes by default needs up to 2 GiB per
decoder; shardloader does not raise that limit for every worker.  ``shardloader index`` of such
a ``.tar.zst`` exits 1 with one line naming the file and how to re-compress it.  Before, the
message was zstd's own ("Frame requires too much memory for decoding") with no way forward.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import zstandard

pytestmark = pytest.mark.subprocess  # the CLI in its own process


def long_window_tar_zst(path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for i in range(3):
            data = f"caption {i}".encode()
            info = tarfile.TarInfo(f"s{i:05d}.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    # window_log 30 (1 GiB), as `zstd --long=30` writes; the frame header says so however
    # small the input, and a default decoder refuses it.
    params = zstandard.ZstdCompressionParameters.from_level(3, window_log=30, enable_ldm=True)
    out = io.BytesIO()
    with zstandard.ZstdCompressor(compression_params=params).stream_writer(out, closefd=False) as w:
        w.write(buf.getvalue())
    path.write_bytes(out.getvalue())


def test_index_of_a_long_window_zstd_shard_names_the_remedy(tmp_path: Path) -> None:
    src = tmp_path / "wds"
    src.mkdir()
    long_window_tar_zst(src / "train-000.tar.zst")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "-m", "shardloader", "index", str(src), str(src)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "train-000.tar.zst" in proc.stderr
    assert "--long" in proc.stderr and "zstd -d --long=31" in proc.stderr
    assert not (src / "index.json").exists()
