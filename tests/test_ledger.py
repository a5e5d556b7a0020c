"""The exactly-once ledger: computed from the plan, it agrees with ``ds.report()`` and with
what real DataLoader workers deliver on every rank; run-time skips are appended per rank and
merged."""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from helpers import batch_ids, payload, write_dataset, write_datasets
from helpers import own_cache_dataset as make

import shardloader as sl
from shardloader.batching import FixedBatches, PackedBatches, TokenBudgetBatches
from shardloader.plan.ledger import Ledger
from shardloader.read.lengths import load_lengths
from shardloader.read.skips import merge_skips

SIZES = [1, 120, 3, 17, 59]  # 200 samples; lengths are the payload sizes (32..160)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("ledger"))
    write_dataset(d, SIZES, compression="zstd")
    return d


def spans(samples):
    return [(int(s["__index__"]), *s.get("__span__", (0, 0)), bool(s["__pad__"])) for s in samples]


def kw(case):
    return {**case, "collate_fn": spans}


CASES = [
    dict(batch_size=7, uneven="pad"),
    dict(batch_size=7, uneven="drop"),
    dict(planner=FixedBatches(9, drop_last=True), uneven="drop"),
    dict(planner=TokenBudgetBatches(300, window=16, oversize="drop"), uneven="pad"),
    dict(planner=TokenBudgetBatches(300, window=16, oversize="truncate"), uneven="drop"),
    dict(planner=PackedBatches(96, 2, window=8, long_docs="truncate", tail="drop"), uneven="drop"),
    dict(planner=PackedBatches(96, 3, window=8, long_docs="drop", fit="best"), uneven="pad"),
    dict(planner=PackedBatches(64, 2, window=8, tail="drop"), uneven="drop"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c.get("planner", c)))
def test_ledger_counts_equal_the_report(data, case):
    for world in (1, 3):
        ds = make(data, shuffle=True, seed=4, world=sl.World(0, world), **kw(case))
        report, ledger = ds.report(1), ds.ledger(1)
        counts = ledger.counts()
        assert counts["padded"] == report.padded_samples
        assert counts["dropped"] == report.dropped_samples
        assert counts["truncated"] == report.truncated_samples
        assert counts["skipped"] == 0 and ledger.num_samples == 200
        if report.truncated_tokens is not None:
            cut = sum(e.tokens for e in ledger.entries if e.status != "padded")
            assert cut == report.truncated_tokens + report.dropped_tokens
        assert all(e.reason for e in ledger.entries)
        assert (
            make(data, shuffle=True, seed=4, world=sl.World(2 % world, world), **kw(case)).ledger(1)
            == ledger
        )  # every rank computes the same ledger


@pytest.mark.parametrize("case", CASES[1:3] + CASES[5:], ids=str)
def test_delivered_plus_ledger_dropped_is_every_sample(data, case):
    """Through real workers on every rank: delivered ∪ dropped = all, disjoint; a truncated
    sample arrives in part; repeats flagged __pad__ are the ledger's padding."""
    world = 3
    ledger = make(data, shuffle=True, seed=4, world=sl.World(0, world), **kw(case)).ledger(0)
    got, pads = Counter(), Counter()
    for rank in range(world):
        ds = make(data, shuffle=True, seed=4, world=sl.World(rank, world), **kw(case))
        for batch in sl.make_loader(ds, num_workers=2):
            for i, _, _, pad in batch:
                (pads if pad else got)[i] += 1
    delivered = set(got)
    assert not delivered & set(ledger.ids("dropped"))
    assert delivered | set(ledger.ids("dropped")) == set(range(200))
    assert set(ledger.ids("truncated")) <= delivered
    if "planner" not in case or not isinstance(case["planner"], PackedBatches):
        assert all(c == 1 for c in got.values())  # whole samples: once each
        assert pads == Counter(ledger.ids("padded"))


def test_reasons_name_the_policy(data):
    ds = make(
        data,
        planner=PackedBatches(96, 2, window=8, long_docs="drop"),
        collate_fn=spans,
        shuffle=True,
    )
    reasons = {e.reason.split(":")[0] for e in ds.ledger(0).entries if e.status == "dropped"}
    assert reasons == {"long_docs='drop'"}
    ds = make(data, batch_size=7, uneven="drop", world=sl.World(0, 3))
    reasons = {e.reason for e in ds.ledger(0).entries}
    assert any("uneven='drop'" in r and "partial last batch" in r for r in reasons)
    ds = make(data, batch_size=7, uneven="pad", world=sl.World(0, 3))
    reasons = {e.reason for e in ds.ledger(0).entries}
    assert any("last batch to batch_size=7" in r for r in reasons)
    assert any("so every one of 3 ranks" in r for r in reasons)


class FailOn:
    """A transform that rejects some samples as undecodable, as corrupt records would be."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad

    def __call__(self, sample: dict) -> dict:
        if int(sample["__index__"]) in self.bad:
            raise sl.DecodeError(f"sample {sample['__index__']} is corrupt")
        return sample


def test_run_time_skips_are_appended_per_rank_and_merged(data, tmp_path):
    bad = {5, 77, 150}
    skips = str(tmp_path / "skips")
    got = Counter()
    for rank in range(2):
        ds = make(
            data,
            batch_size=8,
            shuffle=True,
            seed=3,
            transform=FailOn(bad),
            on_error="skip",
            world=sl.World(rank, 2),
        )
        ds.record_skips(skips)
        ds.set_epoch(2)
        for batch in sl.make_loader(ds, num_workers=2):
            for i, p in zip(batch_ids(batch), batch["__pad__"].tolist(), strict=True):
                if not p:
                    got[i] += 1
    assert sorted(os.listdir(skips)) == ["skips-rank00000.jsonl", "skips-rank00001.jsonl"] or (
        len(os.listdir(skips)) == 1
    )
    records = merge_skips(skips, epoch=2)
    assert [r.sample for r in records] == sorted(bad)
    assert all(r.epoch == 2 and "DecodeError" in r.reason and r.key for r in records)
    assert merge_skips(skips, epoch=1) == []
    ledger = make(data, batch_size=8, shuffle=True, seed=3, world=sl.World(0, 2)).ledger(2)
    full = ledger.with_skips(records)
    assert full.counts()["skipped"] == 3 and set(full.ids("skipped")) == bad
    assert set(got) | set(full.ids("dropped")) | set(full.ids("skipped")) == set(range(200))
    assert not set(got) & set(full.ids("skipped"))
    path = str(tmp_path / "ledger.jsonl")
    full.write(path)
    assert Ledger.read(path) == full


def test_a_reshaped_epoch_has_a_ledger_that_matches_its_report(data):
    ds = make(data, batch_size=6, shuffle=True, seed=1, world=sl.World(0, 2))
    ds.set_epoch(1)
    loader = sl.make_loader(ds)
    for step, _ in enumerate(loader):
        if step == 2:
            state = loader.state_dict()
            break
    ds = make(data, batch_size=4, shuffle=True, seed=1, uneven="pad", world=sl.World(0, 3))
    loader = sl.make_loader(ds)
    loader.load_state_dict(state)
    assert ds.reshapes == ((6, 6),)
    report, counts = ds.report(), ds.ledger().counts()
    assert counts["padded"] == report.padded_samples and counts["dropped"] == 0


def _damage(out: str, gid: int) -> str:
    """Flip a bit in sample ``gid``'s payload (an uncompressed shard of write_dataset, read in
    place); return its key."""
    manifest, _ = sl.read_manifest(out)
    for info in manifest.shards:
        path = os.path.join(out, info.path)
        with open(path, "rb") as f:
            data = bytearray(f.read())
        at = bytes(data).find(payload(gid))
        if at >= 0:
            data[at + 3] ^= 0x01
            with open(path, "wb") as f:
                f.write(bytes(data))
            return f"s/{gid:06d}"
    raise AssertionError(f"payload of sample {gid} not found")


@pytest.mark.parametrize("fmt", ["tar", "arrow", "tokens"])
@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_run_time_skip_names_the_key_its_error_names(tmp_path, fmt, batch_size):
    out = str(tmp_path / "d")
    write_dataset(out, [6, 6], fmt=fmt)
    key = _damage(out, 8)
    skips = str(tmp_path / "skips")
    ds = make(out, batch_size=batch_size, on_error="skip")
    ds.record_skips(skips)
    assert len(list(ds)) == (12 if batch_size is None else 3) - (batch_size is None)
    (record,) = merge_skips(skips)
    assert record.sample == 8 and "ChecksumError" in record.reason and repr(key) in record.reason
    assert record.key == key
    (entry,) = ds.ledger(0).with_skips([record]).entries
    assert entry.status == "skipped" and entry.key == key


@pytest.fixture(scope="module")
def mix_sources(tmp_path_factory):
    sizes = {"a": [7, 5, 9], "b": [4, 4], "c": [3]}  # 32 samples in all
    return write_datasets(str(tmp_path_factory.mktemp("mixledger")), sizes)


@pytest.mark.parametrize(
    "case", [{"batch_size": 7}, {"planner": PackedBatches(80, 2, window=8)}], ids=str
)
def test_a_mixture_ledger_counts_every_dropped_occurrence(mix_sources, case):
    """200 positions over 32 samples: each sample stands in the order about six times, so
    every occurrence uneven='drop' leaves out belongs to a sample delivered elsewhere too."""
    world, seen, tokens = 3, Counter(), 0
    for rank in range(world):
        mix = sl.Mixture(
            mix_sources,
            {"a": 1, "b": 1, "c": 2},
            epoch_samples=200,
            shuffle=True,
            seed=1,
            collate_fn=spans,
            uneven="drop",
            world=sl.World(rank, world),
            **case,
        )
        for batch in mix:
            for i, start, stop, pad in batch:
                if not pad:
                    seen[i, start, stop] += 1
                    tokens += stop - start
    got = Counter()  # occurrences that arrived: each brings every segment it has once
    for (i, _, _), n in seen.items():
        got[i] = max(got[i], n)
    order = mix.order(0)
    manifests = [sl.read_manifest(u) for u in mix_sources.values()]
    lengths = np.concatenate([load_lengths(m, b, sl.ReadOptions()) for m, b in manifests])
    report, ledger = mix.report(0), mix.ledger(0)
    missing = sum((Counter(order.tolist()) - got).values())
    assert missing > 0
    assert report.dropped_samples == ledger.counts()["dropped"] == missing
    if "batch_size" in case:  # whole samples: delivered tokens are the lengths of what came
        tokens = int(sum(lengths[i] * c for i, c in got.items()))
    assert report.tokens == tokens
    assert report.total_tokens == int(lengths[order].sum())
    cut = sum(e.tokens for e in ledger.entries if e.status in ("dropped", "truncated"))
    assert cut == report.dropped_tokens + report.truncated_tokens
