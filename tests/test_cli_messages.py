"""Messages that name the real cause, in the command line's terms: a storage failure is not "no
manifest", advice is a flag (``-o anon=true``), a glob that matched nothing says so, a batch
of unequal images names the field and the sizes, and ``serve`` resizes images by default."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from corpus import key_groups, write

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import UsageError
from shardloader.pack import PackOptions, pack


def cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_bucket_is_a_storage_error_not_a_missing_manifest(s3_server):
    pytest.importorskip("s3fs")
    r = cli("inspect", "s3://no-such-bucket-here/ds", "-o", f"endpoint_url={s3_server}")
    assert r.exit_code == 1, r.output
    assert "bucket 'no-such-bucket-here' does not exist" in r.stderr
    assert "no manifest" not in r.stderr and "pack the data first" not in r.stderr
    assert "-o endpoint_url=..." in r.stderr and "storage_options" not in r.stderr


def test_a_store_that_refuses_connections_is_named_with_cli_retry_flags():
    pytest.importorskip("s3fs")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    r = cli(
        "verify", "s3://b/ds", "-o", f"endpoint_url={endpoint}", "--retries", "1",
        "--retry-seconds", "5",
    )  # fmt: skip
    assert r.exit_code == 1, r.output
    assert "gave up after 2 attempts" in r.stderr and "no manifest" not in r.stderr
    assert "(--retries 1 --retry-seconds 5)" in r.stderr
    assert "raise --retries or --retry-seconds" in r.stderr and "RetryPolicy" not in r.stderr


@pytest.mark.slow
@pytest.mark.subprocess
def test_missing_credentials_advise_cli_flags(s3_server):
    """A fresh process with no credentials anywhere (a client made earlier in this process
    would still hold the test credentials)."""
    pytest.importorskip("s3fs")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    }
    r = subprocess.run(
        [sys.executable, "-m", "shardloader", "verify", "s3://b/ds", "-o",
         f"endpoint_url={s3_server}", "--retries", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "credentials are missing" in r.stderr and "no manifest" not in r.stderr
    assert "for a public bucket pass -o anon=true" in r.stderr
    assert "storage_options" not in r.stderr


def test_a_dataset_being_packed_says_so(tmp_path):
    key_groups(str(tmp_path / "src"), n=4)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(max_samples=2))
    os.remove(tmp_path / "out" / "index.json")  # as it is until the pack's last step
    r = cli("inspect", tmp_path / "out")
    assert r.exit_code == 1
    assert "no manifest at" in r.stderr and "a pack is writing it now, or was interrupted" in (
        r.stderr
    )
    never = cli("inspect", tmp_path / "src")
    assert never.exit_code == 1 and "pack the data first" in never.stderr


def test_index_of_a_glob_that_matched_nothing_says_so(tmp_path):
    r = cli("index", tmp_path / "nosuch*.tar", tmp_path / "x")
    assert r.exit_code == 2, r.output
    assert "nosuch*.tar: matches no file" in r.stderr and "is not below" not in r.stderr
    r = cli("index", tmp_path / "gone.tar", tmp_path)
    assert r.exit_code == 2 and "gone.tar: does not exist" in r.stderr


def test_index_says_an_index_json(tmp_path):
    key_groups(str(tmp_path / "src"), n=2)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(compression="none"))
    r = cli("index", tmp_path / "out", tmp_path / "out")
    assert r.exit_code == 1 and "already has an index.json" in r.stderr


def _png(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_a_batch_of_unequal_images_names_the_field_sizes_and_remedy(tmp_path):
    for i, size in enumerate([(8, 6), (8, 6), (10, 7), (8, 6)]):
        write(str(tmp_path / "src"), f"cat/{i}.png", _png(*size))
    pack(str(tmp_path / "src"), str(tmp_path / "out"))
    ds = sl.ShardedDataset(str(tmp_path / "out"), batch_size=4)
    with pytest.raises(UsageError) as e:
        next(iter(sl.make_loader(ds, num_workers=1)))
    msg = str(e.value)
    assert "cannot batch field 'image'" in msg
    assert "sample 'cat/0' has shape (3, 6, 8) and sample 'cat/2' has shape (3, 7, 10)" in msg
    assert "--transform auto" in msg


def test_serve_resizes_images_by_default_as_bench_does():
    from shardloader.cli.bench import bench_command as bench
    from shardloader.cli.serve import serve

    def default(command: Any) -> str:
        return next(p.default for p in command.params if p.name == "transform")

    assert default(serve) == default(bench) == "auto"
