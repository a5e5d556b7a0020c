#!/usr/bin/env python
"""Compute-balanced steps: how even each step's rank costs are, planned and timed.

    python tools/bench_balance.py [--docs 60000] [--time-docs 600] [--json FILE]

Part one plans a long-tailed corpus (lognormal document lengths, median about 1.1k tokens,
a tail past 32k, the longest capped at 200k) with ``PackedBatches`` for each ``seq_len``
(8,192, 16,384, 32,768), data-parallel ranks sharing a step (8, 64) and rows a rank
(1, 2, 4), with ``balance="attention"`` and without, and prints the mean over steps of the
dearest rank's cost over the mean rank cost (cost ``sum(L**2) + c * sum(L)``, c = 0), and the
worst step.  It only plans: no data is read.

Part two measures on this CPU how much of that shows up in time: a smaller corpus packed into
rows of ``--time-seq`` tokens for ``--time-ranks`` ranks, each rank batch timed as one causal
variable-length attention forward and backward (``scaled_dot_product_attention`` over each
segment, 2 heads of 16 dimensions, one thread), a step's time the slowest rank's; the epoch
planned with ``balance_c`` fitted to this machine's attention times (:func:`fitted_c`),
with and without balance, their batches interleaved and each timed twice (the least
kept).  Keep it small: it runs in about a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from benchjson import machine, write_figures  # noqa: E402

from shardloader.batching import PackedBatches  # noqa: E402
from shardloader.batching.balance import batch_costs, step_imbalance  # noqa: E402

WINDOW = 16_384  # documents a window: enough rows that a window holds many steps
CURVE = (32_768, 8, 2)  # the configuration whose per-step figures the picture draws
PLANS = (("balanced", True), ("unbalanced", False))
REPEAT = 2  # timings of each rank batch; the least is kept


def long_tailed(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.minimum(rng.lognormal(7.0, 1.3, n).astype(np.int64) + 1, 200_000)


def plan(
    lens: np.ndarray, seq: int, ranks: int, rows: int, balance: bool, c: float = 0.0
) -> list[np.ndarray]:
    planner = PackedBatches(
        seq, rows, window=WINDOW, balance="attention" if balance else None,
        ranks=ranks if balance else None, balance_c=c,
    )  # fmt: skip
    order = np.random.default_rng(1).permutation(lens.size)
    return planner.plan(order, lens, np.random.default_rng(2))


def planned(n: int) -> list[dict[str, Any]]:
    """A row per configuration; the picture's configuration (``CURVE``) also holds every
    step's figure (``per_step_balanced``, ``per_step_unbalanced``)."""
    lens = long_tailed(n)
    rows_out = []
    for seq in (8192, 16_384, 32_768):
        for ranks in (8, 64):
            for rows in (1, 2, 4):
                row: dict[str, Any] = {"seq_len": seq, "ranks": ranks, "rows_per_rank": rows}
                for name, on in (("balanced", True), ("unbalanced", False)):
                    t0 = time.perf_counter()
                    batches = plan(lens, seq, ranks, rows, on)
                    ratios = step_imbalance(batch_costs(batches, 0.0), ranks)
                    row[name] = round(float(ratios.mean()), 4)
                    row[f"worst_{name}"] = round(float(ratios.max()), 4)
                    row[f"{name}_plan_s"] = round(time.perf_counter() - t0, 3)
                    if (seq, ranks, rows) == CURVE:
                        row[f"per_step_{name}"] = [round(float(r), 4) for r in ratios]
                row["steps"] = len(batches) // ranks
                rows_out.append(row)
                print(
                    f"seq_len {seq:>6,}  {ranks:>2} ranks x {rows} row(s)  {row['steps']:>6,} "
                    f"steps: max/mean {row['balanced']:.3f} balanced (worst "
                    f"{row['worst_balanced']:.3f}), {row['unbalanced']:.3f} unbalanced (worst "
                    f"{row['worst_unbalanced']:.3f})",
                    flush=True,
                )
    return rows_out


def batch_seconds(batch: np.ndarray, heads: int = 2, dim: int = 16) -> float:
    """One causal attention forward and backward over each segment of a rank batch."""
    import torch
    import torch.nn.functional as F

    t0 = time.perf_counter()
    for length in (batch[:, 2] - batch[:, 1]).tolist():
        if length < 1:
            continue
        q, k, v = (torch.randn(1, heads, length, dim, requires_grad=True) for _ in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return time.perf_counter() - t0


def fitted_c(seq: int) -> float:
    """``c`` of ``a * L**2 + b * L`` fitted to this machine's attention times (``b / a``):
    per-token and per-call work that a small head dimension leaves beside the square."""
    sizes = [seq // 32, seq // 8, seq // 2, seq]
    times = [min(batch_seconds(np.array([[0, 0, n]])) for _ in range(3)) for n in sizes]
    x = np.array([[float(n) ** 2, float(n)] for n in sizes])
    (a, b), *_ = np.linalg.lstsq(x, np.array(times), rcond=None)
    return float(max(b, 0.0) / a) if a > 0 else 0.0


def timed(n: int, seq: int, ranks: int, rows: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    lens = np.minimum(long_tailed(n, seed=7), 4 * seq)
    out: dict[str, Any] = {"seq_len": seq, "ranks": ranks, "rows_per_rank": rows, "docs": n}
    batch_seconds(np.array([[0, 0, seq]]))  # warm up the kernels
    c = round(fitted_c(seq), 1)
    out["balance_c"] = c
    plans = {name: plan(lens, seq, ranks, rows, on, c) for name, on in PLANS}
    whole = {name: len(b) // ranks * ranks for name, b in plans.items()}  # full steps only
    secs = {name: np.zeros(whole[name]) for name in plans}
    # both plans' batches interleaved, each timed REPEAT times (the least kept), so the load
    # of other jobs falls on both alike
    for i in range(max(whole.values())):
        for name in plans:
            if i < whole[name]:
                b = plans[name][i]
                secs[name][i] = min(batch_seconds(b) for _ in range(REPEAT))
    for name in plans:
        steps = secs[name].reshape(-1, ranks)
        out[f"{name}_steps"] = len(steps)
        out[f"{name}_epoch_s"] = round(float(steps.max(axis=1).sum()), 3)  # slowest rank
        out[f"{name}_busy_s"] = round(float(steps.mean(axis=1).sum()), 3)  # perfect balance
        out[f"{name}_measured_max_mean"] = round(
            float((steps.max(axis=1) / steps.mean(axis=1)).mean()), 4
        )
        ratios = step_imbalance(batch_costs(plans[name][: whole[name]], c), ranks)
        out[f"{name}_predicted_max_mean"] = round(float(ratios.mean()), 4)
    out["speedup"] = round(out["unbalanced_epoch_s"] / out["balanced_epoch_s"], 3)
    print(
        f"timed: seq_len {seq:,}, {ranks} ranks x {rows} row(s), {n} documents, c={c:g}: epoch "
        f"{out['balanced_epoch_s']:.1f} s balanced ({out['balanced_steps']} steps, measured "
        f"max/mean {out['balanced_measured_max_mean']:.3f}), {out['unbalanced_epoch_s']:.1f} s "
        f"unbalanced ({out['unbalanced_steps']} steps, {out['unbalanced_measured_max_mean']:.3f})"
        f": {out['speedup']:.2f}x",
        flush=True,
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--docs", type=int, default=60_000, help="documents of the planned corpus")
    ap.add_argument("--time-docs", type=int, default=400, help="documents of the timed corpus")
    ap.add_argument("--time-seq", type=int, default=8192)
    ap.add_argument("--time-ranks", type=int, default=4)
    ap.add_argument("--time-rows", type=int, default=1)
    ap.add_argument("--json", metavar="FILE", help="write the figures (tools/benchjson.py)")
    args = ap.parse_args(argv)
    print(machine(), flush=True)
    rows = planned(args.docs)
    run = timed(args.time_docs, args.time_seq, args.time_ranks, args.time_rows)
    if args.json:
        write_figures(args.json, __file__, {"rows": rows, "timed": run})
    return 0


if __name__ == "__main__":
    sys.exit(main())
