"""RawCollate / RawBatch / ByteColumn: raw bytes one buffer (or bytes list) per field, read a batch
at a time, through real DataLoaders with worker processes."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch
from helpers import payload, write_dataset

import shardloader as sl
from shardloader.batching.raw import ByteColumn, RawBatch, RawCollate
from shardloader.deliver.transport import Bundle
from shardloader.errors import ChecksumError, UsageError
from shardloader.manifest import SampleIndex

SIZES = [7, 40, 1, 25, 0, 31]  # 104 samples, uneven shards, one empty


def make(path, **kw):
    kw.setdefault("read", sl.ReadOptions(cache=sl.CacheOptions(dir=os.path.join(path, "_cache"))))
    kw.setdefault("decoder", None)
    return sl.ShardedDataset(path, **kw)


def raw_epoch(path, num_workers=0, **kw):
    ds = make(path, batch_size=8, shuffle=True, seed=3, collate_fn=RawCollate(), **kw)
    return list(sl.make_loader(ds, num_workers=num_workers))


def flat(batches):
    """(key, global id, pad, bin bytes, cls bytes) of every sample of every batch, in order."""
    out = []
    for b in batches:
        assert isinstance(b, RawBatch)
        cols = [b["bin"], b["cls"]]
        assert all(isinstance(c, ByteColumn) for c in cols)
        n = len(b["__key__"])
        assert b["__index__"].dtype == torch.int64 and b["__pad__"].dtype == torch.bool
        assert len(b["__index__"]) == len(b["__pad__"]) == len(cols[0]) == len(cols[1]) == n
        out += zip(b["__key__"], b["__index__"].tolist(), b["__pad__"].tolist(), *cols, strict=True)
    return out


@pytest.fixture(scope="module", params=["tar-none", "tar-zstd", "arrow-none", "arrow-zstd"])
def data(request, tmp_path_factory):
    fmt, compression = request.param.split("-")
    d = str(tmp_path_factory.mktemp(request.param))
    write_dataset(d, SIZES, fmt=fmt, compression=compression)
    return d


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_bytes_through_workers(data, num_workers):
    """Every sample's bytes arrive exactly (each once, padding flagged), and the columns are
    the same whether read in the training process or in workers."""
    got = flat(raw_epoch(data, num_workers))
    real = [(k, i, b, c) for k, i, pad, b, c in got if not pad]
    assert sorted(i for _, i, _, _ in real) == list(range(104))
    for key, i, b, c in real:
        assert key == f"s/{i:06d}" and b == payload(i) and c == str(i % 3).encode()
        assert type(b) is bytes
    for key, i, pad, b, _ in got:
        if pad:  # a repeat of a real sample, all its fields
            assert b == payload(i) and key == f"s/{i:06d}"


def test_the_same_batches_whatever_num_workers(data):
    runs = [flat(raw_epoch(data, w)) for w in (0, 1, 2)]
    assert runs[0] == runs[1] == runs[2]


def test_same_as_sample_dicts(data):
    """RawCollate's fast path gives what the default path gives, field for field."""
    ds = make(data, batch_size=8, shuffle=True, seed=3, collate_fn=lambda samples: samples)
    dicts = [s for batch in sl.make_loader(ds) for s in batch]
    raw = flat(raw_epoch(data))
    assert [(s["__key__"], s["__index__"], s["__pad__"], s["bin"], s["cls"]) for s in dicts] == raw


def _flip_in_sample(path: str, shard: int, sample: int) -> str:
    """Flip a byte of one sample's ``bin`` payload in an uncompressed shard; its key."""
    with open(os.path.join(path, "index.json")) as f:
        manifest = json.load(f)
    info = manifest["shards"][shard]
    with open(os.path.join(path, info["index_path"]), "rb") as f:
        index = SampleIndex.from_arrow_bytes(f.read())
    key = index.keys[sample]
    target = os.path.join(path, info["path"])
    with open(target, "rb") as f:
        blob = bytearray(f.read())
    gid = sum(s["num_samples"] for s in manifest["shards"][:shard]) + sample
    at = bytes(blob).index(payload(gid)) + 5
    blob[at] ^= 0xFF
    with open(target, "wb") as f:
        f.write(bytes(blob))
    return key


@pytest.mark.parametrize("fmt", ["tar", "arrow"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_skip_keeps_the_shapes(tmp_path, fmt, num_workers):
    """A sample that fails its checksum raises, or under on_error='skip' is replaced by a
    repeat of a good one of its batch: every column keeps the batch size."""
    write_dataset(str(tmp_path), SIZES, fmt=fmt, compression="none")
    bad = _flip_in_sample(str(tmp_path), 1, 13)
    with pytest.raises(ChecksumError, match=bad):
        raw_epoch(str(tmp_path), num_workers)
    got = raw_epoch(str(tmp_path), num_workers, on_error="skip")
    assert all(len(b["__key__"]) == 8 for b in got)
    samples = flat(got)
    assert bad not in [k for k, *_ in samples]
    real = {i for _, i, pad, _, _ in samples if not pad}
    assert real == set(range(104)) - {int(bad.split("/")[1])}
    for key, i, _, b, _ in samples:
        assert b == payload(i) and key == f"s/{i:06d}"  # stand-ins are whole good samples


def test_unbatched_and_segment_batches_still_work(tmp_path):
    """Without batches RawCollate is not called; with a collate the samples go through it."""
    write_dataset(str(tmp_path), [5, 3])
    ds = make(str(tmp_path), collate_fn=RawCollate())
    assert [s["bin"] for s in sl.make_loader(ds)] == [payload(i) for i in range(8)]


def test_user_code_gets_sample_dicts_then_raw_collate(tmp_path):
    """With a transform the samples are dicts; RawCollate collates them (bytes → columns,
    numbers → tensors)."""
    write_dataset(str(tmp_path), [10])

    def add_size(sample):
        return {**sample, "size": len(sample["bin"])}

    ds = make(str(tmp_path), batch_size=5, transform=add_size, collate_fn=RawCollate())
    batches = list(sl.make_loader(ds))
    assert [b["size"].tolist() for b in batches] == [
        [len(payload(i)) for i in range(j, j + 5)] for j in (0, 5)
    ]
    assert [list(b["bin"]) for b in batches] == [
        [payload(i) for i in range(j, j + 5)] for j in (0, 5)
    ]


# -- ByteColumn and RawBatch themselves ------------------------------------------------------


def test_byte_column_access_and_missing_values():
    for values in ([b"ab", b"", b"cde"], [b"ab", None, memoryview(b"cde")]):
        col = ByteColumn.of(values)
        want = [None if v is None else bytes(v) for v in values]
        assert len(col) == 3 and list(col) == want and col.tolist() == want
        assert [col[i] for i in range(3)] == want and col[-1] == b"cde" and col[0:2] == want[:2]
        assert col == want and col != [b"x"] and col == ByteColumn.of(want)
        assert col.sizes.tolist() == [2, 0, 3]
        assert col.present.tolist() == [v is not None for v in values]
        with pytest.raises(IndexError):
            col[3]
        # the joined form: one buffer, offsets
        assert bytes(col.buffer) == b"abcde" and col.offsets.tolist() == [0, 2, 2, 5]
        assert list(col) == want and col.sizes.tolist() == [2, 0, 3]
        assert col.present.tolist() == [v is not None for v in values]
        assert bytes(col.tensor().numpy()) == b"abcde" and col.tensor().dtype == torch.uint8
        assert pickle.loads(pickle.dumps(col)) == want
        with pytest.raises(ValueError):
            col.offsets[0] = 1  # read-only


@pytest.mark.parametrize("joined", [False, True])
def test_raw_batch_crosses_processes_as_bytes(joined):
    """No tensor storage, no per-sample object but bytes, goes into the pickle; the batch comes
    back equal, tensors included."""
    samples = [
        {"__key__": f"k/{i}", "__index__": i, "__pad__": i == 2, "bin": bytes([i]) * i}
        for i in range(4)
    ]
    batch = RawCollate()(samples)
    if joined:
        batch["bin"].buffer  # noqa: B018 - joins the column
    data = ForkingPickler.dumps(batch)
    assert b"torch" not in data  # rebuilt from bytes, not shared through torch's reductions
    back = pickle.loads(data)
    assert isinstance(back, RawBatch) and list(back) == list(batch)
    assert back["__key__"] == ["k/0", "k/1", "k/2", "k/3"]
    assert back["__index__"].tolist() == [0, 1, 2, 3]
    assert back["__pad__"].tolist() == [False, False, True, False]
    assert list(back["bin"]) == [s["bin"] for s in samples]
    back["__index__"][0] = 7  # writable, not a view of immutable bytes


def test_raw_batch_keeps_other_values_and_odd_keys():
    batch = RawBatch(__key__=["a\0b", "c"], extra=torch.ones(2), note=[1, 2])
    back = pickle.loads(ForkingPickler.dumps(batch))
    assert back["__key__"] == ["a\0b", "c"] and back["note"] == [1, 2]
    assert torch.equal(back["extra"], torch.ones(2))


def test_raw_collate_refuses_missing_values_it_cannot_hold():
    with pytest.raises(UsageError, match="'n'"):
        RawCollate()([{"n": 1}, {}])
    with pytest.raises(UsageError, match="empty"):
        RawCollate()([])
    batch = RawCollate()([{"x": b"1"}, {"y": b"2"}])
    assert list(batch["x"]) == [b"1", None] and list(batch["y"]) == [None, b"2"]


def test_aliases_fill_one_column(tmp_path):
    """key.bin and key.dat both fill ``data`` in the raw path as in sample dicts."""
    from corpus import write

    from shardloader.pack import PackOptions, pack

    src = tmp_path / "src"
    for i in range(6):
        write(str(src), f"c/{i:02d}.{'dat' if i % 2 else 'bin'}", b"blob%d" % i)
        write(str(src), f"c/{i:02d}.txt", b"t%d" % i)
    options = PackOptions(compression="none", aliases={"data": ("bin", "dat")})
    pack(str(src), str(tmp_path / "out"), options)
    ds = make(str(tmp_path / "out"), batch_size=3, collate_fn=RawCollate())
    batches = list(sl.make_loader(ds))
    assert [list(b["data"]) for b in batches] == [
        [b"blob0", b"blob1", b"blob2"],
        [b"blob3", b"blob4", b"blob5"],
    ]
    assert "bin" not in batches[0] and "dat" not in batches[0]


def _states(ds, draws: int) -> list[str]:
    """numpy's global state as each batch arrives, the loop drawing ``draws`` numbers a step."""
    out = []
    for _ in sl.make_loader(ds):
        _, key, pos, *_ = np.random.get_state()
        out.append(hashlib.sha256(key.tobytes() + bytes(str(pos), "ascii")).hexdigest())
        np.random.random(draws)
    return out


def test_no_global_reseeding_without_user_code(tmp_path):
    """NOTE [what the global seeds are for]: a pipeline of shardloader's own parts leaves the
    global generators to the training loop; one with a user collate has them seeded before
    each batch, whatever the loop drew."""
    write_dataset(str(tmp_path), [20])
    for collate, reseeded in ((RawCollate(), False), (lambda samples: samples, True)):
        ds = make(str(tmp_path), batch_size=4, collate_fn=collate)
        assert (_states(ds, 1) == _states(ds, 2)) is reseeded


def test_a_large_tar_shard_read_in_small_batches_is_exact(tmp_path):
    """Shuffled small batches take a few rows of a big shard at a time: the layout is derived
    a chunk at a time (the first batch one by one), every sample's bytes exact, and a damaged
    sample far into the shard is still caught by its checksum."""
    write_dataset(str(tmp_path), [5000], compression="none")
    got = flat(raw_epoch(str(tmp_path)))
    assert sorted(i for _, i, pad, _, _ in got if not pad) == list(range(5000))
    for key, i, _, b, _ in got:
        assert b == payload(i) and key == f"s/{i:06d}"
    bad = _flip_in_sample(str(tmp_path), 0, 4321)
    with pytest.raises(ChecksumError, match=bad):
        raw_epoch(str(tmp_path))


def test_a_shard_closed_at_exit_closes_quietly(tmp_path, monkeypatch):
    """A script that stops mid-epoch leaves its open shards to be closed at exit, when module
    globals may be gone already (seen with torch 2.14: "'NoneType' object has no attribute
    'mmap'" printed at every such exit)."""
    from shardloader.format import mapped

    path = tmp_path / "shard"
    path.write_bytes(b"x" * 4096)
    f = mapped.MappedFile(str(path))
    monkeypatch.setattr(mapped, "mmap", None)  # what interpreter shutdown does to globals
    f.close()
    assert f.map.closed


@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_raw_bundles_keep_order_and_resume_exactly_once(data, monkeypatch, num_workers):
    """Workers hand raw batches over in bundles (NOTE [raw bundles]): 13 steps in bundles of
    3 (the last short) arrive in the order of a process without workers, and a checkpoint
    inside a bundle resumes with exactly the batches not yet consumed."""
    import shardloader.batching.raw as raw

    monkeypatch.setattr(raw, "MAX_RAW_BUNDLE", 3)
    ds = make(data, batch_size=8, shuffle=True, seed=3, collate_fn=RawCollate())
    assert raw.raw_bundle(ds) == 3
    whole = flat(raw_epoch(data, 0))
    assert flat(raw_epoch(data, num_workers)) == whole
    loader = sl.make_loader(ds, num_workers=num_workers)
    items = list(torch.utils.data.DataLoader.__iter__(loader))  # as the workers sent them
    assert [len(i) if isinstance(i, Bundle) else 0 for i in items] == [3, 3, 3, 3, 1]
    loader = sl.make_loader(ds, num_workers=num_workers)
    seen = []
    for step, batch in enumerate(loader):
        seen.append(batch)
        if step == 4:  # the middle of the second bundle
            state = loader.state_dict()
            break
    again = make(data, batch_size=8, shuffle=True, seed=3, collate_fn=RawCollate())
    resumed = sl.make_loader(again, num_workers=num_workers)
    resumed.load_state_dict(state)
    assert flat(seen) + flat(list(resumed)) == whole


def test_raw_bundles_only_for_small_raw_batches(data):
    import shardloader.batching.raw as raw

    kw = dict(batch_size=8, shuffle=True, seed=3)
    assert raw.raw_bundle(make(data, collate_fn=RawCollate(), **kw)) > 1
    assert raw.raw_bundle(make(data, collate_fn=lambda s: s, **kw)) == 1
    assert raw.raw_bundle(make(data, collate_fn=RawCollate(), transform=lambda s: s, **kw)) == 1
