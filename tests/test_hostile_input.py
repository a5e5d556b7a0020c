"""Crafted manifests, shards and inputs: a clear one-line error, never a traceback or a silent
read.  Schema (JSON types and ranges), corruption on the read path, deep JSON, symlink loops,
sample keys that could escape a directory, and downloads larger than declared.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import synthetic
import zstandard
from click.testing import CliRunner
from corpus import jsonl, key_groups, write
from hostile import edit_sidecar, shard_entry, sidecar, tar_bytes, write_manifest

import shardloader as sl
from shardloader.cli import main
from shardloader.codecs.allowlist import check_field
from shardloader.errors import ChecksumError, InputError, ManifestError, ShardError
from shardloader.manifest import FieldInfo, Manifest, SampleIndex
from shardloader.pack import PackOptions, pack
from shardloader.pack.index_existing import index_shards
from shardloader.read.verify import verify_dataset


def _dataset(path, **kw) -> sl.ShardedDataset:
    kw.setdefault("read", sl.ReadOptions(cache=sl.CacheOptions(dir=str(path) + "-cache")))
    return sl.ShardedDataset(str(path), **kw)


def _read_all(path, **kw) -> list[dict[str, Any]]:
    return list(_dataset(path, decoder=None, **kw))


# -- 3. manifest schema ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_manifest(tmp_path_factory) -> tuple[str, dict[str, Any]]:
    src = str(tmp_path_factory.mktemp("src"))
    key_groups(src, n=6)
    out = str(tmp_path_factory.mktemp("out"))
    pack(src, out, PackOptions(max_samples=3))
    with open(os.path.join(out, "index.json")) as f:
        return out, json.load(f)


def _set(raw: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    *parents, last = path.split(".")
    node: Any = raw
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value
    return raw


NOT_A_COUNT = "expected a non-negative integer, got"
SCHEMA_CASES = [
    ("shards.0.num_samples", "12", f'shards[0].num_samples: {NOT_A_COUNT} "12"'),
    ("shards.0.num_samples", None, f"shards[0].num_samples: {NOT_A_COUNT} null"),
    ("shards.0.num_samples", True, f"shards[0].num_samples: {NOT_A_COUNT} true"),
    ("shards.0.num_samples", 2.0, f"shards[0].num_samples: {NOT_A_COUNT} 2.0"),
    ("shards.1.bytes", -5, "shards[1].bytes: expected a non-negative integer, got -5"),
    ("shards.0.path", ["a.tar"], 'shards[0].path: expected a non-empty string, got ["a.tar"]'),
    ("shards.0.path", "../../etc/x.tar.zst", "shards[0].path: \"../../etc/x.tar.zst\" has a '..'"),
    ("shards.0.path", "/etc/passwd", 'shards[0].path: "/etc/passwd" is an absolute path'),
    ("shards.0.index_path", "s3://b/x.idx", 'shards[0].index_path: "s3://b/x.idx" is a URL'),
    ("shards.0.path", "%2e%2e/x.tar", "shards[0].path: \"%2e%2e/x.tar\" decodes to '../x.tar'"),
    ("shards.0.path", "a/%252E%252E/%252E%252E/x", "decodes to 'a/../../x', which has a '..'"),
    ("shards.0.path", "x.tar?sig=1", "shards[0].path: \"x.tar?sig=1\" contains '?' or '#'"),
    ("shards.0.path", "..;/x.tar", "has a '..;' component"),
    ("shards.0.path", "x\r\nHost: y", "contains a control character"),
    ("shards.0.sha256", "abc", "shards[0].sha256: expected a sha256 (64 lower-case hex digits)"),
    ("shards.0.surprise", 1, "shards[0].surprise: unknown key"),
    ("shards.0", 7, "shards[0]: expected an object, got 7"),
    ("shards", {}, "shards: expected an array, got {}"),
    ("fields", "jpg", 'fields: expected an object, got "jpg"'),
    ("fields.json.codec", "pickle", 'fields["json"].codec: expected one of'),
    ("fields.json.dtype", "O", 'fields["json"].dtype: expected no dtype for codec'),
    ("classes", "cat", 'classes: expected an array, got "cat"'),
    ("extra", [], "extra: expected an object, got []"),
    ("extra.skipped", "3", 'extra.skipped: expected a non-negative integer, got "3"'),
    ("aliases", {"image": "jpg"}, 'aliases["image"]: expected an array, got "jpg"'),
    ("length_field", 3, "length_field: expected a non-empty string, got 3"),
    ("format", "zip", "format: unknown shard format 'zip'; known: tar, arrow, tokens, parquet"),
    ("num_shards", 5, "num_shards: 5 does not equal the shards' total (2)"),
    ("num_samples", 7, "num_samples: 7 does not equal the shards' total (6)"),
]


@pytest.mark.parametrize(("path", "value", "message"), SCHEMA_CASES)
def test_manifest_schema_names_the_first_wrong_value(good_manifest, path, value, message):
    _, raw = good_manifest
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(json.dumps(_set(raw, path, value)).encode(), "index.json")
    assert str(err.value).startswith("index.json: "), err.value
    assert message in str(err.value)


def test_the_good_manifest_and_aliases_load(good_manifest):
    _, raw = good_manifest
    Manifest.from_json(json.dumps(raw).encode())
    Manifest.from_json(json.dumps(_set(raw, "aliases", {"image": ["jpg", "png"]})).encode())


def test_deeply_nested_manifest_is_a_manifest_error():
    with pytest.raises(ManifestError, match="nested too deeply"):
        Manifest.from_json(b"[" * 100_000 + b"]" * 100_000)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("shards.0.num_samples", "12", "shards[0].num_samples"),
        ("shards.0.num_samples", None, "shards[0].num_samples"),
        ("shards.0.path", ["x"], "shards[0].path"),
        ("fields", "jpg", "fields: expected an object"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "verify", "bench"])
def test_cli_prints_one_line_and_exits_1(tmp_path, good_manifest, path, value, message, command):
    out, raw = good_manifest
    d = tmp_path / "bad"
    d.mkdir()
    for name in os.listdir(out):
        os.symlink(os.path.join(out, name), d / name)
    os.remove(d / "index.json")
    (d / "index.json").write_text(json.dumps(_set(raw, path, value)))
    args = [command, str(d)] + (["--workers", "0", "--batches", "1"] if command == "bench" else [])
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    assert r.output.count("\n") == 1 and r.output.startswith("error: "), r.output
    assert message in r.output


# -- pickles never run ---------------------------------------------------------------------------


def test_pickle_payloads_never_run_in_index_inspect_verify_read(tmp_path):
    import pickle

    from corpus import Boom

    from shardloader.read.summary import inspect_dataset

    marker = tmp_path / "unpickled"
    payload = pickle.dumps(Boom(str(marker)))
    data = tar_bytes([("a/0001.pth", payload), ("a/0001.txt", b"hi"), ("a/0002.pkl", payload)])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "s.tar.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    index_shards([str(tmp_path / "d")], str(tmp_path / "d"))
    assert inspect_dataset(str(tmp_path / "d")).num_samples == 2
    assert verify_dataset(str(tmp_path / "d")).ok
    raw = _read_all(tmp_path / "d")
    assert raw[0]["pth"] == payload and raw[1]["pkl"] == payload
    with pytest.raises(sl.DecodeError, match="never unpickles"):
        list(_dataset(tmp_path / "d"))
    assert not marker.exists()


# -- 2. counts against the sidecar ------------------------------------------------------------


def test_sidecar_outside_the_shard_is_refused_on_first_use(tmp_path):
    with open(tmp_path / "shard-00000.tar", "wb") as f:
        f.write(tar_bytes([("s/0.bin", b"abc"), ("s/1.bin", b"def")]))
    index = sidecar(["s/0", "s/1"], [0, 1024], [1024, 1 << 40])
    write_manifest(
        str(tmp_path), "tar", "none", [shard_entry(str(tmp_path), "shard-00000.tar", index)]
    )
    with pytest.raises(ManifestError, match=r"shard-00000\.tar.*'s/1' at bytes 1024\.\."):
        _read_all(tmp_path)


def test_sidecar_count_must_match_the_manifest(tmp_path):
    with open(tmp_path / "shard-00000.tar", "wb") as f:
        f.write(tar_bytes([("s/0.bin", b"abc"), ("s/1.bin", b"def")]))
    entry = shard_entry(
        str(tmp_path), "shard-00000.tar", sidecar(["s/0"], [0], [1024]), num_samples=2
    )
    write_manifest(str(tmp_path), "tar", "none", [entry])
    with pytest.raises(ManifestError, match=r"lists 1 samples, the manifest 2"):
        _read_all(tmp_path)


# -- 4. corruption on the read path -----------------------------------------------------------


def _flip_in_sample(out: str, manifest: Manifest, shard: int, sample: int) -> str:
    """Flip a bit inside one sample's data of an uncompressed shard; return its key."""
    info = manifest.shards[shard]
    with open(os.path.join(out, info.index_path), "rb") as f:
        index = SampleIndex.from_arrow_bytes(f.read())
    path = os.path.join(out, info.path)
    data = bytearray(_read(path))
    if manifest.format == "tar":
        at = int(index.offsets[sample]) + 512 + 3  # inside the first member's data
    else:  # arrow: the payload bytes of that row are unique; find them
        at = bytes(data).index(_payload_of(index.keys[sample])) + 3
    data[at] ^= 0x01
    with open(path, "wb") as f:
        f.write(bytes(data))
    return index.keys[sample]


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _payload_of(key: str) -> bytes:
    return f"payload of {key} ".encode() * 8


def _small_pack(tmp_path, fmt: str) -> tuple[str, Manifest]:
    src = tmp_path / "src"
    for i in range(8):
        write(str(src), f"s/{i:04d}.bin", _payload_of(f"s/{i:04d}"))
    out = str(tmp_path / "out")
    report = pack(str(src), out, PackOptions(format=fmt, compression="none", max_samples=4))
    return out, report.manifest


@pytest.mark.parametrize("fmt", ["tar", "arrow", "tokens"])
def test_a_flipped_bit_in_an_uncompressed_local_shard_is_caught_when_read(tmp_path, fmt):
    out, manifest = _small_pack(tmp_path, fmt)
    key = _flip_in_sample(out, manifest, 1, 2)
    with pytest.raises(ChecksumError) as err:
        _read_all(out)
    assert manifest.shards[1].path in str(err.value) and repr(key) in str(err.value)
    assert "checksum" in str(err.value) and "verify_samples=False" in str(err.value)
    # the option turns exactly that check off: the damaged bytes are read as they are
    samples = _read_all(
        out, read=sl.ReadOptions(verify_samples=False, cache=sl.CacheOptions(dir=out + "-c"))
    )
    damaged = next(s for s in samples if s["__key__"] == key)
    assert len(samples) == 8 and damaged["bin"] != _payload_of(key)


def _strip_checksums(out: str) -> None:
    """Rewrite every sidecar as packers before checksums wrote them (and fix the manifest)."""
    with open(os.path.join(out, "index.json")) as f:
        count = len(json.load(f)["shards"])
    for shard in range(count):
        edit_sidecar(out, shard, lambda table: table.drop_columns(["xxh3_64"]))


def test_old_sidecars_get_a_first_use_hash_noted_in_the_node_cache(tmp_path):
    out, manifest = _small_pack(tmp_path, "tar")
    _strip_checksums(out)
    cache = str(tmp_path / "cache")
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=cache))
    assert len(_read_all(out, read=read)) == 8  # old sidecars keep working
    notes = [
        n
        for _, _, names in os.walk(cache)
        for n in names
        if n.startswith("verified-") and not n.endswith(".lock")
    ]
    assert len(notes) == 2  # one per shard, so the next process skips the hash
    key = _flip_in_sample(out, manifest, 0, 1)
    with pytest.raises(ChecksumError, match=r"shard-00000\.tar.*hashes to sha256"):
        _read_all(out, read=read)
    assert key  # the damaged shard is named, whichever sample was hit


# -- 5. deeply nested JSON ---------------------------------------------------------------------


DEEP = b"[" * 100_000 + b"]" * 100_000


def test_deep_json_fails_naming_file_and_line_or_is_skipped(tmp_path):
    lines = jsonl(str(tmp_path / "src/d.jsonl"), ["one", "two", "three"], extra_lines={1: DEEP})
    with pytest.raises(InputError) as err:
        pack(str(tmp_path / "src"), str(tmp_path / "fail"))
    assert "d.jsonl line 2" in str(err.value) and "nested too deeply" in str(err.value)
    report = pack(str(tmp_path / "src"), str(tmp_path / "skip"), PackOptions(on_error="skip"))
    with open(tmp_path / "skip/skipped.jsonl") as f:
        [skip] = [json.loads(x) for x in f]
    assert (skip["file"], skip["where"]) == ("d.jsonl", "line 2")
    assert "nested too deeply" in skip["reason"]
    assert report.samples == len(lines) - 1


def test_deep_json_field_check_is_an_input_error():
    with pytest.raises(InputError):
        check_field("json", DEEP)


# -- 6. unreadable inputs under --on-error skip ------------------------------------------------


def test_symlink_loop_is_reported_and_skipped(tmp_path):
    src = tmp_path / "src"
    key_groups(str(src), n=4)
    os.symlink("0009.json", src / "a" / "0009.json")  # a link to itself
    with pytest.raises(InputError, match=r"a/0009\.json.*(symbolic links|unreadable)"):
        pack(str(src), str(tmp_path / "fail"))
    r = CliRunner().invoke(main, ["pack", str(src), str(tmp_path / "cli"), "-q"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "a/0009.json" in r.output
    report = pack(str(src), str(tmp_path / "skip"), PackOptions(on_error="skip"))
    with open(tmp_path / "skip/skipped.jsonl") as f:
        [skip] = [json.loads(x) for x in f]
    assert skip["file"] == "a/0009.json" and "symbolic links" in skip["reason"]
    assert report.samples == 4


# -- 7. sample keys that could escape a directory ---------------------------------------------


BAD_NAMES = [
    "../../x/0002.txt",
    "/abs/dir/0003.txt",
    "a/../../0004.txt",
    "a//0005.txt",
    "a\\..\\0006.txt",
]


@pytest.mark.parametrize("suffix", [".tar", ".tar.zst"])
@pytest.mark.parametrize("bad", BAD_NAMES)
def test_index_refuses_escaping_member_names(tmp_path, suffix, bad):
    data = tar_bytes([("a/0001.txt", b"ok"), (bad, b"evil")])
    if suffix == ".tar.zst":
        data = zstandard.ZstdCompressor().compress(data)
    (tmp_path / f"s{suffix}").write_bytes(data)
    with pytest.raises(ShardError) as err:
        index_shards([str(tmp_path / f"s{suffix}")], str(tmp_path))
    assert f"s{suffix}" in str(err.value) and repr(bad) in str(err.value)
    assert "could escape a directory" in str(err.value)
    assert not (tmp_path / "index.json").exists()


def _write_keys(folder, fmt: str, keys: list[str]) -> None:
    fields = {"txt": FieldInfo("text")}
    name = "shard-00000." + ("tar" if fmt == "tar" else "arrow")
    shard = synthetic.write_shard(
        str(folder), name, fmt, "none", fields, ((k, {"txt": b"hello"}) for k in keys)
    )
    synthetic.write_manifest(str(folder), Manifest(fmt, "none", fields, [shard]))


@pytest.mark.parametrize("fmt", ["tar", "arrow", "tokens"])
@pytest.mark.parametrize("bad", ["../../x/0002", "/abs/dir/0003"])
def test_reading_refuses_escaping_keys(tmp_path, fmt, bad):
    _write_keys(tmp_path, fmt, ["a/0001", bad])
    with pytest.raises(ShardError) as err:
        _read_all(tmp_path)
    assert "shard-00000" in str(err.value) and repr(bad) in str(err.value)
    report = verify_dataset(str(tmp_path))
    assert not report.ok and any(repr(bad) in r for r in report.bad[0].reasons)


def test_pack_never_writes_an_escaping_key(tmp_path):
    src = tmp_path / "src"
    key_groups(str(src), n=2)
    # a backslash is an ordinary name character here; the field is one the other samples have,
    # else the sample would be junk, left out before any key is made
    write(str(src), "a/b\\c.json", b"{}")
    with pytest.raises(InputError, match="backslash"):
        pack(str(src), str(tmp_path / "fail"))
    report = pack(str(src), str(tmp_path / "skip"), PackOptions(on_error="skip"))
    assert report.skipped == 1 and report.samples == 2


def test_arrow_key_must_match_its_sidecar(tmp_path):
    _write_keys(tmp_path, "arrow", ["a/0001", "a/0002"])
    keys = pa.array(["a/0001", "a/9999"], pa.string())
    edit_sidecar(
        str(tmp_path),
        0,
        lambda table: table.set_column(table.column_names.index("key"), "key", keys),
    )
    with pytest.raises(ShardError, match="row 1 has key 'a/0002', its sidecar says 'a/9999'"):
        _read_all(tmp_path)


# -- 1. downloads and stored files larger than declared ----------------------------------------


@pytest.mark.subprocess
def test_download_stops_past_the_declared_size(s3_bucket, s3_client, tmp_path):
    from shardloader.storage.store import Store

    blob = os.urandom(3 << 20)
    s3_client.put_object(Bucket=s3_bucket, Key="k", Body=blob)
    endpoint = s3_client.meta.endpoint_url
    with pytest.raises(ChecksumError, match="larger than the 1,000 bytes"):
        Store(f"s3://{s3_bucket}/k", {"endpoint_url": endpoint}).read_bytes(limit=1000)
    (tmp_path / "local").write_bytes(blob)
    with pytest.raises(ChecksumError, match="larger than the 1,000 bytes"):
        Store(str(tmp_path / "local")).read_bytes(limit=1000)


def test_arrow_bomb_is_refused_from_its_declared_sizes(tmp_path):
    """An Arrow shard whose zstd buffers declare far more than its manifest entry allows."""
    big = np.zeros(64 << 20, np.uint8).tobytes()
    fields = {"bin": FieldInfo("bytes")}
    written = synthetic.write_shard(
        str(tmp_path), "shard-00000.arrow", "arrow", "zstd", fields, [("a/0001", {"bin": big})]
    )
    entry = dataclasses.replace(written, raw_bytes=4096)
    synthetic.write_manifest(str(tmp_path), Manifest("arrow", "zstd", fields, [entry]))
    with pytest.raises(ManifestError, match="more than the shard's raw_bytes"):
        _read_all(tmp_path)  # the sidecar already contradicts the entry
    tiny = sidecar(["a/0001"], [0], [8])
    shard = shard_entry(str(tmp_path), "shard-00000.arrow", tiny, raw_bytes=4096)
    write_manifest(str(tmp_path), "arrow", "zstd", [shard])
    with pytest.raises(ShardError, match="declared 67,1.*goes past"):
        _read_all(tmp_path)
    staged = [n for _, _, names in os.walk(str(tmp_path) + "-cache") for n in names]
    assert not [n for n in staged if n.endswith(".raw") or ".tmp-" in n], staged
    report = verify_dataset(str(tmp_path))
    assert any("goes past" in r for r in report.bad[0].reasons)
