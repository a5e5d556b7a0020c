"""``shardloader plan --balance``: the per-step rank cost of packed rows, balanced and not,
predicted from the manifest's recorded lengths (:mod:`shardloader.plan.cost`)."""

from __future__ import annotations

from typing import Any

__all__ = ["balance_figures", "balance_text"]


def balance_figures(
    manifest: Any, base: Any, planning: Any, part: Any, flags: dict[str, Any]
) -> list[dict[str, Any]]:
    """Per epoch: mean and worst per-step max/mean rank cost with and without balance
    (``flags``: the plan command's options)."""
    import dataclasses

    from shardloader.batching.packed import PackedBatches
    from shardloader.cli.options import storage_options
    from shardloader.plan.cost import rank_balance
    from shardloader.read.lengths import load_lengths
    from shardloader.read.shardset import ReadOptions

    storage = storage_options(flags["storage_option"])
    lengths = load_lengths(manifest, base.url, ReadOptions(storage_options=storage))
    seq_len, rows, c = flags["seq_len"], flags["rows"], flags["balance_c"]
    planner = PackedBatches(seq_len, rows, balance_c=c)
    packed = dataclasses.replace(planning, planner=planner, batch_size=None)
    out = []
    for epoch in range(flags["epochs"]):
        got = rank_balance(packed, epoch, part, lengths)
        assert got is not None  # a PackedBatches planning; load_lengths raised without lengths
        out.append(
            {
                "epoch": epoch,
                "seq_len": seq_len,
                "rows_per_rank": rows,
                "balance_c": c,
                "ranks_per_step": got.ranks,
                "steps": got.steps,
                "balanced": round(got.balanced, 4),
                "unbalanced": round(got.unbalanced, 4),
                "worst_balanced": round(got.worst_balanced, 4),
                "worst_unbalanced": round(got.worst_unbalanced, 4),
            }
        )
    return out


def balance_text(figures: list[dict[str, Any]]) -> list[str]:
    return [
        f"  balance, epoch {f['epoch']}: per step, dearest rank / mean rank "
        f"(sum L^2 + {f['balance_c']:g} sum L, {f['rows_per_rank']} row(s) of {f['seq_len']:,} "
        f"a rank, {f['ranks_per_step']} ranks a step, {f['steps']:,} steps): "
        f"{f['balanced']:.3f} balanced (worst {f['worst_balanced']:.3f}), "
        f"{f['unbalanced']:.3f} unbalanced (worst {f['worst_unbalanced']:.3f})"
        for f in figures
    ]
