"""``shardloader bench DATASET``: sweep loader settings, print the table, recommend, plot.

The library (torch and all) is imported when the command runs, not when ``--help`` asks.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import click

from shardloader.cli import main
from shardloader.errors import UsageError

if TYPE_CHECKING:
    from shardloader.codecs import Decoder
    from shardloader.shards import ReadOptions

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


def _pipeline(
    url: str, transform: str, image_size: int, read: ReadOptions | None
) -> tuple[Decoder | None, Any]:
    """(decoder, transform) for the decoding points: a vision transform on the first image
    field (decoding from the raw bytes at reduced JPEG scale, as in training), or none."""
    from shardloader.codecs import Decoder
    from shardloader.manifest import read_manifest
    from shardloader.shards import ReadOptions

    if transform == "none":
        return None, None
    from shardloader import vision

    manifest, _ = read_manifest(url, (read or ReadOptions()).storage_options)
    field = vision.image_field(manifest.fields)  # "image" in class-folder packs
    if field is None:
        if transform == "auto":
            return None, None
        raise UsageError(f"--transform {transform}: {url} has no image field "
                         f"(fields: {', '.join(manifest.fields)})")
    make = vision.eval_transform if transform == "eval" else vision.train_transform
    return Decoder(image="raw"), make(image_size, field=field)


@main.command("bench")
@click.argument("dataset")
@click.option("--workers", help="num_workers values, e.g. 0,1,2,4 (default: 0,1,2,4,... up "
              "to the core count)")
@click.option("--prefetch", default="2,4", show_default=True,
              help="prefetch_factor values (used with num_workers > 0)")
@click.option("--batch-size", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--batches", default=50, show_default=True, type=click.IntRange(min=1),
              help="batches timed per point, after the first")
@click.option("--decode/--no-decode", default=None,
              help="only with / only without decoding (default: both, to tell reading from "
              "decoding)")
@click.option("--transform", type=click.Choice(["auto", "train", "eval", "none"]),
              default="auto", show_default=True,
              help="image transform when decoding (shardloader.vision); auto: train when the "
              "dataset has an image field")
@click.option("--image-size", default=224, show_default=True, type=click.IntRange(min=1),
              help="output side of the image transform")
@click.option("--tolerance", default=DEFAULT_TOLERANCE, show_default=True,
              type=click.FloatRange(0, 1, max_open=True),
              help="throughput within this fraction of the best counts as as fast")
@click.option("--cache-dir", default=None, help="node cache for staged shards")
@click.option("--json", "as_json", is_flag=True, help="print results and recommendation as JSON")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="draw throughput and memory against num_workers")
def bench_command(
    dataset: str,
    workers: str | None,
    prefetch: str,
    batch_size: int,
    batches: int,
    decode: bool | None,
    transform: str,
    image_size: int,
    tolerance: float,
    cache_dir: str | None,
    as_json: bool,
    plot_path: str | None,
) -> None:
    """Sweep num_workers and prefetch_factor on DATASET; find where more workers stop helping.

    Measures batches/s, samples/s, MB/s (uncompressed shard bytes), the time to the first
    batch and the memory of the whole process tree (peak RSS summed over processes, and PSS,
    which counts shared pages once), then marks the knee and recommends settings.  "Decode"
    points decode every field and run the --transform; the others move raw bytes: comparing
    them tells whether reading or decoding is the limit.
    """
    from shardloader import bench
    from shardloader.shards import ReadOptions
    from shardloader.storage.cache import CacheOptions

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
    read = ReadOptions(cache=CacheOptions(dir=cache_dir)) if cache_dir else None
    decoder, transform_fn = _pipeline(dataset, transform, image_size, read)

    def progress(r: bench.BenchResult) -> None:
        pf = "-" if r.prefetch_factor is None else r.prefetch_factor
        click.echo(
            f"decode={'yes' if r.decode else 'no'} workers={r.num_workers} prefetch={pf}: "
            f"{r.samples_per_s:.0f} samples/s",
            err=True,
        )

    results = bench.sweep(
        dataset, workers=worker_counts, prefetch=prefetch_counts, batch_size=batch_size,
        batches=batches, decode=modes, transform=transform_fn, decoder=decoder, read=read,
        progress=progress,
    )
    rec = bench.recommend(results, tolerance=tolerance, cpu_count=os.cpu_count(),
                          memory_limit_mb=_memory_limit_mb())
    if as_json:
        click.echo(json.dumps({"results": [r.as_dict() for r in results],
                               "recommendation": rec.as_dict()}, indent=2))
    else:
        click.echo(bench.format_table(results, rec))
    if plot_path is not None:
        bench.plot(results, rec, plot_path)
        click.echo(f"plot written to {plot_path}", err=True)
