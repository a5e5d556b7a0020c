"""A Parquet table's dates, timestamps and decimals through ``shardloader serve``: the batches
a RemoteLoader gets equal the local loader's, value for value (they used to be refused by the
wire, and before that by the default collate)."""

from __future__ import annotations

import datetime
import decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_service_support import server_env, start_servers

import shardloader as sl
from shardloader.pack import pack
from shardloader.service import RemoteLoader

pytestmark = pytest.mark.subprocess  # a `shardloader serve` process


def test_served_batches_keep_timestamps_dates_and_decimals(tmp_path):
    utc = datetime.timezone.utc
    stamps = [datetime.datetime(2024, 2, 29, 23, 59, 59, 999_999 - d, tzinfo=utc) for d in range(6)]
    prices = [decimal.Decimal(f"-{d}.0{d}00") for d in range(6)]
    table = pa.table(
        {
            "ts": pa.array(stamps, pa.timestamp("us", tz="UTC")),
            "day": pa.array([s.date() for s in stamps], pa.date32()),
            "price": pa.array(prices, pa.decimal128(8, 4)),
            "n": pa.array(range(6), pa.int64()),
        }
    )
    (tmp_path / "src").mkdir()
    pq.write_table(table, tmp_path / "src" / "t.parquet")
    data = str(tmp_path / "out")
    pack(str(tmp_path / "src"), data)
    env = server_env(data, str(tmp_path / "cache"), SHARDLOADER_CACHE_DIR=str(tmp_path / "cache"))
    (server,) = start_servers([[data, "--batch-size", "2", "--seed", "3"]], str(tmp_path), env)
    try:
        got = list(RemoteLoader(server.url, world=sl.World(0, 1)))
    finally:
        server.stop()
    local = list(sl.make_loader(sl.ShardedDataset(data, batch_size=2, seed=3), num_workers=0))
    assert len(got) == len(local) == 3
    for remote_batch, local_batch in zip(got, local, strict=True):
        for field in ("ts", "day", "price"):
            assert [str(v) for v in remote_batch[field]] == [str(v) for v in local_batch[field]]
            pairs = zip(remote_batch[field], local_batch[field], strict=True)
            assert all(type(v) is type(w) for v, w in pairs)
        assert remote_batch["n"].tolist() == local_batch["n"].tolist()
    assert sorted(v for b in got for v in b["ts"]) == stamps[::-1]
    assert sorted(v for b in got for v in b["price"]) == sorted(prices)
