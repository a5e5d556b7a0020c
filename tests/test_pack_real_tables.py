"""Tables as people have them, past the common case: a row whose every cell is null, the
folders ``datasets.Dataset.save_to_disk`` writes, and ``--on-error skip`` over a cell pack cannot
keep."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import run_cli

import shardloader as sl
from shardloader.pack import PackOptions, pack


@pytest.mark.subprocess
@pytest.mark.filterwarnings("ignore::ResourceWarning")  # webdataset leaves files to the GC
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_row_of_nulls_is_a_sample_with_every_field_missing(tmp_path):
    """Old main: the row became a tar sample of no members, and every reader refused the
    sidecar ("the sample index puts sample ... at bytes N..N, outside the ... tar")."""
    import datasets
    import webdataset as wds
    from torch.utils.data import DataLoader

    rows = {
        "caption": ["a cat", None, "a dog", None, "a bird", "a fish"],
        "score": [0.5, None, None, None, 1.5, 2.5],
    }
    os.makedirs(tmp_path / "src")
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "src/t.parquet"))
    assert pq.read_table(tmp_path / "src/t.parquet").slice(1, 1).to_pylist() == [
        {"caption": None, "score": None}
    ]
    out = tmp_path / "out"
    pack(str(tmp_path / "src"), str(out), PackOptions(max_samples=2, compression="none"))

    ds = sl.ShardedDataset(str(out), batch_size=2, collate_fn=list)  # samples as read
    got: dict[str, tuple[object, object]] = {}
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        for sample in batch:
            assert sample["__key__"] not in got, sample["__key__"]  # every row once
            got[sample["__key__"]] = (sample["caption"], sample["score"])
    assert got == {
        f"t/{i:09d}": (c, s) for i, (c, s) in enumerate(zip(*rows.values(), strict=True))
    }
    # a webdataset reader sees the sample too, with none of the manifest's fields
    seen = [
        (s["__key__"], sorted(k for k in s if not k.startswith("__")))
        for s in wds.WebDataset(str(out / "shard-00000.tar"), shardshuffle=False)
    ]
    assert seen == [("t/000000000", ["caption", "score"]), ("t/000000001", [])]
    assert run_cli("verify", out).returncode == 0


def _bad_cells(path: str, n: int = 1100) -> dict[int, str]:
    """A table of ``n`` rows (more than one read batch) with cells pack cannot keep: a null
    inside a float list, ragged nested lists; ``{row: column}`` of each bad one."""
    emb: list[list[float | None]] = [[float(i), 0.5] for i in range(n)]
    grid = [[[i, i], [0, 1]] for i in range(n)]
    emb[5] = [1.0, None]
    grid[2] = [[1], [2, 3]]  # before emb's bad row: found when rows 0..4 are encoded again
    emb[1050] = [None, None]  # in the second batch
    table = pa.table(
        {
            "emb": pa.array(emb, pa.list_(pa.float32())),
            "grid": pa.array(grid, pa.list_(pa.list_(pa.int16()))),
            "n": pa.array(range(n)),
        }
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(table, path, row_group_size=600)
    return {2: "grid", 5: "emb", 1050: "emb"}


@pytest.mark.subprocess
def test_on_error_skip_skips_the_row_of_a_cell_pack_cannot_keep(tmp_path):
    """Old main: the bad cell failed the whole pack under --on-error skip too (exit 1)."""
    bad = _bad_cells(str(tmp_path / "src/t.parquet"))
    refused = run_cli("pack", tmp_path / "src", tmp_path / "refused")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "t.parquet row 5: column 'emb' (list<element: float>): a null" in refused.stderr
    assert not (tmp_path / "refused/index.json").exists()

    r = run_cli("pack", tmp_path / "src", tmp_path / "out", "--on-error", "skip")
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "out/skipped.jsonl").read_text().splitlines()
    skips = [json.loads(line) for line in lines]
    assert [(s["file"], s["where"]) for s in skips] == [("t.parquet", f"row {i}") for i in bad]
    for s, column in zip(skips, bad.values(), strict=True):
        assert s["reason"].startswith(f"column {column!r} (")
    assert "null inside the list" in skips[1]["reason"]
    assert "differ in length" in skips[0]["reason"]
    got = {s["__key__"]: s for s in sl.ShardedDataset(str(tmp_path / "out"))}
    assert sorted(got) == [f"t/{i:09d}" for i in range(1100) if i not in bad]
    for key, sample in got.items():
        i = int(key.rsplit("/", 1)[1])
        assert sample["n"] == i and sample["emb"].tolist() == [float(i), 0.5], key
        assert np.array_equal(sample["grid"], [[i, i], [0, 1]]), key


def _png(i: int) -> bytes:
    from PIL import Image

    pixels = np.zeros((5, 7, 3), np.uint8)
    pixels[..., 0] = np.arange(7, dtype=np.uint8) * 30
    pixels[..., 1] = 40 * i
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.slow
@pytest.mark.subprocess
def test_save_to_disk_folders_pack_with_pixels_and_class_names(tmp_path):
    """Old main: refused as mixed layouts ('data-00000-of-00001.arrow' next to
    'dataset_info.json'), a DatasetDict too, naming no split."""
    import datasets
    from PIL import Image

    from shardloader.codecs import Decoder

    images = [_png(i) for i in range(5)]
    labels = [0, 2, 1, 2, 0]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "bird"])}
    )
    ds = datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "label": labels},
        features=features,
    )
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds, "test": ds.select([1, 3])}).save_to_disk(str(saved))
    assert (saved / "dataset_dict.json").exists() and (saved / "train/state.json").exists()

    whole = run_cli("pack", saved, tmp_path / "whole")
    assert whole.returncode == 2 and "Traceback" not in whole.stderr
    assert "DatasetDict" in whole.stderr and "splits test, train" in whole.stderr
    assert f"shardloader pack {saved}/train OUT" in whole.stderr

    r = run_cli("pack", saved / "train", tmp_path / "out", "--max-samples", "2")
    assert r.returncode == 0, r.stderr
    assert "state.json' (datasets save_to_disk metadata)" in r.stdout
    manifest = json.loads((tmp_path / "out/index.json").read_text())
    assert manifest["fields"] == {"image": {"codec": "image"}, "label": {"codec": "int"}}
    assert manifest["classes"] == ["cat", "dog", "bird"]
    got = {s["__key__"]: s for s in sl.ShardedDataset(str(tmp_path / "out"), decoder=Decoder())}
    assert sorted(got) == [f"data-00000-of-00001/{i:09d}" for i in range(5)]
    for i, (data, label) in enumerate(zip(images, labels, strict=True)):
        sample = got[f"data-00000-of-00001/{i:09d}"]
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(sample["image"].numpy(), want) and int(sample["label"]) == label

    # an Arrow file without the features in its schema: they come from dataset_info.json
    arrow = saved / "test/data-00000-of-00001.arrow"
    table = pa.ipc.open_stream(arrow.read_bytes()).read_all()
    assert b"huggingface" in table.schema.metadata
    table = table.replace_schema_metadata(None)
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        writer.write_table(table)
    report = pack(str(saved / "test"), str(tmp_path / "test"))
    assert list(report.manifest.classes) == ["cat", "dog", "bird"]
    assert report.manifest.fields["image"].codec == "image"


def test_a_column_named_as_the_empty_sample_marker_is_refused(tmp_path):
    """Old main: packed; the readers now drop a ``__empty__`` member, so it would vanish."""
    from shardloader.errors import UsageError

    os.makedirs(tmp_path / "src")
    pq.write_table(pa.table({"__empty__": [1, 2]}), tmp_path / "src/t.parquet")
    with pytest.raises(UsageError, match=r"t\.parquet: column '__empty__' .* rename the column"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
