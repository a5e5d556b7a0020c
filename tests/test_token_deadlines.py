"""Token deadlines (``Mixture(..., by="tokens")``): after every global batch each source's
delivered tokens are within one longest document (the mixture's) of its token share, where a
document blend (Megatron's greedy rule, here for comparison) drifts by thousands of tokens;
the mixture still resumes at another world size with every document once."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import shard_name, write_manifest, write_shard

import shardloader as sl
from shardloader.manifest import FieldInfo, Manifest
from shardloader.plan.tokenblend import deadline_sources

MEANS = {"short": 50, "mid": 500, "long": 5000}  # mean document lengths in tokens
WEIGHTS = {"short": 0.5, "mid": 0.3, "long": 0.2}  # token shares
DOCS = {"short": 3000, "mid": 400, "long": 60}


def write_lengths(folder: str, lengths: np.ndarray, per_shard: int = 500) -> str:
    """A dataset whose manifest records ``lengths`` (the length field) for tiny samples."""
    import os

    os.makedirs(folder, exist_ok=True)
    fields = {"bin": FieldInfo("bytes")}
    shards = []
    for n, first in enumerate(range(0, len(lengths), per_shard)):
        ids = range(first, min(first + per_shard, len(lengths)))
        samples = [(f"d/{i:06d}", {"bin": b"x" * int(lengths[i])}, int(lengths[i])) for i in ids]
        shards.append(write_shard(folder, shard_name(n), "tar", "none", fields, samples))
    write_manifest(folder, Manifest("tar", "none", fields, shards, length_field="bin"))
    return folder


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    rng = np.random.default_rng(0)
    out, lengths = {}, {}
    for name, mean in MEANS.items():
        lens = np.maximum(rng.lognormal(np.log(mean) - 0.32, 0.8, DOCS[name]).astype(int), 1)
        lengths[name] = lens
        out[name] = write_lengths(str(root / name), lens)
    return out, lengths


def token_drift(src: np.ndarray, lens: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Per source, the largest ``|tokens_s - w_s * tokens|`` at the given prefix ends."""
    w = np.array(list(WEIGHTS.values()))
    per = np.zeros((len(src), len(w)))
    per[np.arange(len(src)), src] = lens
    got = np.cumsum(per, axis=0)[cuts - 1]
    total = got.sum(axis=1, keepdims=True)
    return np.abs(got - w[None, :] * total).max(axis=0)


def megatron_greedy(weights: np.ndarray, n: int) -> np.ndarray:
    """Megatron's blend: each position to the source furthest below ``w * (n + 1)`` documents."""
    counts, out = np.zeros(len(weights)), np.empty(n, np.int64)
    for i in range(n):
        s = int(np.argmax(weights * (i + 1) - counts))
        counts[s] += 1
        out[i] = s
    return out


@pytest.mark.slow
def test_each_global_batch_keeps_token_shares_within_one_longest_document(corpora):
    urls, lengths = corpora
    batch = 8
    mix = sl.Mixture(urls, WEIGHTS, by="tokens", batch_size=batch, seed=1, shuffle=True)
    order = mix.order(0)
    seen = [int(i) for b in sl.make_loader(mix, num_workers=2) for i in b["__index__"]]
    whole = len(order) // batch * batch  # the last batch is filled up from the start
    assert seen[:whole] == order[:whole].tolist()
    offsets = np.array([*mix.offsets.values(), sum(DOCS.values())])
    src = np.searchsorted(offsets, order, side="right") - 1
    all_lens = np.concatenate(list(lengths.values()))
    lens = all_lens[order]
    cuts = np.arange(batch, len(order) + 1, batch)  # every global batch
    longest = max(int(lengths[n].max()) for n in MEANS)  # the mixture's longest document
    drift = token_drift(src, lens, cuts)
    assert (drift <= longest).all(), (drift, longest)
    # the same sources blended by documents (Megatron's greedy rule, weights as document
    # shares by mean length, as by="tokens" did before): the token shares drift far more
    means = np.array([lengths[n].mean() for n in MEANS])
    doc_w = np.array(list(WEIGHTS.values())) / means
    greedy = megatron_greedy(doc_w / doc_w.sum(), len(order))
    cursor = np.zeros(3, np.int64)
    greedy_lens = np.empty(len(order), np.int64)
    for i, s in enumerate(greedy.tolist()):  # each source's documents in its own order
        own = order[src == s]
        greedy_lens[i] = all_lens[own[cursor[s] % len(own)]]
        cursor[s] += 1
    greedy_drift = token_drift(greedy, greedy_lens, cuts)
    assert greedy_drift.max() > 2 * drift.max()  # here about 16k tokens against 6k
    # the report counts tokens by source: their shares over the epoch are the weights
    tokens = {n: c.tokens for n, c in mix.report().sources.items()}
    total = sum(tokens.values())
    for name, w in WEIGHTS.items():
        assert abs(tokens[name] - w * total) <= longest


def test_the_deadline_rule_is_the_earliest_finish():
    """Three sources of lengths 1, 10 and 100 at token shares 1:1:2: no prefix leaves a source
    more than one longest document from its share."""
    lens = [1, 10, 100]
    src = deadline_sources(
        (1, 1, 2), [lambda c, n=n: n for n in lens], 600, np.zeros(3, np.int64),
        np.zeros(3, np.int64),
    )  # fmt: skip
    per = np.zeros((600, 3))
    per[np.arange(600), src] = np.array(lens)[src]
    got = np.cumsum(per, axis=0)
    share = np.array([0.25, 0.25, 0.5])[None, :] * got.sum(axis=1, keepdims=True)
    assert np.abs(got - share).max() <= max(lens)  # one longest document
    assert src[:12].tolist() == [0] * 10 + [1, 0]  # finish times 1..10, 10 (a tie: lower), 11


@pytest.mark.slow
def test_a_token_mixture_resumes_at_another_world_size(corpora):
    """Checkpoint at 2 ranks x 2 workers, resume at 3 ranks x 1 worker: every position of the
    mixture epoch once, in the blend's order."""
    urls, _ = corpora
    kw = dict(by="tokens", batch_size=4, seed=2, shuffle=True, epoch_samples=600)
    seen, states = [], []
    for rank in range(2):
        mix = sl.Mixture(urls, WEIGHTS, world=sl.World(rank, 2), **kw)
        loader = sl.make_loader(mix, num_workers=2)
        for step, b in enumerate(loader):
            seen += [int(i) for i, p in zip(b["__index__"], b["__pad__"], strict=True) if not p]
            if step == 9:
                states.append(loader.state_dict())
                break
    for rank in range(3):
        mix = sl.Mixture(urls, WEIGHTS, world=sl.World(rank, 3), **kw)
        loader = sl.make_loader(mix, num_workers=1)
        loader.load_state_dict(states[0])
        for b in loader:
            seen += [int(i) for i, p in zip(b["__index__"], b["__pad__"], strict=True) if not p]
    assert sorted(seen) == sorted(mix.order(0).tolist())


def test_document_planners_pack_the_token_deadline_order(corpora):
    """A padded or packing planner cuts the same deadline order into its batches: the order
    does not depend on the planner, and the epoch's tokens keep their shares."""
    from shardloader.batching import TokenBudgetBatches

    urls, lengths = corpora
    fixed = sl.Mixture(urls, WEIGHTS, by="tokens", batch_size=8, seed=1)
    planner = TokenBudgetBatches(max_tokens=30_000, oversize="truncate")
    budget = sl.Mixture(urls, WEIGHTS, by="tokens", planner=planner, seed=1)
    assert budget.order(0).tolist() == fixed.order(0).tolist()
    assert budget.weights() == pytest.approx(WEIGHTS)  # token shares, not document shares
    tokens = {n: c.tokens for n, c in budget.report().sources.items()}
    total = sum(tokens.values())
    longest = max(int(lengths[n].max()) for n in MEANS)
    for name, w in WEIGHTS.items():
        assert abs(tokens[name] - w * total) <= longest
