"""Bad arguments are shardloader errors that name the option, never a bare ValueError or
TypeError from int(), numpy or torch deep inside (issue 12 item 6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import write_dataset

import shardloader as sl
from shardloader import vision
from shardloader.batching import collate_samples


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("usage"))
    write_dataset(d, [5, 5])
    return d


BAD_OPTIONS = {
    "seed": lambda d: sl.ShardedDataset(d, seed="x"),
    "batch_size": lambda d: sl.ShardedDataset(d, batch_size="4"),
    "block": lambda d: sl.ShuffleOptions(block="x"),
    "epoch": lambda d: sl.ShardedDataset(d).set_epoch("x"),
    "position": lambda d: sl.ShardedDataset(d).seek(0, "x"),
    "rank": lambda d: sl.ShardedDataset(d, world=sl.World("0", 2)),
    "world_size": lambda d: sl.ShardedDataset(d).for_rank(0, "2"),
    "image": lambda d: sl.Decoder(image="jpeg"),
    "custom": lambda d: sl.Decoder(custom={"cls": 3}),
    "rows_per_batch": lambda d: sl.PackCollate(8, 0, rows_per_batch="2"),
    "item_fields": lambda d: sl.DetectionCollate(item_fields=3),
    "mean": lambda d: vision.Normalize(mean=("a", 1, 2)),
    "scale": lambda d: vision.RandomResizedCrop(8, scale=("a", 1)),
    "size": lambda d: vision.RandomResizedCrop(("a", "b")),
    "p": lambda d: vision.RandomHorizontalFlip("x"),
}


@pytest.mark.parametrize("option", sorted(BAD_OPTIONS))
def test_a_bad_option_is_a_usage_error_naming_it(data, option):
    with pytest.raises(sl.UsageError, match=option):
        BAD_OPTIONS[option](data)


BAD_DATA = {
    "cannot pad": lambda: sl.PadCollate({"a": 0})(
        [{"a": np.array(["x", "y"])}, {"a": np.array(["z"])}]
    ),
    "1-D integer token array": lambda: sl.PackCollate(8, 0)([{"tokens": [[1, 2], [3]]}]),
    "channels": lambda: vision.Normalize()(torch.zeros(4, 2, 2, dtype=torch.uint8)),
    "ragged": lambda: collate_samples([{"a": 1}], ragged="x"),
}


@pytest.mark.parametrize("what", sorted(BAD_DATA))
def test_bad_batch_contents_are_usage_errors(what):
    with pytest.raises(sl.UsageError, match=what):
        BAD_DATA[what]()


def test_a_malformed_saved_state_is_a_resume_error(data):
    loader = sl.make_loader(sl.ShardedDataset(data, batch_size=2))
    with pytest.raises(sl.ResumeError, match="epoch"):
        loader.load_state_dict({**loader.state_dict(), "epoch": "x"})
    with pytest.raises(sl.ResumeError, match="dict"):
        loader.load_state_dict([1])  # type: ignore[arg-type]


def test_integers_in_any_form_are_still_accepted(data):
    ds = sl.ShardedDataset(data, seed=np.int64(3), batch_size=np.int64(2))
    ds.seek(np.int64(1), 2)
    assert ds.resume_point() == (1, 2) and ds.seed == 3
    assert sl.ShardedDataset(data, seed="3").seed == 3  # int() semantics, as before
    assert sl.PackCollate(np.int64(8), 0, rows_per_batch=np.int64(2)).seq_len == 8
