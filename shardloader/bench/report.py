"""Show a sweep: the fixed-width table with the knee marked, and the PNG plot."""

from __future__ import annotations

from collections.abc import Sequence

from shardloader.bench.measure import BenchResult
from shardloader.bench.recommend import Recommendation
from shardloader.errors import UsageError

__all__ = ["format_table", "plot"]

_COLUMNS = (
    ("decode", 6),
    ("workers", 7),
    ("prefetch", 8),
    ("batches/s", 9),
    ("samples/s", 10),
    ("MB/s", 8),
    ("first s", 7),
    ("peak MB", 8),
    ("PSS MB", 7),
)


def format_table(results: Sequence[BenchResult], rec: Recommendation | None = None) -> str:
    """A fixed-width table, the recommended point marked ``<- knee`` (``<- recommended
    (memory)`` when the memory limit moved it below the knee), the recommendation last."""
    head = "  ".join(f"{name:>{width}}" for name, width in _COLUMNS)
    lines = [head, "-" * len(head)]
    chosen = None if rec is None else (rec.decode, rec.num_workers, rec.prefetch_factor)
    for r in results:
        cells = (
            "yes" if r.decode else "no",
            str(r.num_workers),
            "-" if r.prefetch_factor is None else str(r.prefetch_factor),
            f"{r.batches_per_s:.1f}",
            f"{r.samples_per_s:.0f}",
            f"{r.mb_per_s:.1f}",
            f"{r.first_batch_s:.2f}",
            f"{r.peak_rss_mb:.0f}",
            "-" if r.pss_mb is None else f"{r.pss_mb:.0f}",
        )
        line = "  ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS, strict=True))
        if rec is not None and (r.decode, r.num_workers, r.prefetch_factor) == chosen:
            line += "  <- knee" if rec.knee == rec.num_workers else "  <- recommended (memory)"
        lines.append(line)
    if rec is not None:
        lines += ["", rec.line()]
    return "\n".join(lines)


def plot(results: Sequence[BenchResult], rec: Recommendation | None, path: str) -> None:
    """Throughput and memory against num_workers, one line per (decode, prefetch), as a PNG."""
    try:
        import matplotlib
    except ImportError as err:
        raise UsageError("plotting needs matplotlib: pip install 'shardloader[plot]'") from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 6))
    try:
        # one line per (decode, prefetch); num_workers=0 points (no prefetch) start each of
        # their mode's lines, or make the mode's only line
        lines: dict[tuple[bool, int | None], list[BenchResult]] = {}
        for r in sorted(results, key=lambda r: r.num_workers):
            factors: Sequence[int | None] = sorted(
                {p.prefetch_factor or 0 for p in results if p.decode == r.decode and p.num_workers}
            )
            for pf in [r.prefetch_factor] if r.num_workers else factors or [None]:
                lines.setdefault((r.decode, pf), []).append(r)
        for (decoded, pf), points in sorted(
            lines.items(), key=lambda kv: (not kv[0][0], kv[0][1] or 0)
        ):
            label = ("decoded" if decoded else "raw bytes") + (f", prefetch {pf}" if pf else "")
            xs = [r.num_workers for r in points]
            style = "-o" if decoded else "--s"
            top.plot(xs, [r.samples_per_s for r in points], style, label=label)
            bottom.plot(xs, [r.memory_mb for r in points], style, label=label)
        if rec is not None:
            for ax in (top, bottom):
                ax.axvline(rec.num_workers, color="grey", linestyle=":", label="knee")
            top.set_title(rec.line(), fontsize=8, wrap=True)
        rates = [r.samples_per_s for r in results if r.samples_per_s > 0]
        if rates and max(rates) > 20 * min(rates):
            top.set_yscale("log")  # raw reading can be orders of magnitude above decoding
        top.set_xticks(sorted({r.num_workers for r in results}))
        top.set_ylabel("samples/s")
        bottom.set_ylabel("memory, MB (PSS or peak RSS)")
        bottom.set_xlabel("num_workers")
        top.legend(fontsize=7)
        top.grid(alpha=0.3)
        bottom.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png", dpi=100)
    finally:
        plt.close(fig)
