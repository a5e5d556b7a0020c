"""``shardloader pack``: make a packed dataset (shards + manifest).

Progress bars go to stderr (tqdm) and only when stderr is a terminal
and ``--quiet`` is not given; summaries go to stdout.  The library is imported inside each
command (see ``shardloader.cli``), so ``--help`` and usage errors do not wait for it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

import click

from shardloader.cli.group import main
from shardloader.cli.options import (
    interruptible,
    retry_options,
    retry_policy,
    show_progress,
    storage_option,
    storage_options,
)
from shardloader.cli.progress import progress_bar
from shardloader.errors import UsageError
from shardloader.units import human_bytes as _human
from shardloader.units import parse_size

__all__ = ["pack_command", "format_report", "part_index"]


if TYPE_CHECKING:
    from shardloader.pack import PackProgress, PackReport

# Copies of shardloader.pack.DEFAULT_SHARD_SIZE and of "auto" + the built-in layouts'
# names (shardloader.pack.layouts.registry): the option declarations need them before any
# command runs (tests/test_cli_imports.py checks that they agree).
DEFAULT_SHARD_SIZE = 128 << 20
LAYOUTS = ("auto", "class-folders", "key-groups", "records", "tars")


@main.command("pack")
@click.argument("src")
@click.argument("out")
@click.option(
    "--format",
    type=click.Choice(["tar", "arrow", "tokens"]),
    default="tar",
    help="Shard format (tokens: each shard's token ids contiguous, for --tokenizer or "
    "--token-field).",
)
@click.option(
    "--compression",
    type=click.Choice(["zstd", "gzip", "none"]),
    default="zstd",
    help="Shard compression (arrow: zstd or none).",
)
@click.option(
    "--shard-size",
    default="auto",
    help="Roll over to a new shard at this many uncompressed bytes (0: no limit; auto: "
    f"{DEFAULT_SHARD_SIZE >> 20}MiB, or about an eighth of a smaller input, at least 16MiB).",
)
@click.option("--max-samples", type=int, help="At most this many samples a shard.")
@click.option(
    "--max-sample-size",
    help="Refuse (or with --on-error skip, skip) a sample whose input is larger, e.g. 1GiB, "
    "before reading it (default: no limit).",
)
@click.option(
    "--layout",
    type=click.Choice(LAYOUTS),
    default="auto",
    help="Input layout (default: detected).",
)
@click.option(
    "--workers",
    type=int,
    default=1,
    help="Writer processes (--executor ray: tasks in flight; 1: the cluster's CPUs).",
)
@click.option(
    "--executor",
    type=click.Choice(["local", "ray"]),
    default="local",
    help="Where shards are written: local processes, or Ray tasks on a cluster "
    "(pip install 'shardloader[ray]'; OUT must be reachable from every node).",
)
@click.option(
    "--address",
    help="Ray cluster address for --executor ray (default: RAY_ADDRESS, else a local Ray).",
)
@click.option(
    "--num-parts",
    type=int,
    default=1,
    help="Split the job into this many parts (one per machine) ...",
)
@click.option(
    "--part",
    type=int,
    help="... and pack only this one (0-based; default: $JOB_COMPLETION_INDEX, as a "
    "Kubernetes Indexed Job sets it, else 0); combine with `shardloader merge`.",
)
@click.option(
    "--on-error",
    type=click.Choice(["fail", "skip"]),
    default="fail",
    help="Bad input: stop, or skip it and report it.",
)
@click.option(
    "--validate",
    is_flag=True,
    help="Decode every image to check it (without it, a "
    "cheap check: empty files, unreadable headers, truncated JPEG/PNG/WebP).",
)
@click.option(
    "--alias",
    "alias",
    multiple=True,
    metavar="FIELD=EXT,...",
    help="Read several extensions as one field, e.g. image=jpg,jpeg,png (repeatable; "
    "extensions without case; recorded in the manifest; class folders and key groups get "
    "image=<their image extensions>).",
)
@click.option(
    "--labels",
    metavar="FILE",
    help="Labels for a flat image folder: a filename,label CSV (header optional) or one label "
    "a line in sorted file order; adds the field cls (names become manifest classes).",
)
@click.option(
    "--tokenizer",
    type=click.Path(dir_okay=False),
    help="Hugging Face tokenizers JSON file: store token ids in a 'tokens' field.",
)
@click.option(
    "--text-field",
    default="text",
    help="JSON key (or field) holding the text to measure / tokenize.",
)
@click.option(
    "--token-field",
    help="Pre-tokenized input: the Parquet/Arrow list column or JSON key holding each "
    "record's token ids, stored as the 'tokens' field without a tokenizer.",
)
@click.option(
    "--vocab-size",
    type=click.IntRange(min=1),
    help="With --token-field: every id is below this (default: the largest id + 1); it picks "
    "uint16 or uint32 ids and is recorded as the tokenizer's vocab_size.",
)
@click.option("--resume", is_flag=True, help="Keep the intact shards of an interrupted pack.")
@click.option("--overwrite", is_flag=True, help="Replace a previous pack in OUT.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar and no summary.")
@storage_option
@retry_options
def pack_command(
    src: str,
    out: str,
    shard_size: str,
    max_sample_size: str | None,
    part: int | None,
    quiet: bool,
    alias: tuple[str, ...],
    storage_option: tuple[str, ...],
    retries: int | None,
    retry_seconds: float | None,
    **given: Any,
) -> None:
    """Pack the raw files in SRC into shards + index.json in OUT.

    SRC (a folder, a file or an fsspec URL) holds class folders (SRC/<class>/<image>), key
    groups (a/0001.jpg + a/0001.json), record files (.jsonl, .txt, optionally .gz/.zst),
    tables (.parquet, .arrow) or webdataset tars (img2dataset's output).  The manifest is
    written last.
    """
    if given["format"] == "tokens" and not (given["tokenizer"] or given["token_field"]):
        raise UsageError(  # refused now, not when the shards are read
            "--format tokens lays out token ids: pass --tokenizer tokenizer.json (a Hugging Face "
            "tokenizers file) to make them from the text, or --token-field NAME for ids the "
            "records already hold (e.g. input_ids), or pick --format tar or arrow"
        )
    from shardloader.pack import PackOptions, pack
    from shardloader.read.fields import parse_option

    retry = retry_policy(retries, retry_seconds)
    extra: dict[str, Any] = {} if retry is None else {"retry": retry}
    options = PackOptions(  # the other options are PackOptions' fields by name
        shard_size=None if shard_size == "auto" else parse_size(shard_size),
        max_sample_size=None if max_sample_size is None else parse_size(max_sample_size),
        part=part_index(part),
        storage_options=storage_options(storage_option),
        aliases=parse_option(alias),  # --alias FIELD=EXT,...
        **given,
        **extra,
    )

    def on_progress(p: PackProgress) -> None:
        if bar is None:
            return
        if p.total_bytes and bar.total != p.total_bytes:
            bar.total = p.total_bytes
        bar.update(p.bytes_in - bar.n)
        rate = p.samples / p.seconds if p.seconds > 0 else 0.0
        bar.set_postfix_str(
            f"{p.samples} samples, {rate:,.0f} samples/s, {p.shards} shards", refresh=False
        )

    try:
        with (
            progress_bar(
                show_progress(quiet), unit="B", unit_scale=True, unit_divisor=1000, desc="pack"
            ) as bar,
            interruptible(),
        ):
            report = pack(src, out, options, progress=on_progress)
    except KeyboardInterrupt:
        click.echo(
            "interrupted: no manifest was written; finished shards stay in OUT, re-run with "
            "--resume to keep them",
            err=True,
        )
        sys.exit(130)
    if not quiet:
        click.echo(format_report(report))


def format_report(r: PackReport) -> str:
    """The one-screen summary of a pack."""
    from shardloader.cli.inspection import presence_lines
    from shardloader.read.fields import FieldMap, presence

    m = r.manifest
    lines = [
        f"packed {r.out}: {m.format}/{m.compression}, layout {m.layout}",
        f"  samples   {r.samples:,}"
        + (f"  (skipped {r.skipped:,}, see {r.skip_report})" if r.skipped else ""),
        f"  shards    {r.shards:,}"
        + (f"  ({r.kept_shards} kept from an earlier run)" if r.kept_shards else ""),
        "  fields    "
        + ", ".join(
            f"{k}:{v.codec}" + (f" ({'/'.join(m.aliases[k])})" if k in m.aliases else "")
            for k, v in sorted(m.fields.items())
        ),
    ]
    counts = presence(m.extra.get("field_samples"), FieldMap.of_manifest(m))  # pack's own
    lines += presence_lines(counts, m.num_samples, "  present   ")
    if m.classes:
        lines.append(f"  classes   {len(m.classes)}")
    if r.ignored:
        shown = ", ".join(f"{rel!r} ({why})" for rel, why in r.ignored[:3])
        more = f" and {len(r.ignored) - 3:,} more" if len(r.ignored) > 3 else ""
        lines.append(f"  ignored   {len(r.ignored):,}: {shown}{more}")
    lines += [
        f"  bytes in  {_human(r.bytes_in)}",
        f"  bytes out {_human(r.bytes_out)} stored, {_human(r.raw_bytes)} uncompressed",
        f"  ratio     {r.compression_ratio:.2f}x compression (uncompressed / stored, as "
        f"inspect says), {r.ratio:.2f}x input / stored",
        f"  time      {r.seconds:.1f} s, {r.mb_per_s:.1f} MB/s in",
    ]
    lines += [f"note: {note}" for note in r.notes]
    return "\n".join(lines)


def part_index(part: int | None) -> int:
    """``--part``, else ``JOB_COMPLETION_INDEX`` (set by a Kubernetes Indexed Job for each of
    its pods), else 0: one manifest runs every part, each pod packs its own."""
    if part is not None:
        return part
    env = os.environ.get("JOB_COMPLETION_INDEX")
    if env is None or not env.strip():
        return 0
    try:
        return int(env)
    except ValueError:
        raise UsageError(
            f"JOB_COMPLETION_INDEX={env!r} is not a part number; pass --part"
        ) from None
