"""Sequence packing through ShardedDataset and real DataLoader workers: every token of long
documents arrives exactly once, batches always have the planned shape, a planner and its
collate cannot disagree, and ``ds.report()`` accounts for every token of the epoch."""

from __future__ import annotations

import ast
import os
import re
from itertools import pairwise

import numpy as np
import pytest
from corpus import docs, packed_docs, read_back

import shardloader as sl
from shardloader.batching import PackedBatches, TokenBudgetBatches, pack_rows
from shardloader.batching.fit import next_fit_rows
from shardloader.collate import PackCollate, PadCollate

ROOT = os.path.dirname(os.path.dirname(__file__))
SEQ, ROWS = 16, 4


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """Token shards of 60 documents, most longer than SEQ and many than ROWS * SEQ."""
    root = tmp_path_factory.mktemp("lm")
    texts = docs(60, seed=0, mean=3.5, longest=600)
    out = packed_docs(str(root), texts, shard_size=3000)
    manifest, samples = read_back(out)
    tokens = {key: np.frombuffer(f["tokens"], "<u2").astype(np.int64) for key, f in samples}
    assert sum(len(t) > ROWS * SEQ for t in tokens.values()) >= 15
    pad = int(manifest.extra["tokenizer"]["vocab_size"])
    return out, tokens, pad


def segments_of(batch: dict) -> list[list[int]]:
    """Real-token segments of a packed batch, read through cu_seqlens and the mask."""
    cu = batch["cu_seqlens"].tolist()
    ids, mask = batch["input_ids"].reshape(-1), batch["attention_mask"].reshape(-1)
    return [ids[a:b].tolist() for a, b in pairwise(cu) if mask[a]]


@pytest.mark.parametrize("fit", ["first", "best"])
def test_every_token_of_long_documents_arrives_once(lm, fit):
    path, tokens, pad = lm
    planner = PackedBatches(seq_len=SEQ, rows_per_batch=ROWS, window=16, pad_id=pad, fit=fit)
    ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=1)
    covered = {key: np.zeros(len(t), np.int64) for key, t in tokens.items()}
    real = slots = 0
    for batch in sl.make_loader(ds, num_workers=2):
        assert tuple(batch["input_ids"].shape) == (ROWS, SEQ)  # always, the tail batch too
        spans, keys = batch["__span__"], batch["__key__"]
        place = pack_rows if fit == "first" else next_fit_rows
        rows = place([b - a for a, b in spans], SEQ)  # the planned rows, in order
        placed = [d for row in rows for d, _, _ in row if spans[d][1] > spans[d][0]]
        got = segments_of(batch)
        assert len(got) == len(placed)
        for d, seg in zip(placed, got, strict=True):
            a, b = spans[d]
            assert seg == tokens[keys[d]][a:b].tolist()
            covered[keys[d]][a:b] += 1
        real += int(batch["attention_mask"].sum())
        slots += batch["input_ids"].numel()
    assert all((c == 1).all() for c in covered.values())  # every token, exactly once
    total = sum(len(t) for t in tokens.values())
    report = ds.report()
    assert (report.tokens, report.truncated_tokens, report.dropped_tokens) == (total, 0, 0)
    assert real == total and report.token_slots == slots
    assert report.dropped_samples == report.truncated_samples == 0


def test_a_collate_that_disagrees_with_the_planner_is_refused(lm):
    path, _, pad = lm
    planner = PackedBatches(seq_len=SEQ, rows_per_batch=ROWS)
    with pytest.raises(
        sl.UsageError,
        match=r"PackCollate rows_per_batch=None, "
        r"PackedBatches rows_per_batch=4",
    ):
        sl.ShardedDataset(path, planner=planner, collate_fn=PackCollate(SEQ, pad))
    with pytest.raises(sl.UsageError, match=r"seq_len=32.*seq_len=16"):
        sl.ShardedDataset(
            path, planner=planner, collate_fn=PackCollate(32, pad, rows_per_batch=ROWS)
        )
    with pytest.raises(sl.UsageError, match=r"field='ids'.*'tokens'"):
        sl.ShardedDataset(path, planner=planner, collate_fn=planner.make_collate(pad, "ids"))
    with pytest.raises(sl.UsageError, match=r"pad_id=0.*pad_id=3"):
        sl.ShardedDataset(
            path,
            planner=PackedBatches(SEQ, ROWS, pad_id=3),
            collate_fn=PackCollate(SEQ, 0, rows_per_batch=ROWS),
        )
    with pytest.raises(sl.UsageError, match=r"needs the tokenizer's pad id"):
        sl.ShardedDataset(path, planner=planner)  # nothing to build the collate from
    budget = TokenBudgetBatches(64, pad_to_multiple_of=8, oversize="truncate")
    with pytest.raises(
        sl.UsageError,
        match=r"pad_to_multiple_of=1.*pad_to_multiple_of=8.*"
        r"max_length=None.*max_length=64",
    ):
        sl.ShardedDataset(path, planner=budget, collate_fn=PadCollate({"tokens": pad}))
    # what the planner builds always agrees
    sl.ShardedDataset(path, planner=planner, collate_fn=planner.make_collate(pad))
    sl.ShardedDataset(path, planner=budget, collate_fn=budget.make_collate({"tokens": pad}))


def _cases(pad: int) -> list[tuple[dict, str, int, str]]:
    """(dataset arguments, uneven, world size, what the epoch must lose or repeat)."""
    return [
        (
            dict(
                planner=PackedBatches(
                    SEQ, ROWS, window=16, long_docs="truncate", tail="drop", pad_id=pad
                )
            ),
            "drop",
            3,
            "truncated dropped",
        ),
        (dict(planner=PackedBatches(SEQ, ROWS, window=16, pad_id=pad)), "pad", 4, "repeated"),
        (
            dict(planner=PackedBatches(SEQ, ROWS, long_docs="drop", pad_id=pad)),
            "drop",
            2,
            "dropped",
        ),
        (
            dict(
                planner=TokenBudgetBatches(64, oversize="truncate"),
                collate_fn=PadCollate({"tokens": pad}, max_length=64),
            ),
            "drop",
            2,
            "truncated",
        ),
        (
            dict(batch_size=5, collate_fn=PadCollate({"tokens": pad}, max_length=20)),
            "pad",
            7,
            "truncated repeated",
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_report_accounts_for_every_token(lm, case):
    """Over all ranks' steps: the report's delivered + repeated tokens are the real tokens the
    batches hold, its slots their size, and delivered + truncated + dropped every token."""
    path, tokens, pad = lm
    kw, uneven, world, losses = _cases(pad)[case]
    real = slots = 0
    keys: set[str] = set()
    for rank in range(world):
        ds = sl.ShardedDataset(
            path, shuffle=True, seed=2, uneven=uneven, world=sl.World(rank, world), **kw
        )
        for batch in sl.make_loader(ds, num_workers=0):
            real += int(batch["attention_mask"].sum())
            slots += batch["attention_mask"].numel()
            keys.update(batch["__key__"])
            if isinstance(kw.get("planner"), PackedBatches):
                assert tuple(batch["input_ids"].shape) == (ROWS, SEQ)
    report = ds.report()
    assert report.total_tokens == sum(len(t) for t in tokens.values())
    assert report.tokens + report.repeated_tokens == real
    assert report.token_slots == slots
    assert report.dropped_samples == len(tokens) - len(keys)
    for kind in ("truncated", "dropped", "repeated"):
        assert (getattr(report, f"{kind}_tokens") > 0) == (kind in losses), kind
    assert (report.truncated_samples > 0) == ("truncated" in losses)
    assert 0 < report.pad_fraction < 1


def _lm_snippet(which: int = 1) -> str:
    """The recipe block of the LLM batches page: 0 is TokenBlocks', 1 PackedBatches' (the
    first python block building that planner at seq_len 2048, wherever the page puts it)."""
    with open(os.path.join(ROOT, "docs", "llm.md"), encoding="utf-8") as f:
        page = f.read()
    marker = ("TokenBlocks(seq_len=2048", "PackedBatches(seq_len=2048")[which]
    return next(b for b in re.findall(r"```python\n(.*?)```", page, re.S) if marker in b)


def test_the_readme_recipe_runs_and_gives_full_batches(lm, tmp_path, monkeypatch):
    path, _, _ = lm
    os.symlink(path, tmp_path / "packed-text")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(_lm_snippet(), "docs/llm.md", "exec"), scope)
    assert tuple(scope["batch"]["input_ids"].shape) == (8, 2048)
    report = scope["ds"].report()
    assert report.truncated_tokens == report.dropped_tokens == 0


def _calls(source: str) -> dict[str, set[str]]:
    """Keyword arguments of each call, by the called name."""
    out: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            out.setdefault(name, set()).update(k.arg for k in node.keywords if k.arg)
    return out


def test_the_readme_recipe_is_what_train_lm_uses():
    with open(os.path.join(ROOT, "tools", "train_lm.py"), encoding="utf-8") as f:
        tool = _calls(f.read())
    for which, planner in ((0, "TokenBlocks"), (1, "PackedBatches")):
        readme = _calls(_lm_snippet(which))
        assert readme[planner] == tool[planner], planner
    readme = _calls(_lm_snippet(0))
    for name in ("ShardedDataset", "make_loader"):
        assert readme[name] <= tool[name], name
        # the tool adds only --cache-dir and, for --tp, the mesh's data-parallel dimension
        assert tool[name] - readme[name] <= {"read", "data_parallel"}, name


def _real_spans(batch: dict) -> list[tuple[str, int, int]]:
    return [
        (k, a, b)
        for k, (a, b), pad in zip(
            batch["__key__"], batch["__span__"], batch["__pad__"], strict=True
        )
        if not pad
    ]


def test_segment_batches_resume_elastically(lm):
    """Checkpoint at 2 ranks x 2 workers after 3 steps, resume at 3 ranks x 1 worker: every
    token of every document once, whatever the world size, repeats flagged __pad__."""
    path, tokens, pad = lm
    planner = PackedBatches(seq_len=SEQ, rows_per_batch=ROWS, window=16, pad_id=pad)
    seen: list[tuple[str, int, int]] = []
    states = []
    for rank in range(2):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=4, world=sl.World(rank, 2))
        ds.set_epoch(1)
        loader = sl.make_loader(ds, num_workers=2)
        for step, batch in enumerate(loader):
            seen += _real_spans(batch)
            if step == 2:
                states.append(loader.state_dict())
                break
    assert states[0] == states[1] and states[0]["position"] == 6
    for rank in range(3):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=4, world=sl.World(rank, 3))
        loader = sl.make_loader(ds, num_workers=1)
        loader.load_state_dict(states[0])
        ds.set_epoch(1)
        for batch in loader:
            assert tuple(batch["input_ids"].shape) == (ROWS, SEQ)
            seen += _real_spans(batch)
    covered = {key: np.zeros(len(t), np.int64) for key, t in tokens.items()}
    for key, a, b in seen:
        covered[key][a:b] += 1
    assert all((c == 1).all() for c in covered.values())


class FailOn:
    """A transform that rejects one sample as undecodable, as a corrupt record would be."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, sample: dict) -> dict:
        if sample["__key__"] == self.key:
            raise sl.DecodeError(f"sample {self.key!r} is corrupt")
        return sample


def test_skipped_samples_keep_the_packed_shape(lm):
    path, tokens, pad = lm
    planner = PackedBatches(seq_len=SEQ, rows_per_batch=ROWS, window=16, pad_id=pad)
    probe = sl.ShardedDataset(path, planner=planner)
    keys = {
        int(i): k
        for b in sl.make_loader(probe)
        for i, k in zip(b["__index__"], b["__key__"], strict=True)
    }
    # a document that shares its batch with others (a lone one would fail its whole batch)
    shared = next(b for b in probe.global_batches(0) if len(set(b[:, 0].tolist())) > 2)
    bad = keys[int(shared[0, 0])]
    ds = sl.ShardedDataset(path, planner=planner, transform=FailOn(bad), on_error="skip")
    batches = list(sl.make_loader(ds, num_workers=1))
    assert len(batches) == len(ds)
    assert all(tuple(b["input_ids"].shape) == (ROWS, SEQ) for b in batches)
    stand_ins = [
        (k, span)
        for b in batches
        for k, span, p in zip(b["__key__"], b["__span__"], b["__pad__"], strict=True)
        if p
    ]
    assert stand_ins and all(k != bad for k, _ in stand_ins)  # replaced, flagged __pad__
    delivered = {
        k for b in batches for k, p in zip(b["__key__"], b["__pad__"], strict=True) if not p
    }
    assert delivered == set(tokens) - {bad}
