"""Every registered shard format keeps one contract (tests/format_contract.py), and the registry
knows formats by name and nothing else: no fallthrough to a default format."""

from __future__ import annotations

import io

import pytest
from format_contract import CONTRACT, FIELDS, check_refuses_unknown_compression, write

from shardloader.errors import ManifestError, UsageError
from shardloader.format import Format, get_format, known_formats, register_format
from shardloader.manifest import FieldInfo, Manifest
from shardloader.pack import PackOptions

PACKED = [f for f in known_formats() if getattr(get_format(f), "packable", True)]
CASES = [  # formats pack writes (parquet is read in place only: tests/test_parquet_index.py)
    (name, c)
    for name in known_formats()
    if getattr(get_format(name), "packable", True)
    for c in get_format(name).compressions
]


@pytest.mark.parametrize("check", CONTRACT, ids=lambda c: c.__name__)
@pytest.mark.parametrize(("fmt", "compression"), CASES)
def test_contract(tmp_path, check, fmt, compression):
    check(str(tmp_path), fmt, compression)


@pytest.mark.parametrize("fmt", known_formats())
def test_unknown_compression_is_a_usage_error(tmp_path, fmt):
    check_refuses_unknown_compression(str(tmp_path), fmt)


# -- interoperability: peers read our shards --------------------------------------------------


@pytest.mark.parametrize("compression", ["none", "gzip"])  # webdataset's tarfile has no zstd
@pytest.mark.filterwarnings("ignore::ResourceWarning")  # webdataset leaves files to the GC
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_webdataset_reads_tar_shards(tmp_path, compression):
    import webdataset as wds

    w = write(str(tmp_path), "tar", compression)
    got = [
        (s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")})
        for s in wds.WebDataset([w.path], shardshuffle=False, empty_check=False)
    ]
    assert got == w.samples


@pytest.mark.parametrize("compression", get_format("arrow").compressions)
def test_pyarrow_reads_arrow_shards(tmp_path, compression):
    import pyarrow as pa

    w = write(str(tmp_path), "arrow", compression)
    table = pa.ipc.open_file(pa.py_buffer(w.stored)).read_all()
    assert table.column_names == ["__key__", *sorted(FIELDS)]
    rows = [(r.pop("__key__"), r) for r in table.to_pylist()]
    assert rows == w.samples


# -- the registry -------------------------------------------------------------------------------


def test_builtin_formats_are_known_by_name():
    assert known_formats()[:2] == ("tar", "arrow")
    assert get_format("tar").suffix("zstd") == ".tar.zst"
    assert get_format("arrow").suffix("none") == ".arrow"
    assert get_format("tar").parse_name("a/b.tgz") == ("gzip", "a/b")


def test_unknown_format_names_the_known_ones_everywhere():
    """Before the registry, any name but 'tar' silently read the data as Arrow."""
    with pytest.raises(UsageError, match="unknown shard format 'zip'; known: tar, arrow"):
        get_format("zip")
    with pytest.raises(ManifestError, match="unknown shard format 'zip'; known: tar, arrow"):
        Manifest("zip", "none", FIELDS, [])
    with pytest.raises(UsageError, match="--format 'zip': choose one of tar, arrow"):
        PackOptions(format="zip")
    with pytest.raises(UsageError, match="'gzip'"):
        PackOptions(format="arrow", compression="gzip")
    with pytest.raises(ManifestError, match="'gzip' is not one of zstd, none for arrow"):
        Manifest("arrow", "gzip", FIELDS, [])


def test_registration_refuses_clashes_and_non_formats():
    with pytest.raises(UsageError, match="registered already"):
        register_format(type(get_format("tar"))())
    with pytest.raises(UsageError, match="needs a shardloader.format.Format"):
        register_format("tar")  # type: ignore[arg-type]

    class NoSuffixes(Format):
        name = "nosuffix"

        def writer(self, fileobj, compression, fields): ...  # type: ignore[override]
        def sample_raw_size(self, key, sizes):
            return 0  # type: ignore[override]  # noqa: E704

        def reader(self, local_path, index, verify=True): ...  # type: ignore[override]
        def stage(self, src, dst, compression, limit=None):
            return 0  # noqa: E704

        def iter_stored(self, src, compression, where, limit=None, max_member=None):  # type: ignore[override]
            return iter(())

    with pytest.raises(UsageError, match="suffixes must map"):
        register_format(NoSuffixes())
    assert "nosuffix" not in known_formats()


def test_arrow_cannot_be_indexed_in_place():
    with pytest.raises(UsageError, match="cannot be indexed in place"):
        get_format("arrow").scan(io.BytesIO(b""), "none", "x.arrow", None)


@pytest.mark.parametrize("fmt", PACKED)
def test_planned_size_is_exact_for_long_and_non_ascii_names(fmt):
    """The planner's estimate equals the written size at the 100-byte ustar name boundary, for
    non-ASCII keys and extensions (pax records), and for empty fields."""
    f = get_format(fmt)
    fields = {"json": FieldInfo("json"), "txt": FieldInfo("text"), "bin": FieldInfo("bytes")}
    keys = ["k" * n for n in (93, 94, 95, 96, 97, 120)] + ["ké/ü", "a/" + "é" * 60]
    for key in keys:
        sample = {"json": b"{}", "txt": "ü".encode() * 3, "bin": b""}
        if fmt == "tar":
            sample["bin"] = b"x" * 513
        writer = f.writer(io.BytesIO(), "none", fields)
        writer.add(key, sample)
        written = writer.close()
        planned = f.shard_overhead + f.sample_raw_size(
            key, [(e, len(v)) for e, v in sample.items()]
        )
        assert planned == written.raw_bytes, key
