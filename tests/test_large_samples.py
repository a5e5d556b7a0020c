"""A very large sample costs one copy of itself, to pack and to read (measured in a child
process: the 200 MiB sample here stands for the 3 GB ones that took 6.4 GB), and
``--max-sample-size`` refuses or skips one before reading it."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from corpus import write
from memcheck import run_measured

from shardloader.cli import main
from shardloader.errors import InputError
from shardloader.pack import PackOptions, pack

BIG = 200 << 20
ONE_COPY = 1.3  # the measured growth may pass the sample's size by this factor, never 2x


@pytest.fixture(scope="module")
def big_src(tmp_path_factory) -> str:
    """A folder of key groups: one sample of BIG bytes, two small ones."""
    src = str(tmp_path_factory.mktemp("big") / "src")
    write(src, "a/big.bin", bytes(range(256)) * (BIG // 256))
    write(src, "a/small.bin", b"small")
    write(src, "b/small.bin", b"also small")
    return src


def _pack_measured(src: str, out: str, fmt: str, compression: str) -> dict:
    return run_measured(
        "from shardloader.pack import PackOptions, pack",
        f"pack({src!r}, {out!r}, PackOptions(format={fmt!r}, compression={compression!r}))",
        max_file=1 << 30,
    )


def _read_measured(out: str, cache: str) -> dict:
    return run_measured(
        f"""
        import shardloader as sl
        read = sl.ReadOptions(cache=sl.CacheOptions(dir={cache!r}))
        ds = sl.ShardedDataset({out!r}, decoder=None, read=read)
        """,
        """
        result = sorted(len(s["bin"]) for s in ds)
        """,
        max_file=1 << 30,
    )


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_large_tar_sample_is_packed_and_read_with_one_copy(big_src, tmp_path):
    out = str(tmp_path / "out")
    packed = _pack_measured(big_src, out, "tar", "zstd")
    assert packed["error"] is None, packed["error"]
    assert packed["growth"] < ONE_COPY * BIG, packed["growth"] / BIG  # was 2.0x
    read = _read_measured(out, str(tmp_path / "cache"))  # staged, then read from the map
    assert read["error"] is None, read["error"]
    assert read["result"][-1] == BIG
    assert read["growth"] < ONE_COPY * BIG, read["growth"] / BIG  # was 1.8x


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("fmt", ["arrow", "tokens"])
def test_a_large_sample_is_read_in_place_with_one_copy(big_src, tmp_path, fmt):
    out = str(tmp_path / "out")
    assert _pack_measured(big_src, out, fmt, "none")["error"] is None
    read = _read_measured(out, str(tmp_path / "cache"))
    assert read["error"] is None, read["error"]
    assert read["result"][-1] == BIG
    assert read["growth"] < ONE_COPY * BIG, read["growth"] / BIG  # was 2.0x


def test_max_sample_size_refuses_or_skips_a_larger_sample(tmp_path):
    src = str(tmp_path / "src")
    write(src, "a/0001.bin", b"x" * 5000)
    write(src, "a/0002.bin", b"y" * 10)
    write(src, "a/0003.bin", b"z" * 4096)
    out = str(tmp_path / "out")
    with pytest.raises(InputError) as err:
        pack(src, out, PackOptions(max_sample_size=4096))
    message = str(err.value)
    assert "a/0001.bin" in message and "5,000 bytes" in message and "4,096" in message
    assert "--max-sample-size" in message and "--on-error skip" in message
    assert not os.path.exists(os.path.join(out, "index.json"))
    report = pack(src, out, PackOptions(max_sample_size=4096, on_error="skip", overwrite=True))
    assert report.samples == 2 and report.skipped == 1
    with open(os.path.join(out, "skipped.jsonl")) as f:
        (skip,) = [json.loads(line) for line in f]
    assert skip["key"] == "a/0001" and "--max-sample-size" in skip["reason"]
    result = CliRunner().invoke(
        main, ["pack", src, str(tmp_path / "cli"), "--max-sample-size", "4KiB", "-q"]
    )
    assert result.exit_code == 1, result.output
    assert "a/0001.bin" in result.output and len(result.output.strip().splitlines()) == 1


def test_max_sample_size_skips_a_long_line(tmp_path):
    src = str(tmp_path / "src")
    lines = [b'{"text": "short"}', b'{"text": "' + b"w" * 3000 + b'"}', b'{"text": "ok"}']
    write(src, "d.jsonl", b"\n".join(lines) + b"\n")
    out = str(tmp_path / "out")
    with pytest.raises(InputError, match=r"d\.jsonl line 2 .*3,012 bytes.*--max-sample-size"):
        pack(src, out, PackOptions(max_sample_size=1000))
    report = pack(src, out, PackOptions(max_sample_size=1000, on_error="skip", overwrite=True))
    assert report.samples == 2 and report.skipped == 1
