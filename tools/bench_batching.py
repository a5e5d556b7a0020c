"""Padding waste and collate throughput of fixed, bucketed, token-budget and packed batches.

A synthetic corpus of lognormal document lengths (mean about ``--mean`` tokens, ``--sigma``)
is planned by each planner and every batch collated on the CPU, as a worker would.  Reported
per strategy: batches, pad fraction (padding / allocated token slots), planning time, and real
tokens per second through the collate (the loader's CPU cost per delivered token).

    python tools/bench_batching.py [--docs 50000] [--markdown]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardloader.batching import (
    BucketBatches,
    FixedBatches,
    PackedBatches,
    TokenBudgetBatches,
)
from shardloader.collate import IGNORE_INDEX, PadCollate

PAD_ID = 0


@dataclass
class Row:
    name: str
    batches: int
    pad_fraction: float
    plan_s: float
    tokens_per_s: float
    notes: str


def corpus(n: int, mean: float, sigma: float, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    mu = np.log(mean) - sigma**2 / 2  # lognormal mean = exp(mu + sigma^2 / 2)
    lengths = np.maximum(rng.lognormal(mu, sigma, n), 1).astype(np.int64)
    stream = rng.integers(1, 32000, int(lengths.sum()), dtype=np.uint16)
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    docs = [stream[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]  # views, as read
    return lengths, docs


def run(name: str, planner: Any, collate: Any, order, lengths, docs, notes: str = "") -> Row:
    t0 = time.perf_counter()
    batches = planner.plan(order, lengths, np.random.default_rng(1))
    plan_s = time.perf_counter() - t0
    report = planner.report(order, lengths, batches)
    t0 = time.perf_counter()
    for batch in batches:
        collate([{"input_ids": docs[i], "labels": docs[i]} for i in batch.tolist()])
    collate_s = time.perf_counter() - t0
    extra = []
    if report.truncated:
        extra.append(f"{len(report.truncated)} truncated")
    if report.split:
        extra.append(f"{len(report.split)} split over rows")
    if report.dropped:
        extra.append(f"{len(report.dropped)} dropped")
    return Row(
        name,
        len(batches),
        report.pad_fraction or 0.0,
        plan_s,
        (report.tokens or 0) / collate_s,
        "; ".join([notes, *extra]).strip("; "),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    lengths, docs = corpus(args.docs, args.mean, args.sigma, args.seed)
    order = np.random.default_rng(args.seed + 1).permutation(lengths.size)
    bs, seq = args.batch_size, args.seq_len
    budget = bs * seq // 4  # tokens per batch comparable to the packed rows below
    pad = {"input_ids": PAD_ID, "labels": IGNORE_INDEX}
    rows = []
    global_max = int(lengths.max())
    naive_frac = 1 - lengths.sum() / (lengths.size * global_max)
    rows.append(
        Row(
            "fixed, padded to the global max",
            -(-lengths.size // bs),
            naive_frac,
            0.0,
            float("nan"),
            f"analytic: every row {global_max} tokens",
        )
    )
    rows.append(
        run(f"fixed {bs}, dynamic padding", FixedBatches(bs), PadCollate(pad), order, lengths, docs)
    )
    for window in (4096, 16384):
        rows.append(
            run(
                f"bucketed {bs}, window {window}",
                BucketBatches(bs, window=window),
                PadCollate(pad),
                order,
                lengths,
                docs,
            )
        )
    tb = TokenBudgetBatches(budget, window=4096, oversize="truncate")
    rows.append(
        run(f"token budget {budget}, window 4096", tb, tb.make_collate(pad), order, lengths, docs)
    )
    pk = PackedBatches(seq, 8, window=4096)
    rows.append(
        run(
            f"packed 8 x {seq}, window 4096",
            pk,
            pk.make_collate(PAD_ID, field="input_ids"),
            order,
            lengths,
            docs,
        )
    )

    print(
        f"corpus: {lengths.size} docs, {int(lengths.sum())} tokens, mean {lengths.mean():.0f}, "
        f"median {np.median(lengths):.0f}, max {global_max} (lognormal sigma {args.sigma})"
    )
    header = ("strategy", "batches", "pad %", "plan s", "collate tokens/s", "notes")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
    for r in rows:
        cells = (
            r.name,
            str(r.batches),
            f"{100 * r.pad_fraction:.2f}",
            f"{r.plan_s:.2f}",
            "-" if np.isnan(r.tokens_per_s) else f"{r.tokens_per_s / 1e6:.1f} M",
            r.notes,
        )
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))


if __name__ == "__main__":
    main()
