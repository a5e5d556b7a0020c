"""The lengths planners plan from are checked and kept apart: a sidecar whose ``length`` column
lies (its hash kept consistent) is a named ManifestError before planning, with flat memory, and
the node cache's lengths file belongs to the sidecars it was built from, not to the shard bytes
alone."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pytest
from corpus import WORDS, packed_docs
from helpers import payload, write_dataset
from hostile import edit_sidecar
from memcheck import run_measured

import shardloader as sl
from shardloader.batching import PackedBatches, TokenBlocks, TokenBudgetBatches
from shardloader.errors import ManifestError

LIE = 2**32 - 1  # the most a uint32 length column holds


def rewrite_sidecar(out: str, shard: int, **columns: dict[int, int]) -> str:
    """Set ``columns[name][row] = value`` in one shard's sidecar (schema and metadata kept),
    and its ``index_sha256`` in the manifest, so every hash still agrees; return its key."""

    def set_values(table: pa.Table) -> pa.Table:
        for name, values in columns.items():
            column = table.column(name).to_numpy().copy()
            for row, value in values.items():
                column[row] = value
            at = table.schema.get_field_index(name)
            field = table.schema.field(at)
            table = table.set_column(at, field, pa.array(column, field.type))
        return table

    table = edit_sidecar(out, shard, set_values)
    return str(table.column("key")[next(iter(next(iter(columns.values()))))])


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lying-tokens")
    rng = np.random.default_rng(1)
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), 30)) for _ in range(40)]
    return packed_docs(str(root), texts, format="tokens", max_samples=10)


def _plan_in_a_child(out: str, planner: str, cache: str) -> dict:
    """Make a dataset with ``planner`` (its repr) in a child, whose memory is measured."""
    return run_measured(
        f"""
        import shardloader as sl
        from shardloader.batching import PackedBatches, TokenBlocks
        read = sl.ReadOptions(cache=sl.CacheOptions(dir={cache!r}))
        """,
        f"""
        ds = sl.ShardedDataset({out!r}, planner={planner}, read=read)
        result = len(ds)
        """,
    )


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize(
    "planner",
    [TokenBlocks(seq_len=16, rows_per_batch=2, pad_id=0), PackedBatches(16, 2, pad_id=0)],
    ids=lambda p: type(p).__name__,
)
def test_a_lying_token_length_is_a_named_error_before_planning(tmp_path, tokens, planner):
    out = str(tmp_path / "d")
    shutil.copytree(tokens, out)
    key = rewrite_sidecar(out, 2, length={3: LIE})
    got = _plan_in_a_child(out, repr(planner), str(tmp_path / "cache"))
    assert got["error"] is not None, got
    assert got["error"]["type"] == "ManifestError", got["error"]["traceback"][-2000:]
    message = got["error"]["message"]
    assert repr(key) in message and f"{LIE:,}" in message and "idx.arrow" in message
    assert got["growth"] < 100 << 20  # planning from the lie took past 6 GB
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    assert len(sl.ShardedDataset(tokens, planner=planner, read=read)) > 0  # as packed: it plans


@pytest.mark.parametrize("lie", ["length", "length and size"])
def test_a_lying_text_length_is_refused_naming_the_sample(tmp_path, lie):
    out = str(tmp_path / "d")
    write_dataset(out, [5, 5])  # tar; lengths are the payload sizes (32..160 bytes)
    columns = {"length": {1: LIE}}
    if lie == "length and size":  # the sample's size lies too: the shard's raw_bytes bound it
        columns["size"] = {1: 2**40}
    key = rewrite_sidecar(out, 1, **columns)
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    with pytest.raises(ManifestError) as err:
        sl.ShardedDataset(out, planner=TokenBudgetBatches(300), read=read)
    message = str(err.value)
    assert "shard-00001.idx.arrow" in message and "re-pack" in message
    if lie == "length":
        assert repr(key) in message and "-byte sample holds" in message
    else:
        assert "raw_bytes" in message


def test_two_datasets_with_the_same_shards_keep_their_own_lengths(tmp_path):
    """The same shard bytes (one fingerprint) with different sidecar lengths, one node cache:
    each plans with its own."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_dataset(a, [8, 8])
    shutil.copytree(a, b)
    halved = {row: 1 for row in range(8)}  # every sample of b's shards says 1 byte
    for shard in range(2):
        rewrite_sidecar(b, shard, length=halved)
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    planner = PackedBatches(seq_len=64, rows_per_batch=1, pad_id=0)
    first = sl.ShardedDataset(a, planner=planner, read=read)
    second = sl.ShardedDataset(b, planner=planner, read=read)
    assert first.manifest.fingerprint == second.manifest.fingerprint
    want_a = sum(len(payload(i)) for i in range(16))  # write_dataset's lengths
    assert first.report().total_tokens == want_a
    assert second.report().total_tokens == 16
    assert len(second) < len(first)
    files = list((tmp_path / "cache").rglob("lengths-*.npy.raw"))
    assert len(files) == 2
