"""``index`` adopts Parquet files in place, as ``datasets`` writes them (Hub-style splits, an
``Image`` and a ``ClassLabel`` feature): one manifest a split, rows read by row group, every
guarantee of a packed dataset (exactly once, resume, ranks, checksums), local and on S3."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import torchrun

import shardloader as sl
from shardloader.errors import ChecksumError, UsageError
from shardloader.pack import PackOptions, pack
from shardloader.pack.index_existing import index_shards
from shardloader.read.verify import verify_dataset

datasets = pytest.importorskip("datasets")

CLASSES = ["cat", "dog", "eel"]
SPLITS = {"train": [(0, 23), (23, 17)], "test": [(100, 9)]}  # (first id, rows) per file


def _png(i: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = (np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3) + i) % 251
    Image.fromarray(pixels.astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _rows(first: int, n: int) -> dict[str, list[Any]]:
    ids = range(first, first + n)
    return {
        "image": [{"bytes": _png(i), "path": None} for i in ids],
        "label": [i % 3 for i in ids],
        "text": [f"caption {i}" for i in ids],
    }


def hub_dump(root: Path) -> Path:
    """``data/<split>-0000k-of-0000n.parquet`` as ``Dataset.to_parquet`` writes them, row
    groups of 8 rows so a file has several."""
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "label": datasets.ClassLabel(names=CLASSES),
            "text": datasets.Value("string"),
        }
    )
    data = root / "data"
    data.mkdir(parents=True)
    for split, files in SPLITS.items():
        for k, (first, n) in enumerate(files):
            ds = datasets.Dataset.from_dict(_rows(first, n), features=features)
            ds.to_parquet(str(data / f"{split}-{k:05d}-of-{len(files):05d}.parquet"), batch_size=8)
    return root


def _expected(split: str) -> dict[str, tuple[bytes, int, str]]:
    """key → (png, label, text) of every row of a split, keys as index gives them."""
    out = {}
    for k, (first, n) in enumerate(SPLITS[split]):
        stem = f"{split}-{k:05d}-of-{len(SPLITS[split]):05d}"
        for row in range(n):
            i = first + row
            out[f"{stem}/{row:09d}"] = (_png(i), i % 3, f"caption {i}")
    return out


def _check_once(batches: list[dict[str, Any]], split: str) -> None:
    """Every row of ``split`` exactly once, its image's pixels PIL's, label and text its own."""
    from PIL import Image

    want = _expected(split)
    seen: list[str] = []
    for b in batches:
        real = ~b["__pad__"].bool()
        for j, key in enumerate(b["__key__"]):
            if not real[j]:
                continue
            seen.append(key)
            png, label, text = want[key]
            pil = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).transpose(2, 0, 1)
            assert np.array_equal(b["image"][j].numpy(), pil), key
            assert int(b["label"][j]) == label and b["text"][j] == text, key
    assert sorted(seen) == sorted(want)


def _read_all(url: str, workers: int = 2, **kw: Any) -> list[dict[str, Any]]:
    ds = sl.ShardedDataset(url, batch_size=4, shuffle=True, seed=3, **kw)
    return list(sl.make_loader(ds, num_workers=workers))


@pytest.mark.subprocess
def test_hub_dump_indexes_per_split_and_streams_exactly_once(tmp_path):
    root = hub_dump(tmp_path / "hub")
    r = subprocess.run(
        [sys.executable, "-m", "shardloader", "index", str(root / "data"), str(root), "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "40 samples into" in r.stdout and "index.train.json" in r.stdout, r.stdout
    assert not (root / "index.json").exists()
    for split, files in SPLITS.items():
        manifest = json.loads((root / f"index.{split}.json").read_text())
        assert manifest["format"] == "parquet" and manifest["classes"] == CLASSES
        assert {f: v["codec"] for f, v in manifest["fields"].items()} == {
            "image": "image",
            "label": "int",
            "text": "text",
        }
        assert [s["num_samples"] for s in manifest["shards"]] == [n for _, n in files]
        groups = manifest["extra"]["parquet"]["row_groups"]
        for shard, (_, n) in zip(manifest["shards"], files, strict=True):
            size = os.path.getsize(root / shard["path"])
            assert shard["bytes"] == shard["raw_bytes"] == size
            spans = groups[shard["path"]]
            assert sum(rows for _, _, rows in spans) == n and len(spans) == -(-n // 8)
            assert all(0 < a and a + b <= size for a, b, _ in spans)
        # a 2-worker DataLoader, shuffled: every row once, pixels equal to PIL's
        _check_once(_read_all(str(root / f"index.{split}.json")), split)
    assert verify_dataset(str(root / "index.train.json")).ok
    # nothing was rewritten: the files are the ones datasets wrote, byte for byte
    assert sorted(os.listdir(root / "data")) == sorted(
        [f"{s}-{k:05d}-of-{len(f):05d}.parquet" for s, f in SPLITS.items() for k in range(len(f))]
        + [
            f"{s}-{k:05d}-of-{len(f):05d}.idx.arrow"
            for s, f in SPLITS.items()
            for k in range(len(f))
        ]
    )


def test_a_changed_file_fails_its_row_checksums_and_verify(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # pyarrow-written, uncompressed and without statistics: one changed cell keeps the size,
    # so the manifest's size check passes and the row checksums must catch it
    plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}
    (tmp_path / "d").mkdir()
    target = tmp_path / "d" / "t.parquet"
    texts = [f"caption {i:02d}" for i in range(30)]
    pq.write_table(pa.table({"text": texts}), target, row_group_size=8, **plain)
    index_shards([str(target)], str(tmp_path))
    size = target.stat().st_size
    texts[13] = "caption 31"
    pq.write_table(pa.table({"text": texts}), target, row_group_size=8, **plain)
    assert target.stat().st_size == size
    ds = sl.ShardedDataset(str(tmp_path), batch_size=30, shuffle=False, on_error="raise")
    with pytest.raises(ChecksumError, match=r"'t/000000013'.*run `shardloader index` again"):
        list(sl.make_loader(ds, num_workers=0))
    report = verify_dataset(str(tmp_path))
    assert [b.path for b in report.bad] == ["d/t.parquet"]


def test_a_cell_over_the_member_limit_is_refused_naming_the_flag(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardloader.errors import ShardError

    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"text": ["short", "x" * 5000]}), tmp_path / "d" / "t.parquet")
    with pytest.raises(ShardError, match=r"row 1: column 'text'.*--max-member-size"):
        index_shards([str(tmp_path / "d")], str(tmp_path), max_member_bytes=1000)
    assert not (tmp_path / "index.json").exists()


def test_resume_with_other_workers_delivers_the_rest_exactly_once(tmp_path):
    root = hub_dump(tmp_path / "hub")
    index_shards([str(root / "data")], str(root))
    url = str(root / "index.train.json")
    ds = sl.ShardedDataset(url, batch_size=4, shuffle=True, seed=5)
    loader = sl.make_loader(ds, num_workers=2)
    first = []
    for step, batch in enumerate(loader):
        first.append(batch)
        if step == 3:
            state = loader.state_dict()
            break
    del loader
    ds2 = sl.ShardedDataset(url, batch_size=4, shuffle=True, seed=5)
    loader2 = sl.make_loader(ds2, num_workers=1)
    loader2.load_state_dict(state)
    _check_once(first + list(loader2), "train")


@pytest.mark.slow
@pytest.mark.subprocess
def test_two_gloo_ranks_read_an_indexed_split_exactly_once(tmp_path):
    root = hub_dump(tmp_path / "hub")
    index_shards([str(root / "data")], str(root))
    out = str(tmp_path / "seen.json")
    torchrun(str(tmp_path), "dist_job.py", 2, str(root / "index.train.json"), out, "2")
    ranks = json.loads(Path(out).read_text())
    for epoch in ("0", "1"):
        ids = [
            i
            for r in ranks
            for batch, pads in zip(r["seen"][epoch]["ids"], r["seen"][epoch]["pads"], strict=True)
            for i, pad in zip(batch, pads, strict=True)
            if not pad
        ]
        assert sorted(ids) == list(range(40))
        assert len({r["seen"][epoch]["len"] for r in ranks}) == 1  # equal steps


@pytest.mark.slow
def test_hub_dump_on_s3_indexes_in_place_and_streams_exactly_once(
    s3_server: str, s3_bucket: str, s3_client: Any, tmp_path: Path
):
    root = hub_dump(tmp_path / "hub")
    names = sorted(os.listdir(root / "data"))
    for name in names:
        s3_client.upload_file(str(root / "data" / name), s3_bucket, f"ds/data/{name}")
    opts = {"endpoint_url": s3_server}
    url = f"s3://{s3_bucket}/ds"
    r = index_shards([f"{url}/data/{n}" for n in names], url, storage_options=opts)
    assert sorted(r.splits) == ["test", "train"]
    listed = {o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert {"ds/index.train.json", "ds/index.test.json"} <= listed
    read = sl.ReadOptions(storage_options=opts, cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    for split in SPLITS:
        _check_once(_read_all(f"{url}/index.{split}.json", read=read), split)


def test_what_index_and_pack_refuse_says_what_to_do(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    import pyarrow as pa
    import pyarrow.parquet as pq

    # an HF image cell with a path and no bytes: index does not follow paths
    image = pa.array(
        [{"bytes": None, "path": "x.png"}],
        pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    pq.write_table(pa.table({"image": image}), root / "a.parquet")
    with pytest.raises(
        Exception, match=r"a\.parquet: row 0: column 'image'.*embed the files' bytes"
    ):
        index_shards([str(root / "a.parquet")], str(root))
    assert not (root / "index.json").exists()
    # files whose columns read as different codecs: refused, the old manifest kept
    (root / "a.parquet").unlink()
    pq.write_table(pa.table({"x": [1, 2]}), root / "a.parquet")
    index_shards([str(root / "a.parquet")], str(root))
    before = (root / "index.json").read_bytes()
    pq.write_table(pa.table({"x": ["one", "two"]}), root / "b.parquet")
    with pytest.raises(UsageError, match=r"b\.parquet: column 'x' reads as text but as int"):
        index_shards([str(root)], str(root), overwrite=True)
    assert (root / "index.json").read_bytes() == before
    # pack cannot write Parquet shards, and says what index is for
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("x")
    with pytest.raises(UsageError, match="shardloader index"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(format="parquet"))


def _plain_file(path: Path, blobs: list[bytes], texts: list[str]) -> None:
    """Uncompressed, no dictionary or statistics: a cell changed to one of the same size
    keeps the file's size, so only checksums can tell."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain = {"compression": "none", "use_dictionary": False, "write_statistics": False}
    table = pa.table({"blob": pa.array(blobs, pa.binary()), "n": list(range(len(texts)))})
    table = table.append_column("text", pa.array(texts))
    pq.write_table(table, path, row_group_size=8, **plain)


def _texts(url: str, **read: Any) -> dict[str, tuple[int, str]]:
    ds = sl.ShardedDataset(
        url,
        batch_size=5,
        shuffle=False,
        on_error="raise",
        read=sl.ReadOptions(fields=("n", "text"), **read),
    )
    out = {}
    for batch in sl.make_loader(ds, num_workers=1):
        assert set(batch) - {"__key__", "__index__", "__pad__"} == {"n", "text"}
        for key, n, text in zip(batch["__key__"], batch["n"].tolist(), batch["text"], strict=True):
            out[key] = (n, text)
    return out


def test_projection_reads_and_checks_only_the_named_columns(tmp_path):
    """ReadOptions(fields=...) delivers those fields only; their cells are checked against
    per-column checksums, so a column left out is not read: damage there does not fail a
    projected read, damage in a named column does, and names the column."""
    from shardloader.manifest import SampleIndex

    (tmp_path / "d").mkdir()
    target = tmp_path / "d" / "t.parquet"
    blobs = [bytes([65 + i % 26]) * 40 for i in range(30)]
    texts = [f"caption {i:02d}" for i in range(30)]
    _plain_file(target, blobs, texts)
    index_shards([str(target)], str(tmp_path))
    sidecar = tmp_path / "d" / "t.idx.arrow"
    assert set(SampleIndex.from_arrow_bytes(sidecar.read_bytes()).field_checksums or {}) == {
        "blob",
        "n",
        "text",
    }
    size = target.stat().st_size
    blobs[13] = b"Z" * 40  # the blob column changed, the file's size not
    _plain_file(target, blobs, texts)
    assert target.stat().st_size == size
    want = {f"t/{i:09d}": (i, texts[i]) for i in range(30)}
    assert _texts(str(tmp_path)) == want  # the blob column is neither read nor checked
    whole = sl.ShardedDataset(str(tmp_path), batch_size=30, shuffle=False, on_error="raise")
    with pytest.raises(ChecksumError, match=r"'t/000000013' \(row 13\) does not match its"):
        list(sl.make_loader(whole, num_workers=0))
    # a named column changed: the projected read fails on that row, naming the column
    texts[21] = "caption 99"
    _plain_file(target, blobs, texts)
    with pytest.raises(ChecksumError, match=r"'t/000000021'.*the checksum of its column 'text'"):
        _texts(str(tmp_path))
    # a sidecar from before per-column checksums: whole rows are read and checked, as before
    texts[21] = "caption 21"
    _plain_file(target, blobs, texts)
    old = SampleIndex.from_arrow_bytes(sidecar.read_bytes())
    data = SampleIndex(old.keys, old.offsets, old.sizes, checksums=old.checksums).to_arrow_bytes()
    sidecar.write_bytes(data)
    manifest = json.loads((tmp_path / "index.json").read_text())
    manifest["shards"][0]["index_sha256"] = hashlib.sha256(data).hexdigest()
    (tmp_path / "index.json").write_text(json.dumps(manifest))
    with pytest.raises(ChecksumError, match=r"'t/000000013' \(row 13\) does not match its"):
        _texts(str(tmp_path))
    with pytest.raises(UsageError, match=r"'txt', which is not a field.*blob, n, text"):
        sl.ShardedDataset(str(tmp_path), batch_size=5, read=sl.ReadOptions(fields=("txt",)))


def test_a_wide_compressed_file_keeps_its_sidecar_within_bounds_and_projects(tmp_path):
    """Per-column checksums take 8 bytes a cell: for many small, well-compressed columns they
    would outgrow the bound a reader holds a sidecar to, so such a file is indexed without them
    and a projected read of it reads and checks whole rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardloader.manifest import SampleIndex

    (tmp_path / "d").mkdir()
    n = 20000
    table = pa.table({f"c{i:02d}": pa.array([i] * n, pa.int8()) for i in range(20)})
    pq.write_table(table, tmp_path / "d" / "w.parquet")
    index_shards([str(tmp_path / "d" / "w.parquet")], str(tmp_path))
    sidecar = SampleIndex.from_arrow_bytes((tmp_path / "d" / "w.idx.arrow").read_bytes())
    assert sidecar.field_checksums is None and sidecar.checksums is not None
    read = sl.ReadOptions(fields=("c07",))
    ds = sl.ShardedDataset(str(tmp_path), batch_size=4, shuffle=True, seed=1, read=read)
    batch = next(iter(sl.make_loader(ds, num_workers=0)))
    assert set(batch) == {"__key__", "__index__", "__pad__", "c07"}
    assert batch["c07"].tolist() == [7, 7, 7, 7]
