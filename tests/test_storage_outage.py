"""Retries that last: the default RetryPolicy rides out an S3 endpoint that is down for 20 s.

A real moto server is stopped mid-epoch while a real DataLoader with two workers reads from
it, and started again 20 s later on the same port (with the same objects put back, as a
restarted store would still hold them).  The epoch completes with every sample exactly once.
The fault proxy in front of the server only logs requests, so the test can tell that shards
were asked for while the server was down.  Before, the default policy (6 attempts, full jitter
from 0.2 s) gave up after 3-6 s, with a ShardError.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from helpers import write_dataset
from s3_server import MotoServer

import shardloader as sl
from shardloader.storage.retry import RetryPolicy

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

pytest.importorskip("s3fs")
pytest.importorskip("moto")

OUTAGE = 20.0
SIZES = [6] * 16


def put_back(endpoint: str, local: Path, bucket: str) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=bucket)
    for name in sorted(os.listdir(local)):
        client.upload_file(str(local / name), bucket, f"ds/{name}")


def test_default_policy_rides_out_a_20_s_restart_of_the_store_mid_epoch(tmp_path: Path) -> None:
    write_dataset(str(tmp_path / "ds"), SIZES, compression="zstd")
    server = MotoServer()
    server.start()
    proxy = FaultProxy(server.endpoint, lifetime=600.0)
    proxy.start()
    restarted: list[BaseException | None] = []
    down_at: list[float] = []

    def restart() -> None:
        try:
            server.stop()
            down_at.append(time.monotonic())
            time.sleep(OUTAGE)
            # moto comes back empty: fill it on a port of its own, then let the proxy (the
            # endpoint the readers use) forward to it, so the store returns with its data and
            # no reader meets the empty bucket a real store's restart would not show
            server.port = 0
            server.start()
            put_back(server.endpoint, tmp_path / "ds", "bucket")
            proxy.upstream = ("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1]))
            down_at.append(time.monotonic())
            restarted.append(None)
        except BaseException as err:  # noqa: BLE001 - handed to the test
            restarted.append(err)

    thread = threading.Thread(target=restart, daemon=True)
    try:
        put_back(server.endpoint, tmp_path / "ds", "bucket")
        read = sl.ReadOptions(
            storage_options={"endpoint_url": proxy.endpoint},
            retry=RetryPolicy(),  # the default, as a user gets it
            readahead=0,
            cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
        )
        ds = sl.ShardedDataset("s3://bucket/ds", batch_size=6, read=read)
        ids: list[int] = []
        loader = sl.make_loader(ds, num_workers=2)
        for batch in loader:
            ids += [int(i) for i in batch["__index__"]]
            if thread.ident is None:
                thread.start()  # after the first batch: the rest of the epoch meets the outage
        del loader
        thread.join(timeout=120)
        assert restarted == [None]
        assert sorted(ids) == list(range(sum(SIZES)))  # exactly once
        # Shards were asked for while the server was down, and again after it came back.
        assert len(down_at) == 2
        assert proxy.count("GET", "/bucket/ds/shard-") > len(SIZES)
    finally:
        if thread.ident is not None:
            thread.join(timeout=120)
        proxy.stop()
        server.stop()
