"""Issue 4 end to end against the session's moto server (127.0.0.1 only).

``shardloader pack`` straight to ``s3://``, ``inspect``/``verify`` of the URL, a read-back
through two DataLoader workers compared byte for byte with the inputs; a pack whose upload
fails part-way; request accounting of an epoch (the fault proxy logs every request); a
corrupt stored shard; and the first batch of a 10,000-shard manifest.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote, urlsplit

import numpy as np
import pytest
from click.testing import CliRunner
from fault_proxy import FaultProxy
from helpers import FAST_RETRY, payload, write_dataset
from synthetic import listed_again

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import ChecksumError
from shardloader.manifest import Manifest
from shardloader.order import epoch_order
from shardloader.shuffle import ShuffleOptions

pytestmark = pytest.mark.subprocess  # the moto S3 server process

pytest.importorskip("s3fs")
pytest.importorskip("moto")

POLICY = dataclasses.replace(FAST_RETRY, max_attempts=4, read_timeout=2.0)
CLASSES = ("cat", "dog", "eel")


def cli(*args: object, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def image(seed: int, fmt: str) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    pixels = (rng.random((8 + seed % 5, 10 + seed % 7, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def make_corpus(root: Path, per_class: int = 5) -> dict[str, bytes]:
    """``root/<class>/imgNNN.{jpg,png}`` (JPEG and PNG alternate); {relative path: bytes}."""
    files = {}
    for c, name in enumerate(CLASSES):
        for i in range(per_class):
            ext, fmt = ("jpg", "JPEG") if i % 2 == 0 else ("png", "PNG")
            rel = f"{name}/img{i:03d}.{ext}"
            files[rel] = image(10 * c + i, fmt)
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / rel).write_bytes(files[rel])
    return files


def keys_in(s3_client: Any, bucket: str) -> list[str]:
    pages = s3_client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(o["Key"] for page in pages for o in page.get("Contents", []))


def upload_folder(s3_client: Any, local: Path, bucket: str, prefix: str) -> None:
    for name in sorted(os.listdir(local)):
        s3_client.upload_file(str(local / name), bucket, f"{prefix}/{name}")


def tally(proxy: FaultProxy, bucket: str) -> tuple[Counter[str], Counter[str], int, int]:
    """(GETs per object key, HEADs per object key, LIST requests, other requests)."""
    gets: Counter[str] = Counter()
    heads: Counter[str] = Counter()
    lists = other = 0
    for r in list(proxy.requests):
        parts = urlsplit(r.path)
        path = unquote(parts.path).lstrip("/")
        if path.split("/", 1)[0] != bucket:
            other += 1
            continue
        key = path.split("/", 1)[1] if "/" in path else ""
        if r.method == "GET" and (not key or "list-type" in parts.query):
            lists += 1
        elif r.method == "GET":
            gets[key] += 1
        elif r.method == "HEAD" and key:
            heads[key] += 1
        else:
            other += 1
    return gets, heads, lists, other


@pytest.fixture
def via_proxy(fault_proxy: FaultProxy) -> dict[str, str]:
    return {"endpoint_url": fault_proxy.endpoint}


def read_options(tmp_path: Path, storage_options: dict[str, str], readahead: int = 2) -> Any:
    return sl.ReadOptions(
        storage_options=storage_options,
        readahead=readahead,
        retry=POLICY,
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
    )


# -- pack → inspect → verify → read, all on s3:// ------------------------------------------------


@pytest.mark.slow
def test_pack_to_s3_then_inspect_verify_and_read_back_byte_identical(
    s3_server: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    files = make_corpus(tmp_path / "src")
    url = f"s3://{s3_bucket}/ds/"
    endpoint = f"endpoint_url={s3_server}"
    r = cli("pack", tmp_path / "src", url, "--max-samples", "4", "-o", endpoint)
    assert r.exit_code == 0, r.output
    assert re.search(r"samples\s+15\b", r.stdout) and re.search(r"shards\s+4\b", r.stdout)
    stored = keys_in(s3_client, s3_bucket)
    assert stored == ["ds/index.json"] + [
        f"ds/shard-{i:05d}.{ext}" for i in range(4) for ext in ("idx.arrow", "tar.zst")
    ]  # nothing else: no temp objects, no staging leftovers

    # inspect with the endpoint from the environment (what botocore reads), verify with -o
    r = cli("inspect", url, "--json", env={"AWS_ENDPOINT_URL": s3_server})
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["num_shards"] == 4 and summary["num_samples"] == 15
    assert summary["classes"] == [{"name": c, "samples": 5} for c in CLASSES]
    r = cli("verify", url, "-o", endpoint)
    assert r.exit_code == 0, r.output
    assert "4 of 4 shards ok, 15 samples checked" in r.stdout

    read = read_options(tmp_path, {"endpoint_url": s3_server})
    ds = sl.ShardedDataset(
        url, batch_size=4, shuffle=True, seed=1, decoder=None, collate_fn=list, read=read
    )
    seen: dict[str, dict[str, Any]] = {}
    for batch in sl.make_loader(ds, num_workers=2):
        for sample in batch:
            if not sample["__pad__"]:
                assert sample["__key__"] not in seen
                seen[sample["__key__"]] = sample
    assert len(seen) == len(files)
    for rel, data in files.items():
        sample = seen[rel.rsplit(".", 1)[0]]
        assert sample["image"] == data  # .jpg and .png alike, the input file's bytes
        assert int(sample["cls"]) == CLASSES.index(rel.split("/")[0])


# -- a failed upload leaves no manifest -----------------------------------------------------------


@pytest.mark.slow
def test_pack_whose_upload_fails_midway_exits_1_and_writes_no_manifest(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    make_corpus(tmp_path / "src")
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))  # where pack stages remote shards
    url = f"s3://{s3_bucket}/ds"
    endpoint = f"endpoint_url={fault_proxy.endpoint}"
    # Shards 0 and 1 go up; every attempt at shard 2 gets 503 SlowDown (the store stays down).
    fault_proxy.inject("503", method="PUT", path="/ds/shard-00002", times=None)
    r = cli("pack", tmp_path / "src", url, "--max-samples", "4", "-o", endpoint)
    assert r.exit_code == 1, r.output
    assert f"{url}/shard-00002.tar.zst" in r.stderr and "SlowDown" in r.stderr
    assert fault_proxy.count("PUT", "/ds/shard-00002") > 1  # retried, then gave up
    stored = keys_in(s3_client, s3_bucket)
    assert "ds/index.json" not in stored
    # Uploaded as they completed, in the background (storage/uploads.py): shards 0 and 1, and
    # shard 3 if its upload had started when shard 2's failed; each with its sidecar.
    uploaded = sorted({int(k[len("ds/shard-") :][:5]) for k in stored})
    assert uploaded in ([0, 1], [0, 1, 3])
    assert stored == [
        f"ds/shard-{i:05d}.{ext}" for i in uploaded for ext in ("idx.arrow", "tar.zst")
    ]
    assert s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert list(staging.iterdir()) == []  # the local staging folder is gone too
    r = cli("inspect", url, "-o", endpoint)
    assert r.exit_code == 1 and "no manifest" in r.stderr

    fault_proxy.clear()  # the store recovers: --resume keeps shards 0-1 and finishes the job
    r = cli("pack", tmp_path / "src", url, "--max-samples", "4", "--resume", "-o", endpoint)
    assert r.exit_code == 0, r.output
    assert re.search(rf"\b{len(uploaded)} kept\b", r.stdout)
    assert fault_proxy.count("PUT", "/ds/shard-00000") == 0
    assert "ds/index.json" in keys_in(s3_client, s3_bucket)
    assert cli("verify", url, "-o", endpoint).exit_code == 0


# -- request accounting --------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["zstd", "gzip"])
def test_epoch_from_s3_fetches_each_object_once_per_node_and_never_lists(
    compression: str,
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    """20 shards, 2 workers that both need every shard (shuffled): one GET per shard and for
    the manifest, and nothing else: a zstd shard carries its sample index (format/embedded.py),
    so its sidecar is never fetched; a shard without one (gzip, or packed before) costs one more
    GET for the sidecar.  No HEAD, no listing; the second epoch is served by the cache."""
    sizes = [13] * 20
    write_dataset(str(tmp_path / "ds"), sizes, compression=compression)
    upload_folder(s3_client, tmp_path / "ds", s3_bucket, "ds")
    fault_proxy.clear()
    ds = sl.ShardedDataset(
        f"s3://{s3_bucket}/ds",
        batch_size=8,
        shuffle=True,
        seed=5,
        read=read_options(tmp_path, via_proxy),
    )
    gets, heads, lists, other = tally(fault_proxy, s3_bucket)
    assert (gets, heads, lists, other) == (Counter({"ds/index.json": 1}), Counter(), 0, 0)
    fault_proxy.clear()

    loader = sl.make_loader(ds, num_workers=2)
    ids = [
        int(i)
        for batch in loader
        for i, pad in zip(batch["__index__"], batch["__pad__"], strict=True)
        if not pad
    ]
    assert sorted(ids) == list(range(sum(sizes)))
    gets, heads, lists, other = tally(fault_proxy, s3_bucket)
    suffix = {"zstd": "tar.zst", "gzip": "tar.gz"}[compression]
    shards = {f"ds/shard-{i:05d}.{suffix}" for i in range(20)}
    sidecars = {f"ds/shard-{i:05d}.idx.arrow" for i in range(20)}
    fetched = shards if compression == "zstd" else shards | sidecars
    assert dict(gets) == dict.fromkeys(fetched, 1)  # each object one GET, once per node
    assert heads == Counter() and lists == 0 and other == 0

    fault_proxy.clear()
    ds.set_epoch(1)
    assert sum(len(batch["__index__"]) for batch in loader) == len(ds) * 8
    assert fault_proxy.requests == []  # everything staged on this node already
    del loader


# -- a damaged stored shard ---------------------------------------------------------------------


def test_flipped_byte_in_s3_is_a_checksum_error_or_skipped_with_equal_steps(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    sizes = [10, 12, 9, 11, 10, 8]
    write_dataset(str(tmp_path / "ds"), sizes, compression="zstd")
    bad = tmp_path / "ds" / "shard-00003.tar.zst"
    damaged = bytearray(bad.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    bad.write_bytes(bytes(damaged))
    upload_folder(s3_client, tmp_path / "ds", s3_bucket, "ds")
    url = f"s3://{s3_bucket}/ds"

    # Shuffled: no batch lies wholly inside the bad shard (one that does still fails the epoch
    # under on_error="skip": there is no good sample in the batch to repeat).
    def dataset(on_error: str, cache: str) -> sl.ShardedDataset:
        read = sl.ReadOptions(
            storage_options=via_proxy,
            retry=POLICY,
            cache=sl.CacheOptions(dir=str(tmp_path / cache)),
        )
        return sl.ShardedDataset(
            url, batch_size=6, shuffle=True, seed=2, on_error=on_error, read=read
        )

    loader = sl.make_loader(dataset("raise", "c1"), num_workers=2)
    with pytest.raises(ChecksumError) as info:
        for _ in loader:
            pass
    assert f"{url}/shard-00003.tar.zst" in str(info.value)  # through the worker boundary
    # torch re-raises a worker's error from a frame that refers to it: break that cycle, so the
    # workers shut down now rather than in some later garbage collection (which takes seconds).
    info.value.__traceback__ = None
    del info, loader

    clean_steps = len(dataset("raise", "c2"))
    ds = dataset("skip", "c3")
    fault_proxy.clear()
    steps, ids = 0, []
    for batch in sl.make_loader(ds, num_workers=2):
        steps += 1
        assert len(batch["__index__"]) == 6  # bad samples replaced, shapes unchanged
        ids += [
            int(i) for i, pad in zip(batch["__index__"], batch["__pad__"], strict=True) if not pad
        ]
    start = sum(sizes[:3])
    lost = set(range(start, start + sizes[3]))
    assert steps == clean_steps == len(ds)
    assert sorted(ids) == sorted(set(range(sum(sizes))) - lost)
    # Found bad once per worker (two downloads each), not again for each of its samples.
    assert 2 <= fault_proxy.count("GET", "/ds/shard-00003.tar.zst") <= 2 * 2


# -- a 10,000-shard manifest ---------------------------------------------------------------------


@pytest.mark.slow
def test_first_batch_of_a_10000_shard_manifest_fetches_only_what_it_needs(
    s3_bucket: str,
    s3_client: Any,
    fault_proxy: FaultProxy,
    via_proxy: dict[str, str],
    tmp_path: Path,
) -> None:
    """10,000 two-sample shards (one real shard written once, listed under 10,000 names).

    Only the manifest and the shards of the first two batches exist in the bucket (uploading
    20,000 objects to moto takes minutes); the pure plan says which those are, and a fetch of
    anything else would fail with a 404.  Timing is tools/bench_s3.py's job.
    """
    n, batch = 10_000, 32
    one = write_dataset(str(tmp_path / "one"), [2], compression="zstd")
    s = one.shards[0]
    shards = listed_again(s, n)
    manifest = Manifest(
        one.format, one.compression, one.fields, shards, length_field=one.length_field
    )
    s3_client.put_object(Bucket=s3_bucket, Key="ds/index.json", Body=manifest.to_json())
    order = epoch_order(manifest.shard_sizes, 7, 0, ShuffleOptions())
    first, second = ({int(g) // 2 for g in order[i * batch : (i + 1) * batch]} for i in (0, 1))
    blobs = {name: (tmp_path / "one" / name).read_bytes() for name in (s.path, s.index_path)}
    for i in sorted(first | second):
        for suffix, name in (("tar.zst", s.path), ("idx.arrow", s.index_path)):
            s3_client.put_object(
                Bucket=s3_bucket, Key=f"ds/shard-{i:05d}.{suffix}", Body=blobs[name]
            )
    fault_proxy.clear()

    readahead = 2
    ds = sl.ShardedDataset(
        f"s3://{s3_bucket}/ds",
        batch_size=batch,
        shuffle=True,
        seed=7,
        decoder=None,
        read=read_options(tmp_path, via_proxy, readahead),
    )
    # In this process: the exact first batch, no DataLoader prefetching.
    it = cast(Generator[Any, None, None], iter(ds))
    try:
        first_batch = next(it)
    finally:
        it.close()  # stops the read-ahead thread
    ids = [int(i) for i in first_batch["__index__"]]
    assert ids == [int(g) for g in order[:batch]]
    assert [bytes(b) for b in first_batch["bin"]] == [payload(g % 2) for g in ids]

    gets, heads, lists, other = tally(fault_proxy, s3_bucket)
    fetched = {int(k[len("ds/shard-") :][:5]) for k in gets if k.endswith(".tar.zst")}
    assert first <= fetched and fetched <= first | second
    assert not any(k.endswith(".idx.arrow") for k in gets)  # each shard carried its index
    assert gets["ds/index.json"] == 1 and max(gets.values()) == 1
    assert heads == Counter() and lists == 0 and other == 0
    assert sum(gets.values()) == len(fetched) + 1  # one request per shard, not ~n
