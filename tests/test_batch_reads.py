"""The batch read path: tar field positions derived with numpy (format/tar/layout.py), Arrow spans
from the offset buffers, batches of several shards put back in order, seeds for a whole pass."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardloader as sl
from shardloader.errors import ShardError
from shardloader.format import get_format, open_writer
from shardloader.format.base import Rows, read_rows
from shardloader.format.keys import first_unsafe_key, key_lengths, unsafe_key_reason
from shardloader.format.tar.layout import derive_layout
from shardloader.manifest import FieldInfo
from shardloader.plan.shuffle import derive_seed, derive_seeds, transform_seeds

FIELDS = {"bin": FieldInfo("bytes"), "txt": FieldInfo("text")}


def _tar_shard(tmp_path, samples):
    path = str(tmp_path / "s.tar")
    with open(path, "wb") as f:
        w = open_writer("tar", f, "none", FIELDS)
        for key, fields in samples:
            w.add(key, fields)
        written = w.close()
    return path, written.index


def _layout(path, index, check_keys):
    with open(path, "rb") as f:
        buf = np.frombuffer(f.read(), np.uint8)
    klen, kstart, joined = key_lengths(index.keys)
    return derive_layout(
        buf, index.offsets, index.sizes, klen, (kstart, joined) if check_keys else None
    )


@pytest.mark.parametrize("check_keys", [False, True])
def test_layout_finds_every_field(tmp_path, check_keys):
    samples = [
        (f"d/{i:03d}", {"bin": bytes([i]) * (i * 37 % 700), "txt": b"t%d" % i}) for i in range(40)
    ]
    samples[5] = ("d/005", {"bin": b"only bin"})  # a sample without a field
    path, index = _tar_shard(tmp_path, samples)
    layout = _layout(path, index, check_keys)
    assert layout.regular.all() and sorted(layout.fields) == ["bin", "txt"]
    with open(path, "rb") as f:
        data = f.read()
    for i, (_, fields) in enumerate(samples):
        for name in ("bin", "txt"):
            a, b = layout.fields[name][0][i], layout.fields[name][1][i]
            if name in fields:
                assert data[a:b] == fields[name]
            else:
                assert a == b == -1


def test_layout_leaves_odd_samples_to_the_parser(tmp_path):
    """Long names (pax records), a sidecar key that is not the member's, and a sample cut
    short are irregular: read one by one, with the parser's answer or error."""
    long_key = "x/" + "k" * 120
    samples = [("a/0", {"bin": b"1"}), (long_key, {"bin": b"2"}), ("a/2", {"bin": b"3"})]
    path, index = _tar_shard(tmp_path, samples)
    assert _layout(path, index, False).regular.tolist() == [True, False, True]
    other = type(index)(["a/0", long_key, "a/9"], index.offsets, index.sizes)
    assert _layout(path, other, True).regular.tolist() == [True, False, False]
    reader = get_format("tar").reader(path, index)
    rows = Rows(3)
    read_rows(reader, [2, 1, 0], rows, range(3))
    assert rows.keys == ["a/2", long_key, "a/0"] and not rows.errors
    assert [bytes(v) for v in rows.fields["bin"]] == [b"3", b"2", b"1"]
    reader.close()
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(index.offsets[2]) + 100])  # the last sample cut short
    reader = get_format("tar").reader(path, index)
    rows = Rows(3)
    read_rows(reader, [0, 1, 2], rows, range(3))
    assert list(rows.errors) == [2] and "truncated" in str(rows.errors[2])
    assert rows.keys[:2] == ["a/0", long_key]
    reader.close()


def test_tar_written_by_tarfile_reads_the_same(tmp_path):
    """A shard from another writer (GNU format: long names as ././@LongLink members)."""
    members = [("s/0.bin", b"zero"), ("s/0.txt", b"t0"), ("s/1.bin", b"one" * 300)]
    members.append((f"s/{'n' * 110}.bin", b"long"))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as t:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    path = str(tmp_path / "g.tar")
    with open(path, "wb") as f:
        f.write(raw.getvalue())
    fmt = get_format("tar")
    with open(path, "rb") as f:
        scanned = fmt.scan(f, "none", path, None)
    reader = fmt.reader(path, scanned.index)
    rows = Rows(3)
    read_rows(reader, [2, 0, 1], rows, range(3))
    want = [reader.read(i) for i in (2, 0, 1)]
    assert rows.keys == [k for k, _ in want] and not rows.errors
    for pos, (_, fields) in enumerate(want):
        got = {n: bytes(c[pos]) for n, c in rows.fields.items() if c[pos] is not None}
        assert got == fields
    reader.close()


def _arrow_shard(tmp_path, n=6):
    path = str(tmp_path / "s.arrow")
    samples = [(f"a/{i}", {"bin": b"b%d" % i * (i + 1), "txt": b"t%d" % i}) for i in range(n)]
    with open(path, "wb") as f:
        w = open_writer("arrow", f, "none", FIELDS)
        for key, fields in samples:
            w.add(key, fields)
        written = w.close()
    return path, written.index, samples


def _offsets_at(path, column):
    """File position of ``column``'s offset buffer in the first record batch."""
    whole = pa.memory_map(path).read_buffer()
    batch = pa.ipc.open_file(whole).get_batch(0)
    return batch.column(column).buffers()[1].address - whole.address


@pytest.mark.parametrize("value", [1 << 40, -5])
def test_arrow_offsets_outside_the_file_are_refused(tmp_path, value):
    """Offsets pyarrow does not check: a row pointing past its data (or backwards) is a
    ShardError when the shard opens, never a read of memory outside the map."""
    path, index, _ = _arrow_shard(tmp_path)
    at = _offsets_at(path, "bin") + 8 * 3  # the 4th offset of the large_binary column
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(np.array([value], "<i8").tobytes())
    with pytest.raises(ShardError, match="'bin' has values outside the file"):
        get_format("arrow").reader(path, index)


def test_tar_first_reads_one_by_one_then_derived_read_the_same(tmp_path):
    """A shard's first rows are read one by one (no layout derived), the later ones through the
    derived layout: small batches across the switch give every sample's fields exactly, and
    the switch comes once the early reads reach _DERIVE_AT_LEAST rows."""
    from shardloader.format.tar import reader as tar_reader

    samples = [
        (f"d/{i:03d}", {"bin": os.urandom(i * 7 % 300), "txt": b"t%d" % i}) for i in range(300)
    ]
    path, index = _tar_shard(tmp_path, samples)
    reader = get_format("tar").reader(path, index)
    order = np.random.default_rng(0).permutation(300).tolist()
    derived_at = None
    for lo in range(0, 300, 10):
        chunk = order[lo : lo + 10]
        rows = Rows(len(chunk))
        read_rows(reader, chunk, rows, range(len(chunk)))
        assert rows.keys == [samples[i][0] for i in chunk] and not rows.errors
        for name in ("bin", "txt"):
            assert [bytes(v) for v in rows.fields[name]] == [samples[i][1][name] for i in chunk]
        if derived_at is None and reader._rows_table is not None:
            derived_at = lo
    assert derived_at == (tar_reader._DERIVE_AT_LEAST // 10) * 10
    reader.close()


def test_arrow_reader_reads_rows_in_any_order(tmp_path):
    path, index, samples = _arrow_shard(tmp_path, 20)
    reader = get_format("arrow").reader(path, index)
    order = [19, 0, 7, 7, 3]
    rows = Rows(len(order))
    read_rows(reader, order, rows, range(len(order)))
    assert rows.keys == [samples[i][0] for i in order]
    assert [bytes(v) for v in rows.fields["bin"]] == [samples[i][1]["bin"] for i in order]
    reader.close()


def test_arrow_and_tar_give_the_same_batches(tmp_path):
    """The same source packed both ways reads back as the same raw batches."""
    from corpus import write

    from shardloader.pack import PackOptions, pack

    src = tmp_path / "src"
    for i in range(50):
        write(str(src), f"g/{i:03d}.bin", os.urandom(i * 13 % 500))
        write(str(src), f"g/{i:03d}.txt", b"caption %d" % i)
    runs = []
    for fmt in ("tar", "arrow"):
        out = str(tmp_path / fmt)
        pack(str(src), out, PackOptions(format=fmt, max_samples=16))
        read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
        ds = sl.ShardedDataset(
            out, batch_size=8, shuffle=True, decoder=None, collate_fn=sl.RawCollate(), read=read
        )
        runs.append([(b["__key__"], list(b["bin"]), list(b["txt"])) for b in sl.make_loader(ds)])
    assert runs[0] == runs[1]


def test_rows_put_pieces_back_in_order():
    rows = Rows(5)
    rows.add([3, 0], ["d", "a"], {"x": [b"3", b"0"]})
    rows.fail(2, ShardError("bad"))
    rows.add([4, 1], ["e", "b"], {"y": [b"y4", b"y1"]})
    assert rows.keys == ["a", "b", "", "d", "e"]
    assert rows.fields == {
        "x": [b"0", None, None, b"3", None],
        "y": [None, b"y1", None, None, b"y4"],
    }
    assert list(rows.errors) == [2] and rows.done(4) and not Rows(1).done(0)
    parts = rows.split([2, 3])
    assert [p.keys for p in parts] == [["a", "b"], ["", "d", "e"]]
    assert list(parts[1].errors) == [0]


# -- seeds and keys ---------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**64 - 1),
    epoch=st.integers(0, 2**40),
    batches=st.lists(st.integers(0, 2**32 + 5), min_size=1, max_size=20),
)
def test_derive_seeds_is_derive_seed(seed, epoch, batches):
    """The vectorised SeedSequence mixing gives exactly derive_seed's values (values past
    32 bits included, which take derive_seed's own path)."""
    ids = np.array(batches, np.int64)
    assert derive_seeds(seed, epoch, ids).tolist() == [derive_seed(seed, epoch, b) for b in batches]
    assert derive_seeds(ids, seed).tolist() == [derive_seed(b, seed) for b in batches]
    assert transform_seeds(seed, epoch, ids).tolist() == [
        derive_seed(seed, epoch, b, 1 << 41) for b in batches
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(alphabet="ab/.\\:\0é", max_size=6), max_size=6))
def test_first_unsafe_key_agrees_with_the_rule(keys):
    want = next(((k, r) for k in keys if (r := unsafe_key_reason(k)) is not None), None)
    assert first_unsafe_key(keys) == want
