"""``shardloader cache info`` names each dataset by where it was read from and where its staged
copies are, and counts shards, not the sample indexes staged beside them."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner
from corpus import key_groups

import shardloader as sl
from shardloader.cli import main
from shardloader.pack import PackOptions, pack


@pytest.mark.slow
def test_cache_info_shows_the_source_and_path_and_counts_only_shards(
    tmp_path, s3_server, s3_client, s3_bucket
):
    pytest.importorskip("s3fs")
    key_groups(str(tmp_path / "src"), n=6)
    local = tmp_path / "packed"
    report = pack(str(tmp_path / "src"), str(local), PackOptions(max_samples=2))
    for name in sorted(os.listdir(local)):
        s3_client.upload_file(str(local / name), s3_bucket, f"ds/{name}")
    url = f"s3://{s3_bucket}/ds"
    root = tmp_path / "cache"
    read = sl.ReadOptions(
        storage_options={"endpoint_url": s3_server},
        cache=sl.CacheOptions(dir=str(root)),
        readahead=0,
    )
    ds = sl.ShardedDataset(url, batch_size=2, read=read, decoder=None, collate_fn=sl.RawCollate())
    assert sum(len(b["__key__"]) for b in sl.make_loader(ds)) == 6
    folder = root / ds.manifest.fingerprint
    staged = sorted(f for f in os.listdir(folder) if f.endswith(".raw"))
    assert len(staged) == 2 * report.shards  # the shards, and the sample indexes they carried
    r = CliRunner().invoke(main, ["cache", "info", "--cache-dir", str(root)])
    assert r.exit_code == 0, r.output
    assert f"{ds.manifest.fingerprint}      3 shards (+3 sample indexes/lengths)" in r.stdout
    assert f"      source {url}\n" in r.stdout and f"      path   {folder}\n" in r.stdout
    j = json.loads(
        CliRunner().invoke(main, ["cache", "info", "--cache-dir", str(root), "--json"]).stdout
    )
    [d] = j["datasets"]
    assert (d["shards"], d["other_files"], d["sources"]) == (3, 3, [url])
