"""The layout registry: a layout written outside the package packs and reads back; detection
asks every registered layout, and ties or bad registrations are clear usage errors."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from corpus import jsonl, write

import shardloader as sl
from shardloader.errors import UsageError
from shardloader.pack import PackOptions, pack
from shardloader.pack.discover import discover
from shardloader.pack.layouts import (
    FITS,
    Layout,
    get_layout,
    layout_names,
    register_layout,
    unregister_layout,
)

# A user's module, written to tmp_path and imported: nothing in shardloader is edited.  It
# registers itself on import, as a plugin would.
TOY = '''
"""CSV files with the columns key,text: one sample per row, the text under the field txt."""

import csv
import io

from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts import (
    FITS, NO_FIT, Description, Layout, SampleRef, register_layout,
)


class CsvRows(Layout):
    name = "csv-rows"
    rank = RANK

    def detect(self, files):
        return FITS if all(f.rel.endswith(".csv") for f in files) else NO_FIT

    def describe(self, inputs):
        for f in inputs.files:
            if not f.rel.endswith(".csv"):
                raise UsageError(f"{inputs.url}: {f.rel!r} is not a .csv file")
        return Description({"txt": FieldInfo("text")})

    def enumerate(self, source, on_skip):
        for f in source.files:
            text = source.inputs.open(f).read_bytes().decode("utf-8")
            for i, row in enumerate(csv.DictReader(io.StringIO(text))):
                yield SampleRef(row["key"], (("txt", row["text"].encode()),), f.rel, f"row {i}")


LAYOUT = register_layout(CsvRows())
'''

ROWS = {
    "a.csv": [("a/0", "first"), ("a/1", "second, with a comma")],
    "b.csv": [("b/0", "third"), ("b/1", "fourth"), ("b/2", "fifth")],
}


def _load(tmp_path, monkeypatch, name: str, rank: int = 10) -> ModuleType:
    (tmp_path / f"{name}.py").write_text(
        TOY.replace("RANK", str(rank)).replace('"csv-rows"', f'"{name.replace("_", "-")}"')
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Iterator[ModuleType]:
    module = _load(tmp_path, monkeypatch, "csv_rows")
    yield module
    unregister_layout("csv-rows")
    sys.modules.pop("csv_rows", None)


def _csv_source(root) -> None:
    for rel, rows in ROWS.items():
        lines = ["key,text"] + [f'{k},"{t}"' for k, t in rows]
        write(str(root), rel, ("\n".join(lines) + "\n").encode())


def test_a_layout_from_a_temp_module_round_trips_through_pack_and_the_dataset(tmp_path, toy):
    _csv_source(tmp_path / "src")
    assert "csv-rows" in layout_names()
    # Detected (it outranks key groups, the fallback), packed by two worker processes that never
    # heard of the layout: its samples carry their bytes.
    report = pack(
        str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(max_samples=2, workers=2)
    )
    assert report.manifest.layout == "csv-rows"
    assert report.shards == 3 and report.samples == 5
    assert report.manifest.length_field == "txt"  # the default text rule applies
    got = {s["__key__"]: s["txt"] for s in sl.ShardedDataset(str(tmp_path / "out"))}
    assert got == {k: t for rows in ROWS.values() for k, t in rows}


def test_forced_layout_reaches_the_toy_and_its_errors(tmp_path, toy):
    write(str(tmp_path / "src"), "a.csv", b"key,text\nk,v\n")
    write(str(tmp_path / "src"), "notes.txt", b"x\n")
    with pytest.raises(UsageError, match="'notes.txt' is not a .csv file"):
        pack(str(tmp_path / "src"), str(tmp_path / "out"), PackOptions(layout="csv-rows"))


def test_two_layouts_that_fit_at_the_same_rank_are_ambiguous(tmp_path, toy, monkeypatch):
    _csv_source(tmp_path / "src")
    _load(tmp_path, monkeypatch, "csv_twin")
    try:
        with pytest.raises(
            UsageError,
            match=r"ambiguous layout: 'csv-rows' and 'csv-twin' both fit: as csv-rows "
            r"\(--layout csv-rows\); as csv-twin \(--layout csv-twin\); pass the --layout",
        ):
            discover(str(tmp_path / "src"))
        assert discover(str(tmp_path / "src"), "csv-twin").layout == "csv-twin"
    finally:
        unregister_layout("csv-twin")
        sys.modules.pop("csv_twin", None)


def test_a_higher_rank_wins_and_key_groups_is_the_fallback(tmp_path, toy, monkeypatch):
    _csv_source(tmp_path / "src")
    _load(tmp_path, monkeypatch, "csv_first", rank=20)
    try:
        assert discover(str(tmp_path / "src")).layout == "csv-first"
    finally:
        unregister_layout("csv-first")
        sys.modules.pop("csv_first", None)
    assert discover(str(tmp_path / "src")).layout == "csv-rows"
    unregister_layout("csv-rows")
    try:
        assert discover(str(tmp_path / "src")).layout == "key-groups"
    finally:
        register_layout(toy.LAYOUT)


def test_records_still_refuse_a_mix_whatever_else_is_registered(tmp_path, toy):
    jsonl(str(tmp_path / "src/d.jsonl"), ["x"])
    write(str(tmp_path / "src"), "t.csv", b"key,text\nk,v\n")
    with pytest.raises(
        UsageError,
        match=r"mixed layouts: record files \(e\.g\. 'd\.jsonl'\) "
        r"next to other files \(e\.g\. 't\.csv'\)",
    ):
        discover(str(tmp_path / "src"))


def test_registrations_are_checked(toy):
    with pytest.raises(UsageError, match="'csv-rows' is already registered"):
        register_layout(toy.CsvRows())
    assert register_layout(toy.CsvRows(), replace=True) is get_layout("csv-rows")
    with pytest.raises(UsageError, match="needs a Layout instance"):
        register_layout(toy.CsvRows)  # the class, not an instance

    class Auto(toy.CsvRows):
        name = "auto"

    with pytest.raises(UsageError, match="give it a name"):
        register_layout(Auto())
    with pytest.raises(UsageError, match="no layout named 'nope'"):
        unregister_layout("nope")


def test_unknown_layouts_name_the_registered_ones(toy):
    with pytest.raises(
        UsageError, match="choose one of auto, class-folders, key-groups, records, tars, csv-rows"
    ):
        PackOptions(layout="csv")
    with pytest.raises(UsageError, match="unknown layout 'csv'; choose one of auto, class-folders"):
        discover(".", "csv")


def test_a_layout_must_implement_the_contract():
    class Half(Layout):
        name = "half"

        def detect(self, files):
            return FITS

    with pytest.raises(TypeError, match="abstract"):
        Half()  # type: ignore[abstract]
