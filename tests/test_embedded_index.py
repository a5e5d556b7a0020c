"""zstd tar shards carry their sample index in a trailing skippable frame (format/embedded.py):
decoders pass over it, readers of a remote shard take it instead of a second GET, and it is
checked against the manifest like a sidecar."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import logging
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import zstandard
from click.testing import CliRunner
from helpers import batch_ids, write_dataset

import shardloader as sl
from shardloader.cli import main
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.format.embedded import FOOTER, MAGIC, Carried, carried_index, index_frame
from shardloader.manifest import Manifest, SampleIndex
from shardloader.read.sidecar import load_sidecar
from shardloader.read.verify import verify_dataset
from shardloader.storage.store import Store


def test_zstd_tar_shards_carry_their_index_and_decoders_pass_over_it(tmp_path: Path) -> None:
    m = write_dataset(str(tmp_path / "ds"), [5, 7], compression="zstd")
    for info in m.shards:
        stored = (tmp_path / "ds" / info.path).read_bytes()
        carried = carried_index(stored)
        assert carried is not None and carried.whole
        assert declared_sizes(carried.data).compressed  # zstd buffers, as the sidecar's
        ours = SampleIndex.from_arrow_bytes(carried.data)
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
        assert carried_index((tmp_path / compression / other.shards[0].path).read_bytes()) is None


def test_the_frame_parser_takes_only_a_whole_frame_of_ours() -> None:
    frame = index_frame(b"index bytes")
    assert int.from_bytes(frame[:4], "little") == MAGIC and frame.endswith(FOOTER)
    whole = Carried(b"index bytes", whole=True)
    assert carried_index(b"zstd data" + frame) == whole
    assert carried_index(lambda n: (b"zstd data" + frame)[-n:]) == whole
    assert carried_index(frame[5:]) is None  # cut: longer than what was kept
    assert carried_index(b"\0" * 4 + frame[4:]) is None  # not a skippable frame of ours
    assert carried_index(frame[:-5] + b"\xff" + frame[-4:]) is None  # length disagrees
    assert carried_index(b"data ending in" + FOOTER) is None
    assert carried_index(b"") is None


def _whole(stored: bytes) -> bytes:
    """The index bytes ``stored`` carries, whole."""
    carried = carried_index(stored)
    assert carried is not None and carried.whole
    return carried.data


def _ids(ds: sl.ShardedDataset) -> list[int]:
    """The ids of the samples a pass over ``ds`` delivers (padding left out)."""
    return [
        i
        for batch in sl.make_loader(ds, num_workers=0)
        for i, pad in zip(batch_ids(batch), batch["__pad__"].tolist(), strict=True)
        if not pad
    ]


def _rewrite_manifest(folder: Path, m: Manifest, shard: int, stored: bytes) -> None:
    (folder / m.shards[shard].path).write_bytes(stored)
    shards = list(m.shards)
    shards[shard] = dataclasses.replace(
        shards[shard], bytes=len(stored), sha256=hashlib.sha256(stored).hexdigest()
    )
    (folder / "index.json").write_bytes(dataclasses.replace(m, shards=shards).to_json())


@pytest.mark.subprocess
def test_a_carried_index_is_checked_like_a_sidecar(
    s3_bucket: str, s3_client: Any, s3_server: str, tmp_path: Path, caplog: Any
) -> None:
    """A shard (whose manifest entry matches it) carrying another shard's index: the index
    comes from the shard, is refused against the manifest entry, and the sidecar read instead
    (a warning names the shard)."""
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    first = (folder / m.shards[0].path).read_bytes()
    second = (folder / m.shards[1].path).read_bytes()
    own, wrong = _whole(first), _whole(second)
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
    with caplog.at_level(logging.WARNING, logger="shardloader"):
        assert sorted(_ids(ds)) == list(range(11))  # shard 0's samples, by its sidecar
    (warned,) = [r.getMessage() for r in caplog.records if "carried" in r.getMessage()]
    assert "shard-00000" in warned and "lists 6 samples, the manifest 5" in warned
    assert "damaged" in warned and "sidecar" in warned
    assert any((tmp_path / "cache").rglob("shard-00000.idx.arrow.raw"))  # fetched


@pytest.mark.subprocess
def test_shards_without_a_carried_index_read_their_sidecar(
    s3_bucket: str, s3_client: Any, s3_server: str, tmp_path: Path
) -> None:
    """Shards written before the frame existed (here: the frame cut off, manifest matching)."""
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    for i, info in enumerate(m.shards):
        stored = (folder / info.path).read_bytes()
        carried = _whole(stored)
        _rewrite_manifest(folder, m, i, stored[: len(stored) - len(index_frame(carried))])
        m = Manifest.from_json((folder / "index.json").read_bytes())
    for path in sorted(folder.iterdir()):
        s3_client.upload_file(str(path), s3_bucket, f"ds/{path.name}")
    read = sl.ReadOptions(
        storage_options={"endpoint_url": s3_server},
        cache=sl.CacheOptions(dir=str(tmp_path / "cache")),
    )
    ds = sl.ShardedDataset(f"s3://{s3_bucket}/ds", batch_size=4, read=read)
    assert sorted(_ids(ds)) == list(range(11))
    cached = sorted(p.name for p in (tmp_path / "cache").rglob("*.raw"))
    assert cached == [
        "shard-00000.idx.arrow.raw",
        "shard-00000.tar.zst.raw",
        "shard-00001.idx.arrow.raw",
        "shard-00001.tar.zst.raw",
    ]  # the sidecars were fetched; nothing was carried


def _sli1_frame(index: bytes) -> bytes:
    """A frame as written before it carried the index's SHA-256 (footer ``SLI1``)."""
    content = index + len(index).to_bytes(4, "little") + b"SLI1"
    return MAGIC.to_bytes(4, "little") + len(content).to_bytes(4, "little") + content


def _carrying(folder: Path, m: Manifest, frame: Any) -> None:
    """Shard 0 of ``m`` carrying ``frame(its own index bytes)`` instead of its frame; the
    manifest entry rewritten to match the stored bytes (its producer hashed the damage)."""
    stored = (folder / m.shards[0].path).read_bytes()
    own = _whole(stored)
    _rewrite_manifest(folder, m, 0, stored[: len(stored) - len(index_frame(own))] + frame(own))


def _other_checksum(index: bytes) -> bytes:
    """``index`` (Arrow bytes) with its first sample's checksum changed: it still matches its
    manifest entry (count, byte ranges, keys), not its sidecar."""
    parsed = SampleIndex.from_arrow_bytes(index)
    assert parsed.checksums is not None
    checksums = parsed.checksums.copy()
    checksums[0] ^= 1
    return dataclasses.replace(parsed, checksums=checksums).to_arrow_bytes("zstd")


def _damaged_digest(index: bytes) -> bytes:
    frame = bytearray(index_frame(index))
    frame[8 + len(index) // 2] ^= 1  # a byte inside the index: its SHA-256 no longer matches
    return bytes(frame)


def _read_remote(folder: Path, cache: Path, passes: int) -> Iterator[list[int]]:
    """The ids each of ``passes`` passes reads from ``folder`` copied to an object store
    (fsspec's memory://), so shard 0's sample index comes inside it."""
    fs, root = fsspec.filesystem("memory"), f"/emb-{uuid.uuid4().hex}"
    for path in folder.iterdir():
        fs.pipe_file(f"{root}/{path.name}", path.read_bytes())
    try:
        read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(cache)))
        for _ in range(passes):
            yield _ids(sl.ShardedDataset(f"memory://{root}", batch_size=4, read=read))
    finally:
        fs.rm(root, recursive=True)


@pytest.mark.parametrize(
    "frame, expect",
    [
        (_damaged_digest, "is damaged (not the SHA-256 its frame carries)"),
        (lambda own: index_frame(_other_checksum(own)), "differs from its sidecar (checksums)"),
        (lambda own: _sli1_frame(_other_checksum(own)), "differs from its sidecar (checksums)"),
        (lambda own: _sli1_frame(b"\0" * len(own)), "is damaged: not a valid"),
    ],
    ids=["sli2-damaged", "sli2-differs", "sli1-differs", "sli1-unreadable"],
)
def test_verify_checks_the_carried_index(tmp_path: Path, frame: Any, expect: str) -> None:
    """A carried index that is damaged, or differs from the sidecar, is a problem of its shard
    (the shard itself hashes to its manifest entry)."""
    old = tmp_path / "old"  # a whole SLI1 frame passes
    _carrying(old, write_dataset(str(old), [5, 6], compression="zstd"), _sli1_frame)
    assert verify_dataset(str(old)).ok
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    _carrying(folder, m, frame)
    report = verify_dataset(str(folder))
    (bad,) = report.bad
    assert bad.path == m.shards[0].path and report.samples == 11
    (reason,) = bad.reasons
    assert "the sample index it carries" in reason and expect in reason
    assert "re-pack or re-index" in reason
    result = CliRunner().invoke(main, ["verify", str(folder)])
    assert result.exit_code == 1 and "shard-00000" in result.output


@pytest.mark.parametrize(
    "frame, expect",
    [
        (_damaged_digest, "does not match the SHA-256 its frame carries"),
        (lambda own: _sli1_frame(b"\0" * len(own)), "shard-00000"),
        (lambda own: _sli1_frame(own[: len(own) // 2]), "shard-00000"),
    ],
    ids=["sli2-damaged", "sli1-unreadable", "sli1-cut-index"],
)
def test_a_remote_read_passes_a_damaged_carried_index_over_for_the_sidecar(
    tmp_path: Path, caplog: Any, frame: Any, expect: str
) -> None:
    """Once, with a warning naming the shard: the next pass (same node cache) reads the
    sidecar it fetched, without a word."""
    folder = tmp_path / "ds"
    m = write_dataset(str(folder), [5, 6], compression="zstd")
    _carrying(folder, m, frame)

    def carried() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "carried" in r.getMessage()]

    passes = _read_remote(folder, tmp_path / "cache", 2)
    with caplog.at_level(logging.WARNING, logger="shardloader"):
        assert sorted(next(passes)) == list(range(11))
        (warned,) = carried()
        assert warned.levelno == logging.WARNING
        assert "shard-00000" in warned.getMessage() and expect in warned.getMessage()
        assert "damaged" in warned.getMessage() and "sidecar" in warned.getMessage()
        caplog.clear()
        assert sorted(next(passes)) == list(range(11))
        assert not carried()
    passes.close()
