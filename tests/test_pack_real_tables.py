"""Tables as people have them, past the common case: a row whose every cell is null, the
folders ``datasets.Dataset.save_to_disk`` writes, and ``--on-error skip`` over a cell pack cannot
keep."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import shardloader as sl
from shardloader.pack import PackOptions, pack


def _cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shardloader", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


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
    assert _cli("verify", out).returncode == 0
