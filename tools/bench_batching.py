"""Padding waste and collate throughput of fixed, bucketed, token-budget and packed batches,
and where the tokens of long documents go.

1. A synthetic corpus of lognormal document lengths (mean about ``--mean`` tokens, ``--sigma``)
   is planned by each planner and every batch collated on the CPU, as a worker would.  Reported
   per strategy: batches, pad fraction (padding / allocated token slots), planning time, and
   real tokens per second through the collate (the loader's CPU cost per delivered token).
2. Long documents (``--long-mean``, or the token counts of a packed dataset: ``--dataset
   URL``) are packed into ``--rows`` x ``--seq-len`` batches under each long-document policy;
   reported: tokens delivered, truncated and dropped (the planner's ``report``), padding, and
   planning time.  "pieces in one batch" is the rule before segment batches: a document's
   pieces had to share a batch, so it was cut to rows x seq_len tokens.

3. Packing modes: first-fit against best-fit decreasing (``PackedBatches(fit=...)``) for each
   long-document mode (``"split"``, and the no-split modes ``"truncate"`` and ``"drop"``, in
   which no document crosses rows) and window sizes, on the part-1 corpus and on the long
   documents; reported: pad %, padding tokens, cut tokens (truncated + dropped), planning time
   (median of ``--repeat`` runs; padding is deterministic).

    python tools/bench_batching.py [--docs 50000] [--dataset packed-text/] [--markdown]
"""

from __future__ import annotations

import argparse
import os
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
from shardloader.manifest import SampleIndex, read_manifest
from shardloader.storage import Store
from shardloader.storage.store import join

PAD_ID = 0


@dataclass
class Row:
    name: str
    batches: int
    pad_fraction: float
    plan_s: float
    tokens_per_s: float
    notes: str
    cpu_ns_per_token: float = float("nan")  # of the collate loop


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
    t0, c0 = time.perf_counter(), time.process_time()  # one process: its CPU is the tree's
    for batch in batches:
        if batch.ndim == 2:  # segments (id, start, stop), cut as the dataset cuts them
            items = [docs[i][a:b] for i, a, b in batch.tolist()]
        else:
            items = [docs[i] for i in batch.tolist()]
        collate([{"input_ids": d, "labels": d} for d in items])
    collate_s = time.perf_counter() - t0
    collate_cpu = time.process_time() - c0
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
        collate_cpu / max(report.tokens or 0, 1) * 1e9,
    )


def dataset_lengths(url: str) -> np.ndarray:
    """Per-sample lengths (token counts) recorded in a packed dataset's sidecars."""
    manifest, base = read_manifest(url)
    parts = []
    for info in manifest.shards:
        idx = SampleIndex.from_arrow_bytes(Store(join(base, info.index_path)).read_bytes())
        if idx.lengths is None:
            raise SystemExit(f"{url}: {info.index_path} records no lengths; pack with --tokenizer")
        parts.append(np.asarray(idx.lengths, np.int64))
    return np.concatenate(parts)


def long_documents(args: argparse.Namespace) -> None:
    if args.dataset:
        lengths, source = dataset_lengths(args.dataset), args.dataset
    else:
        rng = np.random.default_rng(args.seed)
        mu = np.log(args.long_mean) - args.sigma**2 / 2
        lengths = np.maximum(rng.lognormal(mu, args.sigma, args.long_docs), 1).astype(np.int64)
        source = f"lognormal, mean {args.long_mean:.0f}, sigma {args.sigma}"
    seq, rows = args.seq_len, args.rows
    order = np.random.default_rng(args.seed + 1).permutation(lengths.size)
    total = int(lengths.sum())
    print(
        f"\nlong documents ({source}): {lengths.size} docs, {total} tokens, median "
        f"{np.median(lengths):.0f}, {int((lengths > seq).sum())} longer than seq_len {seq}, "
        f"{int((lengths > rows * seq).sum())} longer than {rows} x {seq}"
    )
    table = [("strategy", "tokens delivered", "truncated", "dropped", "pad %", "plan s")]
    kept = int(np.minimum(lengths, rows * seq).sum())
    table.append(
        (
            f"pieces in one batch (cut to {rows} x {seq})",
            f"{kept} ({kept / total:.1%})",
            str(total - kept),
            "0",
            "-",
            "-",
        )
    )
    for policy in ("split", "truncate", "drop"):
        planner = PackedBatches(seq, rows, long_docs=policy)
        t0 = time.perf_counter()
        batches = planner.plan(order, lengths, np.random.default_rng(1))
        plan_s = time.perf_counter() - t0
        r = planner.report(order, lengths, batches)
        assert r.tokens is not None
        table.append(
            (
                f"PackedBatches({seq}, {rows}, long_docs={policy!r})",
                f"{r.tokens} ({r.tokens / total:.1%})",
                str(r.truncated_tokens),
                str(r.dropped_tokens),
                f"{100 * (r.pad_fraction or 0):.2f}",
                f"{plan_s:.2f}",
            )
        )
    _print_table(table, args.markdown)


def packing_modes(args: argparse.Namespace, lengths: np.ndarray, source: str) -> None:
    """Part 3: padding and cut tokens of every packing mode, in one Markdown-ready table."""
    seq, rows = args.seq_len, args.rows
    order = np.random.default_rng(args.seed + 1).permutation(lengths.size)
    total = int(lengths.sum())
    print(
        f"\npacking modes ({source}): {lengths.size} docs, {total} tokens, "
        f"{rows} x {seq} rows per batch; load average {os.getloadavg()[0]:.2f}"
    )
    table = [
        ("fit", "long_docs", "window", "batches", "pad %", "pad tokens", "cut tokens", "plan s")
    ]
    first_pad: dict[tuple[str, int], int] = {}
    for window in args.windows:
        for long in ("split", "truncate", "drop"):
            for fit in ("first", "best"):
                planner = PackedBatches(seq, rows, window=window, long_docs=long, fit=fit)
                times = []
                for _ in range(args.repeat):
                    t0 = time.perf_counter()
                    batches = planner.plan(order, lengths, np.random.default_rng(1))
                    times.append(time.perf_counter() - t0)
                r = planner.report(order, lengths, batches)
                assert r.tokens is not None and r.padded_tokens is not None
                pad = r.padded_tokens - r.tokens
                cut = (r.truncated_tokens or 0) + (r.dropped_tokens or 0)
                note = ""
                if fit == "first":
                    first_pad[(long, window)] = pad
                elif first_pad[(long, window)]:
                    note = f" ({pad / first_pad[(long, window)] - 1:+.1%} vs first)"
                table.append(
                    (
                        fit,
                        long,
                        str(window),
                        str(len(batches)),
                        f"{100 * (r.pad_fraction or 0):.3f}",
                        f"{pad}{note}",
                        str(cut),
                        f"{float(np.median(times)):.2f}",
                    )
                )
    _print_table(table, args.markdown)


def _print_table(table: list[tuple[str, ...]], markdown: bool) -> None:
    for cells in table:
        if markdown:
            print("| " + " | ".join(cells) + " |")
            if cells is table[0]:
                print("|" + "---|" * len(cells))
        else:
            print("  ".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=50_000)
    ap.add_argument("--mean", type=float, default=300.0)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rows", type=int, default=8, help="rows per packed batch")
    ap.add_argument("--long-docs", type=int, default=2_000, help="documents of part 2")
    ap.add_argument("--long-mean", type=float, default=6_000.0, help="mean tokens, part 2")
    ap.add_argument("--dataset", default=None, help="part 2 on this packed dataset's lengths")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--windows",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 16, 4096],
        help="packing windows of part 3 (documents)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="planning runs per mode, part 3")
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
    pk = PackedBatches(seq, args.rows, window=4096)
    rows.append(
        run(
            f"packed {args.rows} x {seq}, window 4096",
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
    header = ("strategy", "batches", "pad %", "plan s", "collate tokens/s", "CPU ns/token", "notes")
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
            "-" if np.isnan(r.cpu_ns_per_token) else f"{r.cpu_ns_per_token:.1f}",
            r.notes,
        )
        print(("| " + " | ".join(cells) + " |") if args.markdown else "  ".join(cells))
    long_documents(args)
    packing_modes(args, lengths, f"lognormal, mean {args.mean:.0f}, sigma {args.sigma}")
    if args.dataset:
        long_lengths, source = dataset_lengths(args.dataset), args.dataset
    else:
        rng = np.random.default_rng(args.seed)
        mu = np.log(args.long_mean) - args.sigma**2 / 2
        long_lengths = np.maximum(rng.lognormal(mu, args.sigma, args.long_docs), 1).astype(np.int64)
        source = f"lognormal, mean {args.long_mean:.0f}, sigma {args.sigma}"
    packing_modes(args, long_lengths, source)


if __name__ == "__main__":
    main()
