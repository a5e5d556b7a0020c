"""``verify`` checks what reading checks: a sidecar whose per-sample XXH3-64 is wrong (while
the shard's SHA-256 and the sidecar's own hash agree with the manifest) fails reading with a
ChecksumError, and verify names the same sample; sound datasets, ours and adopted ones, verify
clean."""

from __future__ import annotations

import tarfile

import pyarrow as pa
import pytest
from click.testing import CliRunner
from corpus import key_groups, tar_file
from hostile import edit_sidecar

import shardloader as sl
from shardloader.cli import main
from shardloader.errors import ChecksumError
from shardloader.pack import PackOptions, pack
from shardloader.pack.index_existing import index_shards
from shardloader.read.verify import verify_dataset

CASES = [("tar", "none"), ("tar", "zstd"), ("arrow", "none"), ("arrow", "zstd"), ("tokens", "zstd")]


def _packed(tmp_path, fmt: str, compression: str) -> str:
    src = str(tmp_path / "src")
    key_groups(src, n=9)
    out = str(tmp_path / "out")
    pack(src, out, PackOptions(format=fmt, compression=compression, max_samples=4))
    return out


def _wrong_checksum(out: str, shard: int, row: int) -> str:
    """Change one sample's ``xxh3_64`` in a sidecar, and the manifest's ``index_sha256`` with
    it, so only the per-sample check can notice; return the sample's key."""

    def flip(table: pa.Table) -> pa.Table:
        at = table.schema.get_field_index("xxh3_64")
        sums = table.column(at).to_pylist()
        sums[row] ^= 1
        return table.set_column(at, table.schema.field(at), pa.array(sums, pa.uint64()))

    return str(edit_sidecar(out, shard, flip).column("key")[row])


@pytest.mark.parametrize(("fmt", "compression"), CASES)
def test_verify_finds_the_sample_whose_checksum_reading_refuses(tmp_path, fmt, compression):
    out = _packed(tmp_path, fmt, compression)
    assert verify_dataset(out).ok
    key = _wrong_checksum(out, 1, 2)
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    with pytest.raises(ChecksumError, match=key):
        list(sl.ShardedDataset(out, read=read))
    report = verify_dataset(out)
    assert not report.ok and report.samples == 9
    (bad,) = report.bad
    assert bad.path.startswith("shard-00001")
    reason, *carried = bad.reasons  # a zstd tar's carried index now differs from its sidecar
    assert repr(key) in reason and "checksum" in reason
    assert [r for r in carried if "the sample index it carries differs" not in r] == []
    result = CliRunner().invoke(main, ["verify", out])
    assert result.exit_code == 1 and key in result.output


def test_adopted_tar_shards_with_folders_and_long_names_verify_clean(tmp_path):
    """``index`` spans a sample from where the previous one ended (folder entries and pax
    records included); verify hashes the same bytes."""
    path = tmp_path / "odd.tar"
    members = [
        ("dir/", None),
        ("d" * 120 + "/k.txt", b"long"),
        ("x/1.txt", b"one"),
        ("sub/", None),
        ("x/1.json", b"{}"),
        ("y/2.txt", "ü".encode() * 400),
    ]
    tar_file(str(path), members, tarfile.PAX_FORMAT)
    index_shards([str(path)], str(tmp_path))
    report = verify_dataset(str(tmp_path))
    assert report.ok and report.samples == 3, report.bad
    _wrong_checksum(str(tmp_path), 0, 1)
    (bad,) = verify_dataset(str(tmp_path)).bad
    assert "'x/1'" in bad.reasons[0]
