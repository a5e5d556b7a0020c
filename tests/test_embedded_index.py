"""zstd tar shards carry their sample index in a trailing skippable frame (format/embedded.py):
decoders pass over it, readers of a remote shard take it instead of a second GET, and it is
checked against the manifest like a sidecar."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from helpers import batch_ids, write_dataset

import shardloader as sl
from shardloader.errors import ManifestError
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.format.embedded import FOOTER, MAGIC, embedded_index, index_frame
from shardloader.manifest import Manifest, SampleIndex
from shardloader.read.sidecar import load_sidecar
from shardloader.storage.store import Store


def test_zstd_tar_shards_carry_their_index_and_decoders_pass_over_it(tmp_path: Path) -> None:
    m = write_dataset(str(tmp_path / "ds"), [5, 7], compression="zstd")
    for info in m.shards:
        stored = (tmp_path / "ds" / info.path).read_bytes()
        carried = embedded_index(stored)
        assert carried is not None
        assert declared_sizes(carried).compressed  # zstd buffers, as the sidecar's
        ours = SampleIndex.from_arrow_bytes(carried)
        sidecar = load_sidecar(Store(str(tmp_path / "ds" / info.index_path)), "tar", info)
        assert ours.keys == sidecar.keys
        for column in ("offsets", "sizes", "lengths", "checksums"):
            assert np.array_equal(getattr(ours, column), getattr(sidecar, column))
        reader = zstandard.ZstdDecompressor().stream_reader(
            io.BytesIO(stored), read_across_frames=True
        )
        tar = reader.read()
        assert len(tar) == info.raw_bytes  # the frame adds nothing to the decompressed tar
        if shutil.which("zstd"):
            cli = subprocess.run(["zstd", "-d", "-c"], input=stored, capture_output=True)
            assert cli.returncode == 0 and cli.stdout == tar
    for compression in ("gzip", "none"):
        other = write_dataset(str(tmp_path / compression), [3], compression=compression)
        assert embedded_index((tmp_path / compression / other.shards[0].path).read_bytes()) is None


def test_the_frame_parser_takes_only_a_whole_frame_of_ours() -> None:
    frame = index_frame(b"index bytes")
    assert int.from_bytes(frame[:4], "little") == MAGIC and frame.endswith(FOOTER)
    assert embedded_index(b"zstd data" + frame) == b"index bytes"
    assert embedded_index(lambda n: (b"zstd data" + frame)[-n:]) == b"index bytes"
    assert embedded_index(frame[5:]) is None  # cut: longer than what was kept
    assert embedded_index(b"\0" * 4 + frame[4:]) is None  # not a skippable frame of ours
    assert embedded_index(frame[:-5] + b"\xff" + frame[-4:]) is None  # length disagrees
    assert embedded_index(b"data ending in" + FOOTER) is None
    assert embedded_index(b"") is None


def _rewrite_manifest(folder: Path, m: Manifest, shard: int, stored: bytes) -> None:
    (folder / m.shards[shard].path).write_bytes(stored)
    shards = list(m.shards)
    shards[shard] = dataclasses.replace(
        shards[shard], bytes=len(stored), sha256=hashlib.sha256(stored).hexdigest()
    )
    (folder / "index.json").write_bytes(dataclasses.replace(m, shards=shards).to_json())


@pytest.mark.subprocess
def test_a_carried_index_is_checked_like_a_sidecar(
    s3_bucket: str, s3_client: Any, s3_server: str, tmp_path: Path
) -> None:
    """A shard (whose manifest entry matches it) carrying another shard's index: the index
    comes from the shard, not the sidecar, and is refused against the manifest entry."""
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    first = (folder / m.shards[0].path).read_bytes()
    second = (folder / m.shards[1].path).read_bytes()
    own, wrong = embedded_index(first), embedded_index(second)
    assert own is not None and wrong is not None
    crafted = first[: len(first) - len(index_frame(own))] + index_frame(wrong)
    _rewrite_manifest(folder, m, 0, crafted)
    for path in sorted(folder.iterdir()):
        s3_client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    read = sl.ReadOptions(
        storage_options={"endpoint_url": s3_server},
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
        readahead=0,
    )
    ds = sl.ShardedDataset(f"s3://{s3_bucket}/ds", batch_size=5, read=read)
    with pytest.raises(ManifestError, match="lists 6 samples, the manifest 5") as info:
        next(iter(ds))
    assert "shard-00000" in str(info.value)


@pytest.mark.subprocess
def test_shards_without_a_carried_index_read_their_sidecar(
    s3_bucket: str, s3_client: Any, s3_server: str, tmp_path: Path
) -> None:
    """Shards written before the frame existed (here: the frame cut off, manifest matching)."""
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    for i, info in enumerate(m.shards):
        stored = (folder / info.path).read_bytes()
        carried = embedded_index(stored)
        assert carried is not None
        _rewrite_manifest(folder, m, i, stored[: len(stored) - len(index_frame(carried))])
        m = Manifest.from_json((folder / "index.json").read_bytes())
    for path in sorted(folder.iterdir()):
        s3_client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    read = sl.ReadOptions(
        storage_options={"endpoint_url": s3_server},
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
    )
    ds = sl.ShardedDataset(f"s3://{s3_bucket}/ds", batch_size=4, read=read)
    ids = [
        i
        for batch in sl.make_loader(ds, num_workers=0)
        for i, pad in zip(batch_ids(batch), batch["__pad__"].tolist(), strict=True)
        if not pad
    ]
    assert sorted(ids) == list(range(11))
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.raw"))
    assert cached == [
        "shard-00000.idx.arrow.raw",
        "shard-00000.tar.zst.raw",
        "shard-00001.idx.arrow.raw",
        "shard-00001.tar.zst.raw",
    ]  # the sidecars were fetched; nothing was carried
