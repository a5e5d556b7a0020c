"""Optional fields: pairs without a caption, img2dataset ``.json`` with nulls.

The inputs are written by webdataset's ``TarWriter`` and indexed (or packed) by the
``shardloader`` command, as a user has them.  Every caption must arrive, with ``None`` where a
sample has none; a tensor field missing in a sample is an error that says which and what to do;
``Decoder(fill=, required=)`` and ``serve --fill/--require`` fill or refuse such samples;
``inspect`` and the pack summary count presence, not 0-byte values.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tarfile

import pytest
from click.testing import CliRunner
from corpus import jpeg

import shardloader as sl
from shardloader.cli import main
from shardloader.cli.options import parse_pairs
from shardloader.errors import MissingFieldError, UsageError
from shardloader.presets import DatasetPreset
from shardloader.service.passes import warm_up
from shardloader.service.pipeline import load_pipeline

N, PER_SHARD = 24, 12


def _caption(i: int) -> str | None:
    return None if i % 4 == 0 else f"a photo, number {i}"  # 6 of 24 without


def _samples(no_cls: int | None = None) -> list[dict]:
    out = []
    for i in range(N):
        s = {"__key__": f"{i:09d}", "jpg": jpeg(i, 8, 8)}
        if _caption(i) is not None:
            s["txt"] = _caption(i)
        if i != no_cls:
            s["cls"] = i % 3
        # img2dataset's metadata: nulls where a value is unknown
        s["json"] = {
            "key": f"{i:09d}",
            "caption": _caption(i),
            "exif": None if i % 3 else "{}",
            "status": "success",
            "error_message": None,
        }
        out.append(s)
    return out


def _write_tars(folder: str, samples: list[dict]) -> None:
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    for n in range(N // PER_SHARD):
        with wds.TarWriter(os.path.join(folder, f"pairs-{n:05d}.tar")) as sink:
            for s in samples[n * PER_SHARD : (n + 1) * PER_SHARD]:
                sink.write(s)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "shardloader", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> str:
    """Two webdataset tars of image-text pairs, 6 of 24 without a caption, indexed in place."""
    folder = str(tmp_path_factory.mktemp("pairs"))
    _write_tars(folder, _samples())
    _cli("index", folder, folder, "-q")
    return folder


def _read(tmp_path, url: str, **kw) -> sl.ShardedDataset:
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    return sl.ShardedDataset(url, read=read, **kw)


@pytest.mark.slow
@pytest.mark.subprocess
def test_every_caption_arrives_with_none_where_absent(pairs, tmp_path):
    """Before: a batch whose first sample had no caption came back without ``txt`` (the
    other sample's caption dropped), otherwise torch's bare KeyError / TypeError."""
    ds = _read(tmp_path, pairs, batch_size=2, shuffle=True, seed=3)
    captions, meta = {}, {}
    for batch in sl.make_loader(ds, num_workers=2):
        assert "txt" in batch and "json" in batch, sorted(batch)
        assert len(batch["txt"]) == len(batch["__key__"]) == 2
        assert batch["jpg"].shape == (2, 3, 8, 8)
        captions.update(zip(batch["__key__"], batch["txt"], strict=True))
        meta.update(zip(batch["__key__"], batch["json"]["caption"], strict=True))
        assert batch["json"]["error_message"] == [None, None]
    want = {f"{i:09d}": _caption(i) for i in range(N)}
    assert captions == want and meta == want
    assert sum(c is None for c in captions.values()) == 6


@pytest.mark.slow
@pytest.mark.subprocess
def test_a_tensor_field_missing_names_field_count_sample_shard_and_remedy(tmp_path):
    folder = str(tmp_path / "nocls")
    _write_tars(folder, _samples(no_cls=15))  # the second shard's fourth sample
    _cli("index", folder, folder, "-q")
    ds = _read(tmp_path, folder, batch_size=2)
    with pytest.raises(MissingFieldError) as caught:
        list(sl.make_loader(ds, num_workers=2))
    message = str(caught.value)
    assert "field 'cls' is missing (absent or null) in 1 of 2 samples" in message
    assert "sample '000000015'" in message and "pairs-00001.tar" in message
    assert "Decoder(fill={'cls': ...})" in message and "Decoder(required=('cls',))" in message
    # the remedy works: filled, the batch stacks
    ds = _read(tmp_path, folder, batch_size=2, decoder=sl.Decoder(fill={"cls": -1}))
    labels = [int(c) for b in sl.make_loader(ds, num_workers=2) for c in b["cls"]]
    assert labels == [-1 if i == 15 else i % 3 for i in range(N)]


@pytest.mark.slow
@pytest.mark.subprocess
def test_fill_gives_a_value_and_required_refuses_or_skips(pairs, tmp_path, caplog):
    ds = _read(tmp_path, pairs, batch_size=4, decoder=sl.Decoder(fill={"txt": ""}))
    got = [t for b in sl.make_loader(ds, num_workers=2) for t in b["txt"]]
    assert got == [_caption(i) or "" for i in range(N)]

    strict = sl.Decoder(required=("txt",))
    with pytest.raises(MissingFieldError, match=r"pairs-00000\.tar.*'000000000'.*'txt'"):
        list(sl.make_loader(_read(tmp_path, pairs, batch_size=4, decoder=strict)))

    ds = _read(tmp_path, pairs, batch_size=4, decoder=strict, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="shardloader.read.loading"):
        batches = list(sl.make_loader(ds, num_workers=0))
    kept = [
        k for b in batches for k, pad in zip(b["__key__"], b["__pad__"], strict=True) if not pad
    ]
    assert kept == [f"{i:09d}" for i in range(N) if _caption(i) is not None]
    assert all(t is not None for b in batches for t in b["txt"])
    skipped = [f"{i:09d}" for i in range(N) if _caption(i) is None]
    assert all(f"'{k}'" in caplog.text for k in skipped)


def test_nested_nulls_fill_by_dotted_name_and_options_are_checked():
    with pytest.raises(MissingFieldError, match="'json.width' is missing .* 1 of 2"):
        sl.collate.collate_samples([{"json": {"width": 8}}, {"json": {"width": None}}])
    with pytest.raises(UsageError, match="both filled and required"):
        sl.Decoder(fill={"txt": ""}, required=("txt",))
    with pytest.raises(UsageError, match="tuple of field names"):
        sl.Decoder(required=("",))
    fill = parse_pairs([" txt=", "cls=-1", "note=n/a"], "--fill", "FIELD=VALUE")
    assert fill == {"txt": "", "cls": -1, "note": "n/a"}
    with pytest.raises(UsageError, match="--fill 'txt': give FIELD=VALUE"):
        parse_pairs(["txt"], "--fill", "FIELD=VALUE")


@pytest.mark.slow
@pytest.mark.subprocess
def test_inspect_and_pack_count_presence_not_zero_bytes(pairs, tmp_path):
    shown = _cli("inspect", pairs).stdout
    assert "txt in 18 of 24 samples" in shown
    assert "json in" not in shown and "jpg in" not in shown  # present in every sample
    # the same pairs as files (img2dataset's folder output), packed with captions measured
    src = tmp_path / "folder"
    for name in sorted(os.listdir(pairs)):
        if name.endswith(".tar"):
            with tarfile.open(os.path.join(pairs, name)) as tar:
                tar.extractall(src, filter="data")
    out = str(tmp_path / "packed")
    summary = _cli("pack", str(src), out, "--text-field", "txt").stdout
    assert "txt in 18 of 24 samples" in summary
    info = json.loads(_cli("inspect", out, "--json").stdout)  # key groups fill `image` from jpg
    assert info["presence"] == {"cls": 24, "image": 24, "json": 24, "txt": 18}
    # absent captions are missing, not 0-byte ones
    assert info["lengths"]["count"] == 18 and info["lengths"]["min"] > 0


@pytest.mark.slow
@pytest.mark.subprocess
def test_serve_warm_up_survives_missing_captions_and_takes_fill(pairs, tmp_path):
    """Before: warm-up died with torch's bare KeyError / TypeError."""
    cache = str(tmp_path / "cache")
    ds = load_pipeline(pairs, DatasetPreset(batch_size=2, transform="none", cache_dir=cache))
    warm_up(ds)
    ds = load_pipeline(
        pairs,
        DatasetPreset(batch_size=2, transform="none", cache_dir=cache, fill={"txt": ""}),
    )
    assert ds.decoder.fill == {"txt": ""}
    assert next(iter(sl.make_loader(ds)))["txt"] == ["", "a photo, number 1"]
    ds = load_pipeline(pairs, DatasetPreset(batch_size=2, cache_dir=cache, required=("txt",)))
    assert (ds.decoder.required, ds.on_error) == (("txt",), "skip")
    result = CliRunner().invoke(
        main, ["serve", "test_service_support:small_factory", "--fill", "txt=", "--require", "jpg"]
    )
    assert result.exit_code == 2
    assert "--fill, --require configure a dataset path" in result.output
