"""errors.located: the place of a failure is set once, at the boundary that knows it."""

from __future__ import annotations

import pickle

import pytest

from shardloader.errors import ChecksumError, MissingFieldError, ShardError, located


def test_the_boundary_names_the_place_once() -> None:
    with pytest.raises(ShardError) as info:
        with located("s3://bucket/shard-00001.tar.zst"):
            raise ShardError("sample 'a' is truncated")
    assert str(info.value) == "s3://bucket/shard-00001.tar.zst: sample 'a' is truncated"
    assert info.value.where == "s3://bucket/shard-00001.tar.zst"


def test_the_innermost_place_wins() -> None:
    with pytest.raises(ChecksumError) as info:
        with located("outer.tar"):
            with located("inner.tar#sample-3"):
                raise ChecksumError("sha256 differs")
    assert str(info.value) == "inner.tar#sample-3: sha256 differs"


def test_other_errors_pass_unchanged() -> None:
    with pytest.raises(KeyError) as info:
        with located("x.tar"):
            raise KeyError("k")
    assert "x.tar" not in str(info.value)


def test_the_place_survives_pickling() -> None:
    """A worker's error crosses to the main process pickled; its place must come along."""
    err = MissingFieldError("field 'label' is missing", field="label", missing=2)
    with pytest.raises(MissingFieldError):
        with located("shard-00002.tar"):
            raise err
    back = pickle.loads(pickle.dumps(err))
    assert str(back) == "shard-00002.tar: field 'label' is missing"
    assert back.field == "label" and back.missing == 2
