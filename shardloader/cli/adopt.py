"""``shardloader merge | index``: a manifest over shards that already exist, the parts of a
split pack (``merge``) or tars and Parquet files made elsewhere (``index``), none rewritten.

Like ``shardloader.cli.pack``: progress on stderr when it is a terminal, summaries on stdout,
the library imported inside each command.
"""

from __future__ import annotations

import click

from shardloader.cli.group import main
from shardloader.cli.options import show_progress, storage_option, storage_options
from shardloader.cli.progress import counter, progress_bar
from shardloader.units import parse_size

__all__ = ["index_command", "merge_command"]


@main.command("merge")
@click.argument("part_dirs", nargs=-1, required=True)
@click.argument("out")
@click.option("--copy", "mode", flag_value="copy", help="Copy shards into OUT (single-pack names).")
@click.option(
    "--reference",
    "mode",
    flag_value="reference",
    help="Point at the shards in place (parts must be inside OUT).",
)
@click.option("--overwrite", is_flag=True, help="Replace a previous manifest in OUT.")
@storage_option
def merge_command(
    part_dirs: tuple[str, ...],
    out: str,
    mode: str | None,
    overwrite: bool,
    storage_option: tuple[str, ...],
) -> None:
    """Combine the outputs of `pack --num-parts N --part I` into OUT, in single-pack order.

    By default shards are referenced in place when every part folder is inside OUT, and copied
    (checked against their sha256) otherwise.
    """
    from shardloader.pack.merge import merge

    r = merge(
        part_dirs,
        out,
        mode=mode or "auto",
        overwrite=overwrite,
        storage_options=storage_options(storage_option),
    )
    click.echo(
        f"merged {r.parts} parts into {out} ({r.mode}): {len(r.manifest.shards)} shards, "
        f"{r.manifest.num_samples:,} samples"
    )


@main.command("index")
@click.argument("shards", nargs=-1, required=True)
@click.argument("out")
@click.option("--overwrite", is_flag=True, help="Replace an index.json already in OUT.")
@click.option(
    "--max-member-size",
    default="1GiB",
    help="Refuse a shard with a larger member (one field of one sample); 0: no limit.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@storage_option
def index_command(
    shards: tuple[str, ...],
    out: str,
    overwrite: bool,
    max_member_size: str,
    quiet: bool,
    storage_option: tuple[str, ...],
) -> None:
    """Write a manifest in OUT for existing webdataset tars or Parquet files, without
    rewriting them.

    SHARDS are .tar/.tar.gz/.tar.zst or .parquet files (local, or in an object store such as
    s3://) or folders holding them, inside OUT (the manifest points at them where they are).
    A Parquet file is one shard, a row a sample, a column a field read as `pack` reads it
    (Hugging Face Image and ClassLabel included).  Files of several Hub splits
    (data/train-00000-of-00002.parquet, data/test-...) get one manifest a split:
    OUT/index.train.json, OUT/index.test.json.
    """
    from shardloader.pack.index_existing import index_shards

    with progress_bar(show_progress(quiet), unit="shard", desc="index") as bar:
        r = index_shards(
            shards,
            out,
            overwrite=overwrite,
            storage_options=storage_options(storage_option),
            progress=counter(bar),
            max_member_bytes=parse_size(max_member_size),
        )
    for split, m in (r.splits or {"": r.manifest}).items():
        into = f"{out.rstrip('/')}/index.{split}.json" if split else out
        click.echo(f"indexed {len(m.shards)} shards, {m.num_samples:,} samples into {into}")
