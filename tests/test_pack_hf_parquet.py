"""Parquet and Arrow as Hugging Face ``datasets``, pandas and pyarrow write them: every cell comes
back equal to what pyarrow reads (NOTE [faithful cells] in shardloader/codecs/arrowcells.py),
or pack refuses the column naming its Arrow type."""

from __future__ import annotations

import datetime
import decimal
import io
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from corpus import read_back
from helpers import run_cli

import shardloader as sl
from shardloader.codecs import Decoder
from shardloader.errors import InputError, UsageError
from shardloader.pack import PackOptions, pack

_UTC = datetime.timezone.utc


def _image(color: tuple[int, int, int], fmt: str, size: tuple[int, int] = (7, 5)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.zeros((size[1], size[0], 3), np.uint8)
    pixels[..., 0] = np.arange(size[0], dtype=np.uint8) * 30
    pixels[..., 1:] = color[1:]
    pixels[0, 0] = color
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def _hub_dump(root: str, n: int = 8) -> tuple[list[bytes], list[int]]:
    """A Hub-style image dump (``data/train-0000X-of-00002.parquet``) written by ``datasets``
    with ``Image`` and ``ClassLabel`` features: PNGs and JPEGs, as Hub vision sets mix them."""
    import datasets

    images = [_image((30 * i, 90, 200), "PNG" if i % 2 else "JPEG") for i in range(n)]
    labels = [i % 3 for i in range(n)]
    features = datasets.Features(
        {"image": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog", "bird"])}
    )
    os.makedirs(os.path.join(root, "data"))
    half = n // 2
    for part, rows in enumerate((slice(0, half), slice(half, n))):
        ds = datasets.Dataset.from_dict(
            {"image": [{"bytes": b, "path": None} for b in images[rows]], "label": labels[rows]},
            features=features,
        )
        ds.to_parquet(os.path.join(root, f"data/train-0000{part}-of-00002.parquet"))
    return images, labels


@pytest.mark.slow
@pytest.mark.subprocess
def test_hub_image_dump_packs_to_decodable_images_with_class_names(tmp_path):
    """Old main: the image became a JSON field holding repr(bytes), classes were lost."""
    from PIL import Image
    from torch.utils.data import DataLoader

    images, labels = _hub_dump(str(tmp_path / "hub"))
    packed = run_cli("pack", tmp_path / "hub", tmp_path / "out", "--max-samples", "3")
    assert packed.returncode == 0, packed.stderr
    manifest = json.loads((tmp_path / "out/index.json").read_text())
    assert manifest["fields"] == {"image": {"codec": "image"}, "label": {"codec": "int"}}
    assert manifest["classes"] == ["cat", "dog", "bird"]
    shown = run_cli("inspect", tmp_path / "out")
    assert shown.returncode == 0, shown.stderr
    assert all(name in shown.stdout for name in ("cat", "dog", "bird"))

    ds = sl.ShardedDataset(str(tmp_path / "out"), batch_size=2, decoder=Decoder())
    seen = {}
    for batch in DataLoader(ds, batch_size=None, num_workers=2):
        for key, image, label in zip(batch["__key__"], batch["image"], batch["label"], strict=True):
            seen[key] = (image, int(label))
    keys = [f"data/train-0000{i // 4}-of-00002/{i % 4:09d}" for i in range(8)]
    assert sorted(seen) == keys
    for key, data, label in zip(keys, images, labels, strict=True):
        want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(seen[key][0].numpy(), want), key
        assert seen[key][1] == label


def test_image_structs_without_bytes_read_their_path_inside_the_tables_folder(tmp_path):
    """``to_parquet`` of images loaded from files keeps only their paths (bytes null); pack
    reads those below the table's folder, and no file elsewhere that a table names."""
    import datasets

    def to_parquet(files: list[str], path: str) -> None:
        """As datasets writes them, with any path (it opens relative ones from the cwd)."""
        features = datasets.Features({"image": datasets.Image()})
        datasets.Dataset.from_dict({"image": files[:1]}, features=features).to_parquet(path)
        written = pq.read_table(path)
        assert written.column("image")[0].as_py() == {"bytes": None, "path": files[0]}
        cells = [{"bytes": None, "path": f} for f in files]
        column = pa.array(cells, written.schema.field("image").type)
        pq.write_table(pa.table({"image": column}, schema=written.schema), path)

    (tmp_path / "hub/images").mkdir(parents=True)
    files = []
    for i in range(3):
        path = tmp_path / f"hub/images/img{i}.png"
        path.write_bytes(_image((i * 50, 0, 0), "PNG"))
        files.append(str(path))
    table = str(tmp_path / "hub/t.parquet")
    to_parquet([files[0], "images/img1.png", files[2]], table)  # absolute and relative
    pack(table, str(tmp_path / "out"))
    ds = sl.ShardedDataset(str(tmp_path / "out"), decoder=Decoder(image="raw"))
    assert [s["image"] for s in ds] == [Path(f).read_bytes() for f in files]

    secret = tmp_path / "secret.png"  # outside the table's folder: never read
    secret.write_bytes(_image((1, 2, 3), "PNG"))
    for named in (str(secret), "../secret.png"):
        to_parquet([files[0], named], table)
        with pytest.raises(InputError, match=r"row 1: column 'image' .*secret\.png.*embed"):
            pack(table, str(tmp_path / "refused"))
        assert not os.path.exists(tmp_path / "refused/index.json")
    os.remove(files[1])
    to_parquet(files, table)
    with pytest.raises(InputError, match=r"row 1: column 'image' .*img1\.png.*No such file"):
        pack(table, str(tmp_path / "gone"))


def _every_type() -> pa.Table:
    """One column of each supported Arrow type, a null in each, edge values where they bite."""
    png, jpeg = _image((255, 0, 0), "PNG"), _image((0, 0, 255), "JPEG")
    return pa.table(
        {
            "flag": pa.array([True, False, None]),
            "i8": pa.array([-128, 127, 0], pa.int8()),  # a tar sample needs one member
            "u64": pa.array([2**64 - 1, 0, None], pa.uint64()),
            "f16": pa.array([np.float16(0.1), np.float16(-2), None], pa.float16()),
            "f32": pa.array([0.1, float("nan"), None], pa.float32()),
            "f64": pa.array([1e-300, float("inf"), None]),
            "ts": pa.array(
                [
                    datetime.datetime(2024, 2, 29, 23, 59, 59, 999999),
                    datetime.datetime(1, 1, 1),
                    None,
                ],
                pa.timestamp("us"),
            ),
            "ts_paris": pa.array(
                [
                    datetime.datetime(2024, 7, 1, 12, tzinfo=_UTC),
                    datetime.datetime(1999, 12, 31, tzinfo=_UTC),
                    None,
                ],
                pa.timestamp("ms", tz="Europe/Paris"),
            ),
            "ts_ns": pa.array([1_700_000_000_123_456_000, 0, None], pa.timestamp("ns", tz="UTC")),
            "day": pa.array(
                [datetime.date(2024, 2, 29), datetime.date(9999, 12, 31), None], pa.date32()
            ),
            "clock": pa.array(
                [datetime.time(23, 59, 59, 1), datetime.time(0), None], pa.time64("us")
            ),
            "price": pa.array(
                [decimal.Decimal("12345678901234567890.0001"), decimal.Decimal("-0.0000"), None],
                pa.decimal128(24, 4),
            ),
            "text": pa.array(["héllo\x00", "", None]),
            "category": pa.array(["b", "a", None]).dictionary_encode(),
            "blob": pa.array([b"\x00\xff", b"", None]),
            "image": pa.array([png, jpeg, None]),
            "photo": pa.array(
                [{"bytes": jpeg, "path": "x.jpg"}, {"bytes": png, "path": None}, None],
                pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
            ),
            "shot": pa.array([{"bytes": png, "path": None}, None, {"bytes": jpeg, "path": None}]),
            "input_ids": pa.array([[], None, [1, 2, 65535]], pa.list_(pa.uint16())),
            "big_ids": pa.array([[2**40], [0, -1], None], pa.large_list(pa.int64())),
            "embedding": pa.array([[0.1, 0.2, 0.3], None, [1, 2, 3]], pa.list_(pa.float32(), 3)),
            "grid": pa.array([[[1, 2], [3, 4]], [], None], pa.list_(pa.list_(pa.int16()))),
            "mask": pa.array([[True, False], [], None], pa.list_(pa.bool_())),
            "tags": pa.array([["a", "b"], [], None]),
            "meta": pa.array(
                [{"w": 1, "name": "x", "box": [0.5, 1.5]}, {"w": None, "name": "", "box": []}, None]
            ),
            "nothing": pa.nulls(3),
        }
    )


_CODECS = {
    "flag": "json", "i8": "int", "u64": "int", "f16": "json", "f32": "json", "f64": "json",
    "ts": "datetime", "ts_paris": "datetime", "ts_ns": "datetime", "day": "date",
    "clock": "time", "price": "decimal", "text": "text", "category": "text", "blob": "bytes",
    "image": "image", "photo": "image", "shot": "image", "input_ids": "tokens", "big_ids": "tokens",
    "embedding": "npy", "grid": "npy", "mask": "npy", "tags": "json", "meta": "json",
    "nothing": "json",
}  # fmt: skip


def _write(table: pa.Table, path: str, kind: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "parquet":
        pq.write_table(table, path, row_group_size=2)
    else:
        with pa.ipc.new_file(path, table.schema) as writer:
            writer.write_table(table, max_chunksize=2)


def _same(got, want) -> bool:
    if type(want).__name__ == "Timestamp":  # pyarrow's value of a ns column (pandas)
        want = want.to_pydatetime()
    if isinstance(want, float) and want != want:
        return isinstance(got, float) and got != got
    return type(got) is type(want) and got == want


@pytest.mark.parametrize(("kind", "fmt"), [("parquet", "tar"), ("arrow", "arrow")])
def test_every_cell_of_every_type_comes_back_equal(tmp_path, kind, fmt):
    """Old main: bool read back as 1, timestamps and decimals as str(), a float32 list as
    JSON floats, the category column was refused as invalid JSON."""
    table = _every_type()
    _write(table, str(tmp_path / f"src/t.{kind}"), kind)
    pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(format=fmt))
    ds = sl.ShardedDataset(str(tmp_path / "out"), decoder=Decoder(image="raw"))
    assert {k: v.codec for k, v in ds.manifest.fields.items()} == _CODECS
    assert ds.manifest.fields["input_ids"].dtype == "uint16"
    assert ds.manifest.fields["big_ids"].dtype == "int64"
    got = {s["__key__"]: s for s in ds}
    stored = dict(read_back(str(tmp_path / "out"))[1])  # the fields as the shards hold them
    want = (
        pq.read_table(tmp_path / "src/t.parquet").to_pylist()
        if kind == "parquet"
        else table.to_pylist()
    )
    for row, cells in enumerate(want):
        sample = got[f"t/{row:09d}"]
        for name, value in cells.items():
            if isinstance(value, dict) and name in ("photo", "shot"):  # {bytes, path}
                value = value["bytes"]
            if value is None:
                # a missing value, not a value: no member stored, None (or absent) when read
                assert name not in stored[f"t/{row:09d}"] and sample.get(name) is None, (row, name)
                continue
            have = sample[name]
            if isinstance(have, np.ndarray):
                dtype = table.schema.field(name).type
                while not (
                    pa.types.is_integer(dtype)
                    or pa.types.is_floating(dtype)
                    or pa.types.is_boolean(dtype)
                ):
                    dtype = dtype.value_type
                assert have.dtype == dtype.to_pandas_dtype(), (row, name)  # float32 stays float32
                have = have.tolist()
            same = _same(have, value) if not isinstance(value, list | dict) else have == value
            assert same, (row, name, have, value)
    assert type(got["t/000000000"]["flag"]) is bool
    assert got["t/000000000"]["ts_paris"].utcoffset() == datetime.timedelta(hours=2)


def test_pandas_category_columns_read_as_their_values(tmp_path):
    """Old main: refused as "invalid JSON"; with --on-error skip 0 of 200 rows and exit 0."""
    import pandas as pd

    frame = pd.DataFrame(
        {"split": pd.Categorical(["train", "test", "val", None] * 50), "n": range(200)}
    )
    os.makedirs(tmp_path / "src")
    frame.to_parquet(tmp_path / "src/t.parquet")
    assert pa.types.is_dictionary(
        pq.read_table(tmp_path / "src/t.parquet").schema.field("split").type
    )
    report = pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(on_error="skip"))
    assert report.samples == 200 and report.skipped == 0
    got = {s["__key__"]: s for s in sl.ShardedDataset(str(tmp_path / "out"))}
    assert [got[f"t/{i:09d}"].get("split") for i in range(8)] == ["train", "test", "val", None] * 2


@pytest.mark.parametrize(
    ("column", "typename"),
    [
        (pa.array([[("a", 1)], []], pa.map_(pa.string(), pa.int32())), "map<string, int32"),
        (pa.array([datetime.timedelta(seconds=1), None]), "duration[us]"),
        (pa.array([{"b": b"\x00"}, None]), "struct<b: binary>"),
        (
            pa.array(
                [[{"bytes": b"x", "path": "a.png"}], []],
                pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
            ),
            "list<element: struct<bytes: binary, path: string>>",
        ),
        (pa.array([[datetime.date(2020, 1, 1)], None]), "list<element: date32[day]>"),
    ],
)
def test_a_type_pack_cannot_keep_is_refused_naming_column_and_type(tmp_path, column, typename):
    """Old main: json.dumps(default=str) packed these, exit 0."""
    _write(pa.table({"ok": [1, 2], "odd": column}), str(tmp_path / "src/t.parquet"), "parquet")
    with pytest.raises(InputError) as err:
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
    assert "t.parquet" in str(err.value) and "column 'odd'" in str(err.value)
    stored = pq.read_schema(tmp_path / "src/t.parquet").field("odd").type  # as pyarrow reads it
    assert f"has Arrow type {stored}," in str(err.value) and typename in str(err.value)
    assert not os.path.exists(tmp_path / "out/index.json")


@pytest.mark.parametrize(
    ("column", "what"),
    [
        (pa.array([[1.0], [2.0, None]], pa.list_(pa.float32())), "null inside the list"),
        (pa.array([[[1.0], [2.0, 3.0]]], pa.list_(pa.list_(pa.float64()))), "differ in length"),
        (pa.array([0, 1_700_000_000_123_456_789], pa.timestamp("ns")), "finer than a microsecond"),
    ],
)
def test_a_cell_pack_cannot_keep_is_refused_naming_row_and_column(tmp_path, column, what):
    """Old main: a null became JSON null (NaN once read as floats), a ragged array a JSON list,
    nanoseconds str()."""
    _write(pa.table({"odd": column}), str(tmp_path / "src/t.parquet"), "parquet")
    with pytest.raises(InputError, match=rf"t\.parquet row \d: column 'odd' \(.*\): .*{what}"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out/index.json")


def test_files_naming_different_class_labels_are_refused(tmp_path):
    import datasets

    for i, names in enumerate((["cat", "dog"], ["dog", "cat"])):
        feats = datasets.Features({"label": datasets.ClassLabel(names=names)})
        datasets.Dataset.from_dict({"label": [0, 1]}, features=feats).to_parquet(
            str(tmp_path / f"src/p{i}.parquet")
        )
    with pytest.raises(UsageError, match=r"p1\.parquet.*\['dog', 'cat'\].*p0\.parquet"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"))


@pytest.mark.slow
@pytest.mark.subprocess
def test_skip_that_skips_every_row_is_an_error(tmp_path):
    """Old main: exit 0, a dataset of no samples."""
    _write(pa.table({"jpg": [b"not an image"] * 5}), str(tmp_path / "src/t.parquet"), "parquet")
    r = run_cli("pack", tmp_path / "src", tmp_path / "out", "--on-error", "skip")
    assert r.returncode == 1, r.stderr
    assert "every sample was skipped (5 skips)" in r.stderr and "t.parquet row 0" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "out/index.json")


@pytest.mark.slow
@pytest.mark.subprocess
def test_cli_names_an_unsupported_column_without_a_traceback(tmp_path):
    _write(
        pa.table({"span": pa.array([datetime.timedelta(1)])}),
        str(tmp_path / "src/t.parquet"),
        "parquet",
    )
    r = run_cli("pack", tmp_path / "src", tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert "column 'span' has Arrow type duration[us]" in r.stderr and "Traceback" not in r.stderr


def test_batches_keep_timestamps_decimals_and_dates_as_lists(tmp_path):
    """torch's default_collate refuses datetime and Decimal values: a batch of a table with a
    timestamp or decimal column used to end in its TypeError; those fields stay lists, as
    strings do, and the numbers beside them still stack."""
    stamps = [datetime.datetime(2024, 1, d, 12, tzinfo=_UTC) for d in (1, 2, 3, 4)]
    prices = [decimal.Decimal(f"{d}.25") for d in range(4)]
    table = pa.table(
        {
            "ts": pa.array(stamps, pa.timestamp("us", tz="UTC")),
            "price": pa.array(prices, pa.decimal128(8, 2)),
            "day": pa.array([s.date() for s in stamps], pa.date32()),
            "n": pa.array([0, 1, 2, 3], pa.int32()),
        }
    )
    _write(table, str(tmp_path / "src/t.parquet"), "parquet")
    pack(str(tmp_path / "src"), str(tmp_path / "out"))
    ds = sl.ShardedDataset(str(tmp_path / "out"), batch_size=2, shuffle=False)
    batches = list(sl.make_loader(ds, num_workers=1))
    assert [b["ts"] for b in batches] == [stamps[:2], stamps[2:]]
    assert [b["price"] for b in batches] == [prices[:2], prices[2:]]
    assert [b["day"] for b in batches] == [
        [s.date() for s in stamps[:2]],
        [s.date() for s in stamps[2:]],
    ]
    assert [b["n"].tolist() for b in batches] == [[0, 1], [2, 3]]


def test_a_list_column_of_unequal_lengths_names_the_field_and_the_collate_that_keeps_it(tmp_path):
    """torch's default_collate transposes lists, so a list<string> column (tags) of unequal
    lengths ended in its bare 'each element in list of batch should be of equal size'."""
    tags = [["cat", "pet"], ["dog"], [], ["bird", "sky", "blue"]]
    _write(
        pa.table({"tags": pa.array(tags), "n": pa.array(range(4))}),
        str(tmp_path / "src/t.parquet"),
        "parquet",
    )
    pack(str(tmp_path / "src"), str(tmp_path / "out"))
    ds = sl.ShardedDataset(str(tmp_path / "out"), batch_size=2, shuffle=False)
    with pytest.raises(UsageError) as caught:
        next(iter(sl.make_loader(ds, num_workers=1)))
    message = str(caught.value)
    assert (
        "cannot batch field 'tags': sample 't/000000000' holds a list of 2 and sample " in message
    )
    assert "'t/000000001' one of 1" in message
    assert "collate_fn=shardloader.collate.collate_samples" in message
    from shardloader.collate import collate_samples

    kept = sl.ShardedDataset(
        str(tmp_path / "out"), batch_size=2, shuffle=False, collate_fn=collate_samples
    )
    assert [b["tags"] for b in sl.make_loader(kept, num_workers=1)] == [tags[:2], tags[2:]]
