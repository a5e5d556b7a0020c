"""Storage flags reach the library from every command that reads or writes storage (issue 12):
``serve`` and ``bench`` take ``-o/--storage-option`` like the others, ``pack`` and ``verify``
(and ``serve``/``bench``) take ``--retries``/``--retry-seconds`` as a ``RetryPolicy``.

Against the session's moto server on 127.0.0.1, whose endpoint only ``-o endpoint_url=...``
names (conftest leaves AWS_ENDPOINT_URL unset), and the fault proxy in front of it, which counts
the attempts a policy allows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fault_proxy import FaultProxy
from helpers import write_dataset

import shardloader as sl
from shardloader.cli import main
from shardloader.cli.options import retry_policy
from shardloader.presets import DatasetPreset
from shardloader.storage.retry import RetryPolicy

pytest.importorskip("s3fs")
pytest.importorskip("moto")


def cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def upload(s3_client: Any, local: Path, bucket: str, prefix: str) -> str:
    for name in sorted(os.listdir(local)):
        s3_client.upload_file(str(local / name), bucket, f"{prefix}/{name}")
    return f"s3://{bucket}/{prefix}"


def records(root: Path, n: int = 12) -> Path:
    root.mkdir()
    lines = [json.dumps({"text": f"document {i} " * (i + 1)}) for i in range(n)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_retry_flags_become_a_policy_and_unset_flags_leave_the_default():
    assert retry_policy(None, None) is None
    assert retry_policy(0, None) == RetryPolicy(max_attempts=1)
    assert retry_policy(3, 7.5) == RetryPolicy(max_attempts=4, max_total_seconds=7.5)


def test_pack_retries_reach_the_uploads(fault_proxy: FaultProxy, s3_bucket: str, tmp_path: Path):
    """--retries 1: exactly two PUTs of a shard the store refuses (the default makes six)."""
    url = f"s3://{s3_bucket}/ds"
    fault_proxy.inject("503", method="PUT", path="/ds/shard-00000", times=None)
    r = cli(
        "pack",
        records(tmp_path / "src"),
        url,
        "--max-samples",
        "4",
        "-o",
        f"endpoint_url={fault_proxy.endpoint}",
        "--retries",
        "1",
        "--retry-seconds",
        "60",
    )
    assert r.exit_code == 1, r.output
    assert "gave up after 2 attempts" in r.stderr
    assert "(--retries 1 --retry-seconds 60)" in r.stderr  # the policy, in CLI terms
    assert fault_proxy.count("PUT", "/ds/shard-00000") == 2


def test_verify_retries_reach_the_reads(fault_proxy: FaultProxy, s3_bucket: str, tmp_path: Path):
    url = f"s3://{s3_bucket}/ds"
    endpoint = f"endpoint_url={fault_proxy.endpoint}"
    r = cli("pack", records(tmp_path / "src"), url, "--max-samples", "4", "-o", endpoint)
    assert r.exit_code == 0, r.output
    fault_proxy.inject("503", method="GET", path="/ds/shard-00001.tar", times=None)
    r = cli("verify", url, "-o", endpoint, "--retries", "2")
    assert r.exit_code == 1, r.output
    assert "BAD shard-00001.tar.zst" in r.stdout
    assert "gave up after 3 attempts" in r.stdout and "--retries 2" in r.stdout
    assert fault_proxy.count("GET", "/ds/shard-00001.tar") == 3
    assert "2 of 3 shards ok" in r.stdout


@pytest.fixture
def s3_data(s3_client: Any, s3_bucket: str, tmp_path: Path) -> str:
    local = tmp_path / "data"
    write_dataset(str(local), [5, 7], compression="zstd")
    return upload(s3_client, local, s3_bucket, "data")


def test_bench_reads_s3_through_its_storage_options(s3_data: str, s3_server: str, tmp_path: Path):
    r = cli(
        "bench",
        s3_data,
        "-o",
        f"endpoint_url={s3_server}",
        "--retries",
        "0",
        "--cache-dir",
        tmp_path / "cache",
        "--workers",
        "0",
        "--batches",
        "2",
        "--batch-size",
        "4",
        "--shuffle",
        "--seed",
        "3",
        "--no-decode",
        "--json",
    )
    assert r.exit_code == 0, r.output
    (point,) = json.loads(r.stdout)["results"]
    assert (point["num_workers"], point["batches"], point["samples"]) == (0, 2, 8)
    r = cli("bench", s3_data, "-o", "endpoint_url", "--workers", "0")
    assert r.exit_code == 2 and "--storage-option 'endpoint_url': give KEY=VALUE" in r.output


def test_serve_reads_s3_through_its_storage_options(s3_data: str, s3_server: str, tmp_path: Path):
    """A `serve s3://... -o endpoint_url=...` process streams the batches of the same preset
    read here, byte for byte."""
    from test_service_support import digest, server_env, start_servers

    cache = tmp_path / "cache"
    (server,) = start_servers(
        [
            [
                s3_data,
                "-o",
                f"endpoint_url={s3_server}",
                "--retries",
                "2",
                "--batch-size",
                "4",
                "--shuffle",
                "--seed",
                "5",
                "--workers",
                "0",
                "--cache-dir",
                str(cache),
            ]
        ],
        str(tmp_path),
        server_env(s3_data, str(cache)),
    )
    try:
        remote = [digest(b) for b in sl.RemoteLoader(server.url, world=sl.World(0, 1))]
    finally:
        server.stop()
    preset = DatasetPreset(
        batch_size=4,
        shuffle=True,
        seed=5,
        cache_dir=str(tmp_path / "mine"),
        storage_options={"endpoint_url": s3_server},
    )
    local = [digest(b) for b in sl.make_loader(preset.dataset(s3_data, world=sl.World(0, 1)))]
    assert len(remote) == 3 and remote == local


def test_a_factory_takes_no_storage_options():
    r = cli("serve", "test_service_support:small_factory", "-o", "anon=true", "--retries", "1")
    assert r.exit_code == 2
    assert "--storage-option, --retries configure a dataset path" in r.output
