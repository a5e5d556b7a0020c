"""``shardloader plan --balance``: the per-step rank cost of packed rows, balanced and not,
predicted from the manifest's recorded lengths (:mod:`shardloader.plan.cost`)."""

from __future__ import annotations

from typing import Any

__all__ = ["balance_figures", "balance_text"]


def balance_figures(
    manifest: Any,
    base: Any,
    planning: Any,
    part: Any,
    epochs: int,
    seq_len: int,
    rows: int,
    c: float,
    storage: dict[str, Any],
) -> list[dict[str, Any]]:
    """Per epoch: mean and worst per-step max/mean rank cost with and without balance."""
    import dataclasses

    from shardloader.batching.packed import PackedBatches
    from shardloader.errors import UsageError
    from shardloader.plan.cost import rank_balance
    from shardloader.read.lengths import load_lengths
    from shardloader.read.shardset import ReadOptions

    url = getattr(base, "url", base)  # the shards' folder, a Store or its URL
    lengths = load_lengths(manifest, url, ReadOptions(storage_options=storage))
    planner = PackedBatches(seq_len, rows, balance_c=c)
    packed = dataclasses.replace(planning, planner=planner, batch_size=None)
    out = []
    for epoch in range(epochs):
        got = rank_balance(packed, epoch, part, lengths)
        if got is None:  # cannot happen: PackedBatches, lengths required above
            raise UsageError("--balance needs the manifest's recorded lengths")
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
