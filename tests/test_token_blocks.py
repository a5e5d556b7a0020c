"""TokenBlocks over token shards: every batch equals an independent reference built from the
packed documents, every token arrives exactly once across ranks x real DataLoader workers, the
batches do not depend on num_workers, resume continues exactly, and ``ds.report()`` counts
every token."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch
from corpus import WORDS, jsonl, packed_docs, read_back, train_tokenizer

import shardloader as sl
from shardloader.batching.blocks import TokenBlocks
from shardloader.format.tokens.format import HEADER_BYTES
from shardloader.pack import PackOptions, pack

SEQ, ROWS = 16, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Token shards of 80 documents (some empty, some many rows long), several shards."""
    root = tmp_path_factory.mktemp("blocks")
    rng = np.random.default_rng(5)
    lengths = np.minimum(rng.lognormal(2.5, 1.2, 80).astype(int), 300)
    lengths[[3, 17, 40]] = 0  # empty documents have no tokens and no segment
    texts = [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), k)) for k in lengths]
    out = packed_docs(str(root), texts, format="tokens", max_samples=23)
    manifest, samples = read_back(out)
    assert len(manifest.shards) >= 3
    docs = [np.frombuffer(f["tokens"], "<u2").astype(np.int64) for _, f in samples]
    starts = np.cumsum([0] + [s.num_samples for s in manifest.shards])
    shards = [docs[a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return out, shards, int(manifest.extra["tokenizer"]["vocab_size"])


def reference_rows(shards, seq, remainder="pad"):
    """Every row (shard, start, tokens, segment starts inside the row), by a plain loop."""
    rows = []
    for s, docs in enumerate(shards):
        stream = np.concatenate(docs) if docs else np.zeros(0, np.int64)
        doc_starts = set()
        at = 0
        for d in docs:
            if d.size:
                doc_starts.add(at)
            at += d.size
        for lo in range(0, stream.size, seq):
            piece = stream[lo : lo + seq]
            if piece.size < seq and remainder == "drop":
                continue
            inside = [p - lo for p in range(lo, lo + piece.size) if p in doc_starts]
            rows.append((s, lo, piece, sorted(set([0] + inside))))
    return rows


def reference_batch(rows, seq, per_batch, pad, repeat=False):
    """The batch dict a list of reference rows must give (PackCollate's conventions); a
    ``repeat`` (a batch repeated for equal steps) has every row flagged and labels -100."""
    ids = np.full((per_batch, seq), pad, np.int64)
    labels = np.full((per_batch, seq), -100, np.int64)
    pos = np.zeros((per_batch, seq), np.int64)
    mask = np.zeros((per_batch, seq), np.int64)
    cu = []
    for r in range(per_batch):
        starts = [0]
        n = 0
        if r < len(rows):
            _, _, piece, starts = rows[r]
            n = piece.size
            ids[r, :n] = piece
            labels[r, :n] = piece
            mask[r, :n] = 1
        bounds = list(starts) + ([n] if 0 < n < seq else []) + [seq]
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            pos[r, a:b] = np.arange(b - a)
            labels[r, a] = -100
            cu.append(r * seq + a)
    cu.append(per_batch * seq)
    flags = np.arange(per_batch) >= len(rows)
    if repeat:
        labels[:] = -100
        flags[:] = True
    return {
        "__pad__": flags,
        "input_ids": ids,
        "labels": labels,
        "position_ids": pos,
        "attention_mask": mask,
        "cu_seqlens": np.asarray(cu),
    }


def check_batch(got, want):
    for name, value in want.items():
        t = got[name]
        assert isinstance(t, torch.Tensor), name
        want_type = {"cu_seqlens": torch.int32, "__pad__": torch.bool}.get(name, torch.int64)
        assert t.dtype == want_type, name
        assert t.tolist() == value.tolist(), name
    assert got["max_seqlen"] == int(np.diff(want["cu_seqlens"]).max())


def planned(ds, rows_of):
    """The reference rows of each global batch of the dataset's plan, by row id."""
    return [[rows_of[int(r)] for r in batch] for batch in ds.global_batches()]


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_batches_match_the_reference_and_every_token_arrives_once(corpus, workers):
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ)
    ds = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True, seed=4)
    plan = planned(ds, rows)
    assert sorted(r for batch in ds.global_batches() for r in batch.tolist()) == list(
        range(len(rows))
    )  # every row (so every token) in exactly one batch
    got = list(sl.make_loader(ds, num_workers=workers))
    assert len(got) == len(plan) == len(ds)
    for batch, want_rows in zip(got, plan, strict=True):
        check_batch(batch, reference_batch(want_rows, SEQ, ROWS, vocab))
    total = sum(d.size for docs in shards for d in docs)
    real = sum(int(b["attention_mask"].sum()) for b in got)
    report = ds.report()
    assert real == total == report.tokens
    assert (report.truncated_tokens, report.dropped_tokens, report.repeated_tokens) == (0, 0, 0)
    assert report.token_slots == len(got) * ROWS * SEQ


def test_rows_inside_node_partitions_arrive_once_from_each_nodes_own_shards(corpus):
    """2 nodes x 2 ranks: a node's ranks read rows of its own span of the shuffled shards; the
    batches are still the reference's, every row once, equal steps, 2 workers."""
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ)
    full = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True)
    row_shard = np.repeat(np.arange(len(shards)), [len(reference_rows([s], SEQ)) for s in shards])
    seen, steps, node_shards = [], set(), [set(), set()]
    for rank in range(4):
        ds = full.for_rank(rank, 4, ranks_per_node=2)
        assert ds.partition == sl.Partition(2, 2)
        plan = ds.plan(0)
        got = list(sl.make_loader(ds, num_workers=2))
        steps.add(len(got))
        for j, batch in enumerate(got):
            slots, seeds = plan.slots.steps(np.array([j]))
            ids = plan.batches[int(slots[0])]
            again = plan.slots.repeats(int(seeds[0]))
            want = reference_batch([rows[int(r)] for r in ids], SEQ, ROWS, vocab, again)
            check_batch(batch, want)
            node_shards[rank // 2].update(row_shard[ids].tolist())
            if not plan.slots.repeats(int(seeds[0])):
                seen += ids.tolist()
    assert len(steps) == 1
    assert sorted(seen) == list(range(len(rows)))  # every row, so every token, once
    assert len(node_shards[0] & node_shards[1]) <= 1  # only a boundary shard is shared


@pytest.mark.parametrize(("world", "uneven"), [(2, "pad"), (3, "pad"), (3, "drop")])
def test_ranks_split_the_batches_and_even_out(corpus, world, uneven):
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ)
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)
    full = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=2, uneven=uneven)
    plan = planned(full, rows)
    n = len(plan)
    seen = []
    for rank in range(world):
        ds = full.for_rank(rank, world)
        got = list(sl.make_loader(ds, num_workers=2))
        steps = -(-n // world) if uneven == "pad" else n // world
        assert len(got) == steps == len(ds)
        for j, batch in enumerate(got):
            q = j * world + rank
            check_batch(batch, reference_batch(plan[q % n], SEQ, ROWS, vocab, q >= n))
            seen.append(q % n)
    report = full.for_rank(0, world).report()
    if uneven == "pad":
        assert sorted(set(seen)) == list(range(n))
        assert report.repeated_tokens == sum(
            int(sum(r[2].size for r in plan[q]))
            for q in range(n, -(-n // world) * world)
            for q in [q % n]
        )
    else:
        kept = n // world * world
        assert sorted(seen) == list(range(kept))
        lost = sum(r[2].size for q in range(kept, n) for r in plan[q])
        assert (
            report.tokens + report.truncated_tokens + report.dropped_tokens == report.total_tokens
        )
        assert report.total_tokens - report.tokens == lost


def test_same_batches_whatever_num_workers_and_resume_continues(corpus):
    path, _, vocab = corpus
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)

    def run(workers, stop=None, state=None):
        ds = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=9)
        loader = sl.make_loader(ds, num_workers=workers)
        if state is not None:
            loader.load_state_dict(state)
        out = []
        for batch in loader:
            out.append(batch["input_ids"].clone())
            if stop is not None and len(out) == stop:
                return out, loader.state_dict()
        return out, loader.state_dict()

    whole, _ = run(0)
    for workers in (1, 3):
        assert [b.tolist() for b in run(workers)[0]] == [b.tolist() for b in whole]
    head, state = run(2, stop=5)
    tail, _ = run(3, state=state)
    assert [b.tolist() for b in head + tail] == [b.tolist() for b in whole]
    other = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=10)
    assert [b.tolist() for b in (x["input_ids"] for x in sl.make_loader(other))] != [
        b.tolist() for b in whole
    ]


def test_remainder_and_tail_drop_are_reported(corpus):
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ, remainder="drop")
    planner = TokenBlocks(SEQ, ROWS, remainder="drop", tail="drop")
    ds = sl.ShardedDataset(path, planner=planner, shuffle=False)
    got = list(sl.make_loader(ds, num_workers=2))
    kept = len(rows) // ROWS * ROWS
    for j, batch in enumerate(got):
        check_batch(batch, reference_batch(rows[j * ROWS : (j + 1) * ROWS], SEQ, ROWS, 0))
    assert len(got) == kept // ROWS
    report = ds.report()
    total = sum(d.size for docs in shards for d in docs)
    assert report.tokens == sum(r[2].size for r in rows[:kept])
    assert report.tokens + report.truncated_tokens + report.dropped_tokens == total
    assert report.truncated_samples + report.dropped_samples > 0


def test_options_and_datasets_it_cannot_read_are_refused(corpus, tmp_path):
    path, _, vocab = corpus
    with pytest.raises(sl.UsageError, match="pad_id"):
        TokenBlocks(SEQ, ROWS)
    with pytest.raises(sl.UsageError, match="remainder"):
        TokenBlocks(SEQ, ROWS, pad_id=0, remainder="keep")
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)
    with pytest.raises(sl.UsageError, match="transform"):
        sl.ShardedDataset(path, planner=planner, transform=lambda s: s)
    with pytest.raises(sl.UsageError, match="collate_fn"):
        sl.ShardedDataset(path, planner=planner, collate_fn=list)
    with pytest.raises(sl.UsageError, match="on_error"):
        sl.ShardedDataset(path, planner=planner, on_error="skip")
    texts = ["a b c", "d e"]
    jsonl(str(tmp_path / "raw" / "d.jsonl"), texts)
    tok = train_tokenizer(str(tmp_path / "tok.json"), texts)
    pack(str(tmp_path / "raw"), str(tmp_path / "tar"), PackOptions(tokenizer=tok))
    with pytest.raises(sl.UsageError, match="--format tokens"):
        sl.ShardedDataset(str(tmp_path / "tar"), planner=planner)
    pack(str(tmp_path / "raw"), str(tmp_path / "notok"), PackOptions(format="tokens"))
    with pytest.raises(sl.UsageError, match="length field"):
        sl.ShardedDataset(str(tmp_path / "notok"), planner=planner)


def test_a_damaged_token_shard_is_named(corpus, tmp_path):
    import shutil

    path, _, vocab = corpus
    copy = str(tmp_path / "copy")
    shutil.copytree(path, copy)
    with open(os.path.join(copy, "index.json")) as f:
        shard = json.load(f)["shards"][1]["path"]
    read = sl.ReadOptions(cache=sl.CacheOptions(dir=str(tmp_path / "cache")))
    ds = sl.ShardedDataset(copy, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), read=read)
    list(sl.make_loader(ds))  # stages every shard
    (staged,) = [
        os.path.join(d, f)
        for d, _, files in os.walk(str(tmp_path / "cache"))
        for f in files
        if f.startswith(shard.replace("/", "__")) and f.endswith(".raw")
    ]
    with open(staged, "r+b") as f:
        f.seek(HEADER_BYTES + 5)  # in the token region
        byte = f.read(1)
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(sl.ChecksumError, match=rf"{shard}.*: tokens \d+\.\.\d+ \(chunk"):
        list(sl.make_loader(ds, num_workers=0))


@pytest.mark.parametrize("workers", [0, 2])
def test_buffers_are_reused_only_once_no_batch_views_them(corpus, monkeypatch, workers):
    """Batches are assembled into reused buffers: the process's own pool (no workers), or
    ring slots the main process frees when no tensor of theirs is left (workers).  Batches
    checked and dropped as they come exercise reuse; batches kept to the end must still hold
    their own tokens (their buffers were never handed out again)."""
    from shardloader.deliver import transport
    from shardloader.deliver.transport import Ring
    from shardloader.read import samplepass

    path, shards, vocab = corpus
    monkeypatch.setattr(transport, "BUNDLE_BYTES", 2 * TokenBlocks(SEQ, ROWS, 0).batch_bytes)
    monkeypatch.setattr(samplepass, "_CHUNK", 2)  # batches per buffer without workers
    monkeypatch.setattr(transport, "_POOL", transport._Pool())
    rows = reference_rows(shards, SEQ)
    ds = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True, seed=3)
    plan = planned(ds, rows)
    for _ in range(2):  # a second epoch reuses the persistent workers and their ring
        options = {"prefetch_factor": 1} if workers else {}
        loader = sl.make_loader(ds, num_workers=workers, **options)
        kept = {}
        for j, batch in enumerate(loader):
            check_batch(batch, reference_batch(plan[j], SEQ, ROWS, vocab))
            if j % 3 == 0:
                kept[j] = batch
        assert len(kept) > 3
        for j, batch in kept.items():
            check_batch(batch, reference_batch(plan[j], SEQ, ROWS, vocab))
        if workers:
            ring = loader.worker_init_fn.ring
            assert isinstance(ring, Ring) and loader.worker_init_fn.bundle == 2
            assert ring.received > ring.workers * ring.slots  # slots handed back and reused
        else:
            assert transport._POOL.reused > 0


def test_a_loop_that_stops_early_closes_its_shards(corpus):
    """Stopping inside a chunk closes the pass's shard set (and its read-ahead threads: the
    thread-leak fixture checks)."""
    import gc

    path, _, vocab = corpus
    ds = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab))
    it = iter(sl.make_loader(ds))
    next(it)
    del it
    gc.collect()


@pytest.mark.parametrize("workers", [0, 2])
def test_more_shards_than_open_streams(corpus, monkeypatch, workers):
    """Past the limit of open token shards the least recently used are closed, never one the
    batches being assembled still read (a batch here spans up to ROWS shards)."""
    from shardloader.format.tokens import rows as tokenrows

    monkeypatch.setattr(tokenrows, "STREAMS", 1)
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ)
    ds = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True, seed=8)
    plan = planned(ds, rows)
    got = list(sl.make_loader(ds, num_workers=workers))
    assert len(got) == len(plan)
    for batch, want in zip(got, plan, strict=True):
        check_batch(batch, reference_batch(want, SEQ, ROWS, vocab))


@pytest.mark.slow
def test_spawned_workers_share_the_ring(corpus, monkeypatch):
    """Spawned workers map the loader's ring through its file descriptor (forked ones
    inherit it): the same batches, and bundles arrive through slots."""
    from shardloader.deliver import transport

    monkeypatch.setattr(transport, "BUNDLE_BYTES", 2 * TokenBlocks(SEQ, ROWS, 0).batch_bytes)
    path, shards, vocab = corpus
    rows = reference_rows(shards, SEQ)
    ds = sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True, seed=6)
    plan = planned(ds, rows)
    loader = sl.make_loader(ds, num_workers=2, multiprocessing_context="spawn")
    n = 0
    for j, batch in enumerate(loader):
        check_batch(batch, reference_batch(plan[j], SEQ, ROWS, vocab))
        n += 1
    assert n == len(plan)
    assert loader.worker_init_fn.ring.received > 0


@pytest.mark.subprocess  # the moto S3 server process
def test_token_shards_on_s3_read_like_local_ones(corpus, s3_server, s3_bucket, tmp_path):
    """Token shards packed straight to s3:// (a real S3 server on 127.0.0.1): lengths come from
    the remote sidecars, shards are staged through the node cache, the batches equal the local
    dataset's, through two workers."""
    path, _, vocab = corpus
    with open(os.path.join(path, "index.json")) as f:
        manifest = json.load(f)
    url = f"s3://{s3_bucket}/tok"
    so = {"endpoint_url": s3_server}
    from shardloader.storage.store import Store

    for name in ["index.json"] + [
        p for s in manifest["shards"] for p in (s["path"], s["index_path"])
    ]:
        with open(os.path.join(path, name), "rb") as f:
            Store(f"{url}/{name}", so).write_bytes_atomic(f.read())
    planner = TokenBlocks(SEQ, ROWS, pad_id=vocab)
    read = sl.ReadOptions(storage_options=so, cache=sl.CacheOptions(dir=str(tmp_path / "c")))
    remote = sl.ShardedDataset(url, planner=planner, shuffle=True, seed=5, read=read)
    local = sl.ShardedDataset(path, planner=planner, shuffle=True, seed=5)
    got = [b["input_ids"].tolist() for b in sl.make_loader(remote, num_workers=2)]
    assert got == [b["input_ids"].tolist() for b in sl.make_loader(local)]
    assert remote.report() == local.report()


def test_the_readme_recipe_runs(corpus, tmp_path, monkeypatch):
    """The LLM batches page, first block, on token shards: full batches, every token."""
    import re

    path, shards, _ = corpus
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "llm.md"), encoding="utf-8") as f:
        page = f.read()
    snippet = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    assert "TokenBlocks" in snippet and "packed-tokens/" in snippet
    os.symlink(path, tmp_path / "packed-tokens")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet, "docs/llm.md", "exec"), scope)
    assert tuple(scope["batch"]["input_ids"].shape) == (8, 2048)
    report = scope["ds"].report()
    assert report.tokens == sum(d.size for docs in shards for d in docs)


def _rows(batches):
    """Each real row of the batches, by content (input ids where the mask is 1)."""
    return Counter(
        tuple(ids[mask.bool()].tolist())
        for b in batches
        for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True)
        if mask.any()
    )


@pytest.mark.parametrize("w1,w2", [(1, 1), (2, 3)])
def test_rows_per_batch_may_change_at_a_resume(corpus, w1, w2):
    """Elastic resume (shardloader/plan/elastic.py): the rows not yet delivered are re-cut into
    batches of the new rows_per_batch; every row once (repeats only to even out ranks)."""
    path, _, vocab = corpus
    whole = _rows(
        sl.make_loader(
            sl.ShardedDataset(path, planner=TokenBlocks(SEQ, ROWS, pad_id=vocab), shuffle=True)
        )
    )
    head, states = [], []
    for rank in range(w1):
        ds = sl.ShardedDataset(
            path,
            planner=TokenBlocks(SEQ, ROWS, pad_id=vocab),
            shuffle=True,
            world=sl.World(rank, w1),
        )
        loader = sl.make_loader(ds, num_workers=2)
        for step, batch in enumerate(loader):
            head.append(batch)
            if step == 1:
                states.append(loader.state_dict())
                break
    tail = []
    for rank in range(w2):
        ds = sl.ShardedDataset(
            path,
            planner=TokenBlocks(SEQ, ROWS + 2, pad_id=vocab),
            shuffle=True,
            world=sl.World(rank, w2),
        )
        loader = sl.make_loader(ds, num_workers=1)
        loader.load_state_dict(states[0])
        assert ds.reshapes == ((ROWS, 2 * w1),)
        report, ledger = ds.report(), ds.ledger()  # token rows: the ledger adds up to report()
        for batch in loader:
            assert tuple(batch["input_ids"].shape) == (ROWS + 2, SEQ)
            tail.append(batch)
    got = _rows(head + tail)
    if w2 == 1:
        assert got == whole
    else:
        assert not whole - got and sum((got - whole).values()) <= (w2 - 1) * (ROWS + 2)
    assert report.tokens == sum(len(r) * c for r, c in whole.items())
    assert sum(e.tokens for e in ledger.entries if e.status == "padded") == report.repeated_tokens
