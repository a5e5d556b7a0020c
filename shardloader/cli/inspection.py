"""``shardloader inspect | verify``: look at a packed dataset, or check all of it.

Only the command layer prints.  The library is imported inside each command (see
``shardloader.cli``), so ``--help`` and usage errors do not wait for it.
"""

from __future__ import annotations

import json
from typing import Any

import click

from shardloader.cli.advice import in_cli_terms
from shardloader.cli.group import main
from shardloader.cli.options import (
    retry_options,
    retry_policy,
    show_progress,
    storage_option,
    storage_options,
)
from shardloader.cli.progress import counter, progress_bar
from shardloader.errors import ShardError
from shardloader.units import human_bytes as _human

__all__ = ["inspect_command", "presence_lines", "verify_command"]


def _fmt_stats(s: Any, unit: str = "") -> str:
    if s is None:
        return "-"
    u = f" {unit}" if unit else ""
    return (
        f"min {s.min:,}{u}, median {s.median:,.0f}, mean {s.mean:,.1f}, p95 {s.p95:,.0f}, "
        f"max {s.max:,}{u}"
    )


def presence_lines(presence: Any, samples: int, lead: str) -> list[str]:
    """``txt in 432 of 480 samples`` for each field some samples lack; one line saying all
    fields are in every sample otherwise (nothing when the counts were not recorded)."""
    if presence is None:
        return []
    partial = [f"{k} in {n:,} of {samples:,} samples" for k, n in presence.items() if n < samples]
    if not partial:
        return [f"{lead}every field in every sample"]
    return [lead + ", ".join(partial)]


@main.command("inspect")
@click.argument("dataset")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@storage_option
def inspect_command(dataset: str, as_json: bool, storage_option: tuple[str, ...]) -> None:
    """Summarise a packed dataset: shards, samples, fields, classes, sizes, lengths."""
    from shardloader.read.summary import inspect_dataset

    s = inspect_dataset(dataset, storage_options(storage_option))
    if as_json:
        click.echo(json.dumps(s.to_dict(), indent=1, sort_keys=True))
        return
    lines = [
        f"{s.url}: {s.format}/{s.compression}, layout {s.layout or '-'}",
        f"  shards     {s.num_shards:,}   samples {s.num_samples:,}"
        + (f"   skipped when packed {s.skipped:,}" if s.skipped else ""),
        f"  stored     {_human(s.bytes)}   uncompressed {_human(s.raw_bytes)}   "
        f"ratio {s.ratio:.2f}x compression (uncompressed / stored)",
        f"  per shard  samples: {_fmt_stats(s.shard_samples)}",
        f"  per sample bytes: {_fmt_stats(s.sample_bytes)}",
        "  fields     "
        + ", ".join(
            f"{k} ({v['codec']}{'/' + v['dtype'] if 'dtype' in v else ''})"
            for k, v in s.fields.items()
        ),
    ]
    lines += presence_lines(s.presence, s.num_samples, "  present    ")
    if s.lengths is not None:
        lines.append(
            f"  lengths    {s.length_field} in {s.length_unit or 'units'}: "
            f"{_fmt_stats(s.lengths)}, total {s.lengths.total:,}"
        )
    if s.classes:
        lines.append(f"  classes    {len(s.classes)}")
        shown = s.classes if len(s.classes) <= 12 else s.classes[:10]
        for i, (name, count) in enumerate(shown):
            lines.append(f"    {i:>4} {name}" + (f": {count:,}" if count is not None else ""))
        if len(shown) < len(s.classes):
            lines.append(f"    ... {len(s.classes) - len(shown)} more (--json lists all)")
    click.echo("\n".join(lines))


@main.command("verify")
@click.argument("dataset")
@click.option("--no-images", is_flag=True, help="Do not decode images (faster).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@storage_option
@retry_options
def verify_command(
    dataset: str,
    no_images: bool,
    as_json: bool,
    quiet: bool,
    storage_option: tuple[str, ...],
    retries: int | None,
    retry_seconds: float | None,
) -> None:
    """Re-hash every shard and parse every sample; exit 1 if anything is bad."""
    from shardloader.read.verify import verify_dataset

    with progress_bar(show_progress(quiet), unit="shard", desc="verify") as bar:
        r = verify_dataset(
            dataset,
            storage_options(storage_option),
            images=not no_images,
            progress=counter(bar),
            retry=retry_policy(retries, retry_seconds),
        )
    if as_json:
        click.echo(json.dumps(r.to_dict(), indent=1, sort_keys=True))
    else:
        for b in r.bad:
            click.echo(f"BAD {b.path}")
            for reason in b.reasons:
                click.echo(f"    {in_cli_terms(reason)}")
        click.echo(
            f"{r.shards - len(r.bad)} of {r.shards} shards ok, {r.samples:,} samples checked"
        )
    if not r.ok:
        raise ShardError(f"{len(r.bad)} of {r.shards} shards in {dataset} are bad")
