"""``shardloader bench DATASET``: sweep loader settings, print the table, recommend, plot.

The library (torch and all) is imported when the command runs, not when ``--help`` asks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import click

from shardloader.cli.group import main
from shardloader.cli.options import dataset_options, dataset_preset
from shardloader.errors import UsageError

__all__ = ["bench_command"]


DEFAULT_TOLERANCE = 0.1  # = shardloader.bench.DEFAULT_TOLERANCE (tests/test_cli_imports.py)


def _counts(text: str | None, name: str, minimum: int) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise UsageError(f"{name} {text!r}: give comma-separated integers, e.g. 0,1,2,4") from err
    if not values or min(values) < minimum:
        raise UsageError(f"{name} {text!r}: give integers >= {minimum}")
    return tuple(sorted(set(values)))


def _memory_limit_mb() -> float | None:
    """Half of the memory available now: the article keeps prefetch well inside RAM."""
    try:
        import psutil
    except ImportError:
        return None
    return psutil.virtual_memory().available / 2 / 1e6


@main.command("bench")
@click.argument("dataset")
@click.option(
    "--workers", help="num_workers values, e.g. 0,1,2,4 (default: 0,1,2,4,... up to the core count)"
)
@click.option(
    "--prefetch",
    default="2,4",
    help="prefetch_factor values (used with num_workers > 0)",
)
@click.option(
    "--batches",
    default=50,
    type=click.IntRange(min=1),
    help="batches timed per point, after the first",
)
@click.option(
    "--decode/--no-decode",
    default=None,
    help="only with / only without decoding (default: both, to tell reading from decoding)",
)
@click.option(
    "--tolerance",
    default=DEFAULT_TOLERANCE,
    type=click.FloatRange(0, 1, max_open=True),
    help="throughput within this fraction of the best counts as as fast",
)
@click.option("--json", "as_json", is_flag=True, help="print results and recommendation as JSON")
@click.option(
    "--plot",
    "plot_path",
    metavar="FILE.png",
    help="draw throughput and memory against num_workers",
)
@dataset_options(batch_size=32, transform="auto")
def bench_command(
    dataset: str,
    workers: str | None,
    prefetch: str,
    batches: int,
    decode: bool | None,
    tolerance: float,
    as_json: bool,
    plot_path: str | None,
    **dataset_flags: Any,
) -> None:
    """Sweep num_workers and prefetch_factor on DATASET; find where more workers stop helping.

    Measures batches/s, samples/s, MB/s (uncompressed shard bytes), the time to the first
    batch and the memory of the whole process tree (peak RSS summed over processes, and PSS,
    which counts shared pages once), then marks the knee and recommends settings.  "Decode"
    points decode every field and run the --transform; the others move raw bytes: comparing
    them tells whether reading or decoding is the limit.  The dataset options are those of
    `shardloader serve DATASET`: both read the same pipeline from the same flags.
    """
    from shardloader import bench

    preset = dataset_preset(dataset_flags)
    worker_counts = _counts(workers, "--workers", 0)
    prefetch_counts = _counts(prefetch, "--prefetch", 1) or ()
    if plot_path is not None:
        if not plot_path.lower().endswith(".png"):
            raise UsageError(f"--plot {plot_path!r}: give a .png file name")
        try:
            import matplotlib  # noqa: F401
        except ImportError as err:  # fail before minutes of measuring, not after
            raise UsageError("--plot needs matplotlib: pip install 'shardloader[plot]'") from err
    modes = (True, False) if decode is None else (decode,)

    def progress(r: bench.BenchResult) -> None:
        pf = "-" if r.prefetch_factor is None else r.prefetch_factor
        click.echo(
            f"decode={'yes' if r.decode else 'no'} workers={r.num_workers} prefetch={pf}: "
            f"{r.samples_per_s:.0f} samples/s",
            err=True,
        )

    results = bench.sweep(
        dataset,
        preset,
        workers=worker_counts,
        prefetch=prefetch_counts,
        batches=batches,
        decode=modes,
        progress=progress,
    )
    rec = bench.recommend(
        results, tolerance=tolerance, cpu_count=os.cpu_count(), memory_limit_mb=_memory_limit_mb()
    )
    as_dicts = {"results": [r.as_dict() for r in results], "recommendation": rec.as_dict()}
    click.echo(json.dumps(as_dicts, indent=2) if as_json else bench.format_table(results, rec))
    if plot_path is not None:
        bench.plot(results, rec, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)
