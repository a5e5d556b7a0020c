"""Damage on the way is transient; a replaced object is named (issue: transit damage).

Against the session's moto server behind the fault proxy (127.0.0.1 only):

- a zstd shard whose bytes arrive damaged (64 bytes inverted in the middle of the body, so the
  frame does not decompress) is fetched again, as a checksum mismatch is, and reads whole;
- a 200 OK HTML error page in place of a shard is retried, and a page that never goes away
  ends in one StorageError naming the URL (no advice to re-pack an intact object);
- an object replaced between the first response and a resumed range request is refused by its
  ETag (``If-Match``): an ObjectChangedError, a StorageError;
- a spent retry budget while a shard is decompressed reaches the user as the StorageError it
  is, not as "cannot decompress".
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import zstandard
from fault_proxy import FaultProxy
from helpers import FAST_RETRY, write_dataset

import shardloader as sl
from shardloader.errors import ObjectChangedError, ShardError, StorageError
from shardloader.format.compress import stage_stream
from shardloader.storage.clients import clear_clients
from shardloader.storage.store import Store

pytestmark = pytest.mark.subprocess  # the moto S3 server process

pytest.importorskip("s3fs")
pytest.importorskip("moto")

SHARD = "shard-00001.tar.zst"


def upload(s3_client: Any, local: Path, bucket: str, prefix: str) -> None:
    for name in sorted(os.listdir(local)):
        s3_client.upload_file(str(local / name), bucket, f"{prefix}/{name}")


def dataset(tmp_path: Path, bucket: str, endpoint: str, policy: Any = FAST_RETRY) -> Any:
    read = sl.ReadOptions(
        storage_options={"endpoint_url": endpoint},
        retry=policy,
        readahead=0,
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
    )
    return sl.ShardedDataset(f"s3://{bucket}/ds", batch_size=5, read=read)


def ids_of(ds: Any) -> list[int]:
    return sorted(int(i) for batch in ds for i in batch["__index__"])


def flipped_mid(data: bytes) -> bytes:
    """What the proxy's ``flip_mid`` fault delivers."""
    mid = len(data) // 2
    cut = data[mid : mid + 64]
    return data[:mid] + bytes(b ^ 0xFF for b in cut) + data[mid + len(cut) :]


def test_a_zstd_shard_damaged_in_transit_is_fetched_again(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    write_dataset(str(tmp_path / "ds"), [10, 40, 10], compression="zstd")
    stored = (tmp_path / "ds" / SHARD).read_bytes()
    # The damage the proxy does makes the frame undecodable (not merely wrong bytes, which a
    # checksum mismatch caught before): the old code stopped at "cannot decompress shard".
    with pytest.raises(ShardError, match="cannot decompress"):
        stage_stream(io.BytesIO(flipped_mid(stored)), io.BytesIO(), "zstd")
    upload(s3_client, tmp_path / "ds", s3_bucket, "ds")
    ds = dataset(tmp_path, s3_bucket, fault_proxy.endpoint)
    fault_proxy.clear()
    fault_proxy.inject("flip_mid", method="GET", path=SHARD, times=1)
    assert ids_of(ds) == list(range(60))
    assert fault_proxy.count("GET", SHARD) == 2  # the damaged body, then the whole one


def test_an_html_page_in_place_of_a_shard_is_retried(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    write_dataset(str(tmp_path / "ds"), [10, 10], compression="zstd")
    upload(s3_client, tmp_path / "ds", s3_bucket, "ds")
    ds = dataset(tmp_path, s3_bucket, fault_proxy.endpoint)
    fault_proxy.clear()
    fault_proxy.inject("html", method="GET", path=SHARD, times=2)
    assert ids_of(ds) == list(range(20))
    assert fault_proxy.count("GET", SHARD) == 3

    # A page that never goes away: one StorageError naming the URL, the attempts and the page.
    fault_proxy.clear()
    fault_proxy.inject("html", method="GET", path=SHARD, times=None)
    ds = dataset(tmp_path / "again", s3_bucket, fault_proxy.endpoint)
    with pytest.raises(StorageError) as info:
        ids_of(ds)
    msg = str(info.value)
    assert f"s3://{s3_bucket}/ds/{SHARD}" in msg and "HTML page" in msg
    assert f"{FAST_RETRY.max_attempts} attempts" in msg and "re-pack" not in msg


def test_an_object_replaced_mid_download_is_named_changed(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """The first response stalls mid-body; meanwhile the object is replaced.  The resumed
    range request carries the first response's ETag in If-Match, the store answers 412, and
    the reader says the object changed (before, it resumed into the new object's bytes)."""
    old, new = os.urandom(3000), os.urandom(3000)
    s3_client.put_object(Bucket=s3_bucket, Key="obj", Body=old)
    fault_proxy.clear()
    fault_proxy.inject("stall_mid", method="GET", path="/obj", times=1)  # half, then 2 s
    clear_clients()
    policy = dataclasses.replace(FAST_RETRY, read_timeout=1.0)
    store = Store(f"s3://{s3_bucket}/obj", {"endpoint_url": fault_proxy.endpoint}, policy)
    replace = threading.Timer(
        0.3, lambda: s3_client.put_object(Bucket=s3_bucket, Key="obj", Body=new)
    )
    replace.start()
    try:
        with pytest.raises(ObjectChangedError) as info, store.open_stream(3000) as f:
            f.read()
    finally:
        replace.join()
    assert isinstance(info.value, StorageError)
    assert f"s3://{s3_bucket}/obj" in str(info.value) and "changed" in str(info.value)
    gets = [r for r in fault_proxy.requests if r.method == "GET"]
    assert len(gets) == 2  # the 412 is not retried: another attempt cannot bring the old one


def test_a_spent_budget_mid_shard_is_a_storage_error_not_cannot_decompress(
    s3_bucket: str, s3_client: Any, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """Every GET of the shard is cut off mid-body: the budget is spent while the decompressor
    reads, and what reaches the user is a StorageError naming the shard's URL."""
    # Incompressible samples: the shard is larger than the part the fast client reads inline.
    write_dataset(str(tmp_path / "ds"), [10, 10], compression="zstd")
    shard = tmp_path / "ds" / SHARD
    assert len(zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())) > 0
    upload(s3_client, tmp_path / "ds", s3_bucket, "ds")
    ds = dataset(tmp_path, s3_bucket, fault_proxy.endpoint)
    fault_proxy.clear()
    fault_proxy.inject("reset_mid", method="GET", path=SHARD, times=None)
    with pytest.raises(StorageError) as info:
        ids_of(ds)
    assert not isinstance(info.value, ShardError)
    assert f"s3://{s3_bucket}/ds/{SHARD}" in str(info.value)
    assert "cannot decompress" not in str(info.value)
