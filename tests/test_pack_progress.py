"""Progress that moves: shards small enough for every pack worker (``--shard-size auto``),
bars redrawn on a clock, totals known before the first shard, and advice for tiny samples."""

from __future__ import annotations

import io
import json
import time

from click.testing import CliRunner
from corpus import class_folders, write

from shardloader.cli import main
from shardloader.cli.progress import progress_bar
from shardloader.pack import PackOptions, pack
from shardloader.pack.options import DEFAULT_SHARD_SIZE, auto_shard_size
from shardloader.read.verify import verify_dataset

MiB = 1 << 20


def test_auto_shard_size_cuts_a_small_input_into_about_eight_shards():
    assert auto_shard_size(0) == auto_shard_size(5 * MiB) == 16 * MiB  # never tiny shards
    assert auto_shard_size(300 * MiB) == 38 * MiB  # an eighth, rounded up to a MiB
    assert auto_shard_size(8 * DEFAULT_SHARD_SIZE) == DEFAULT_SHARD_SIZE
    assert auto_shard_size(10**12) == DEFAULT_SHARD_SIZE


def test_one_big_input_no_longer_makes_one_shard_for_two_workers(tmp_path):
    line = json.dumps({"text": "x" * 1000}) + "\n"
    write(str(tmp_path / "src"), "corpus.jsonl", (line * 40_000).encode())  # ~40 MB
    r = CliRunner().invoke(
        main,
        ["pack", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2",
         "--compression", "none"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "shards    4" in r.stdout  # 16 MiB shards (61 MB of tar): both workers write
    assert "note: shard size 16.8 MB (auto: about an eighth of the 40.5 MB input" in r.stdout
    explicit = pack(
        str(tmp_path / "src"), str(tmp_path / "one"), PackOptions(shard_size=DEFAULT_SHARD_SIZE)
    )
    assert explicit.shards == 1 and explicit.notes == ()


def test_tiny_samples_in_tar_suggest_arrow(tmp_path):
    write(str(tmp_path / "src"), "lines.txt", b"".join(b"line %d\n" % i for i in range(2000)))
    tar = pack(str(tmp_path / "src"), str(tmp_path / "tar"))
    assert any("--format arrow packs such samples smaller" in n for n in tar.notes)
    arrow = pack(str(tmp_path / "src"), str(tmp_path / "arrow"), PackOptions(format="arrow"))
    assert arrow.notes == ()


def test_bars_are_redrawn_while_nothing_finishes():
    out = io.StringIO()
    with progress_bar(True, interval=0.02, file=out, unit="shard", total=3, desc="verify") as bar:
        time.sleep(0.3)
        assert bar.n == 0
    assert out.getvalue().count("\r") >= 5  # redrawn on the clock, not only on updates
    with progress_bar(False) as none:
        assert none is None


def test_verify_and_index_know_their_total_before_the_first_shard(tmp_path):
    class_folders(str(tmp_path / "src"), per_class=2)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(max_samples=2))
    calls: list[tuple[int, int]] = []
    verify_dataset(str(tmp_path / "out"), progress=lambda d, t: calls.append((d, t)))
    assert calls[0] == (0, 3) and calls[-1] == (3, 3)
