"""``shardloader cache info | clear``: what the node-local shard cache holds, and emptying it.

Clearing is safe while training runs use the cache: a shard being staged right now is left in
place (and reported), open copies stay readable, and a run that needs a cleared shard stages it
again (see NOTE [eviction and clearing] in ``shardloader.storage.cachedir``).  Only a cache of the
user's own is cleared: the legacy root in the shared temp dir is left alone when another user
made it, or when it is a symbolic link (NOTE [a cache of one's own] in storage/private.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import TYPE_CHECKING

import click

from shardloader.cli.group import main
from shardloader.cli.options import storage_option, storage_options
from shardloader.errors import UsageError
from shardloader.units import human_bytes

__all__ = ["cache_group", "info_command", "clear_command"]


if TYPE_CHECKING:
    from shardloader.storage.cachedir import ClearReport

# = shardloader.storage.cachedir.DIR_ENV; that module is imported when a command runs (importing
# shardloader.storage pulls in fsspec, too slow for --help)
DIR_ENV = "SHARDLOADER_CACHE_DIR"
_cache_dir = click.option(
    "--cache-dir",
    metavar="DIR",
    help=f"Cache root (default: ${DIR_ENV}, else $XDG_CACHE_HOME/shardloader, else "
    "~/.cache/shardloader).",
)


@main.group("cache")
def cache_group() -> None:
    """Inspect or empty the node-local cache of staged shards."""


def _root(cache_dir: str | None) -> tuple[str, str]:
    """(the cache root, where it comes from, as this command's user names it)."""
    from shardloader.storage.cachedir import DIR_SOURCE, cache_root

    root, source = cache_root(cache_dir)
    return root, "--cache-dir" if source == DIR_SOURCE else source


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


@cache_group.command("info")
@_cache_dir
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--uploads",
    "uploads_out",
    metavar="OUT",
    help="Instead: the incomplete multipart uploads under OUT (s3://), each marked as a "
    "shardloader run's or another writer's.",
)
@storage_option
def info_command(
    cache_dir: str | None, as_json: bool, uploads_out: str | None, storage_option: tuple[str, ...]
) -> None:
    """Show the cache root, each dataset's staged shards and size, the total and the limit."""
    if uploads_out is not None:
        _uploads_info(uploads_out, storage_options(storage_option), as_json)
        return
    from shardloader.storage.cachedir import cache_limit, legacy_root, root_problem, usage

    root, root_source = _root(cache_dir)
    refused = root_problem(root)
    datasets = sorted(usage(root), key=lambda d: d.last_used or 0.0, reverse=True)
    limit, limit_source = cache_limit(root)
    total = sum(d.bytes for d in datasets)
    legacy = None
    if cache_dir is None and os.path.abspath(legacy_root()) != root:
        old = usage(legacy_root()) if _legacy_problem(legacy_root()) is None else []
        legacy = (legacy_root(), sum(d.bytes for d in old)) if old else None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "root": root,
                    "root_source": root_source,
                    "refused": refused,
                    "limit": limit,
                    "limit_source": limit_source,
                    "bytes": total,
                    "datasets": [dataclasses.asdict(d) for d in datasets],
                    "legacy": None if legacy is None else {"root": legacy[0], "bytes": legacy[1]},
                },
                indent=1,
            )
        )
        return
    lines = [
        f"cache root {root}  ({root_source})",
        *([f"  refused  it {refused}: runs and `cache clear` will not use it"] if refused else []),
        f"  limit    {human_bytes(limit)}  ({limit_source})",
        f"  total    {human_bytes(total)} in {len(datasets)} dataset"
        f"{'' if len(datasets) == 1 else 's'}",
    ]
    for d in datasets:
        other = f" (+{d.other_files} sample indexes/lengths)" if d.other_files else ""
        lines.append(
            f"    {d.fingerprint}  {d.shards:>5} shards{other}  {human_bytes(d.bytes):>9}  "
            f"last used {_when(d.last_used)}"
        )
        lines += [f"      source {url}" for url in d.sources]
        lines.append(f"      path   {d.folder}")
    if legacy is not None:
        lines.append(
            f"  {legacy[0]} (an earlier shardloader's cache) holds "
            f"{human_bytes(legacy[1])}: `shardloader cache clear` removes it"
        )
    click.echo("\n".join(lines))


@cache_group.command("clear")
@click.argument("fingerprint", required=False)
@_cache_dir
def clear_command(fingerprint: str | None, cache_dir: str | None) -> None:
    """Remove staged shards: all, or one dataset's (FINGERPRINT, or a unique prefix of it, as
    `cache info` lists them).  Safe while other processes use the cache."""
    from shardloader.storage.cachedir import clear, legacy_root, usage

    root = _root(cache_dir)[0]
    roots = [root]
    if fingerprint is not None:
        known = [d.fingerprint for d in usage(root)]
        matches = [f for f in known if f.startswith(fingerprint)] if fingerprint else []
        if fingerprint in known:
            matches = [fingerprint]
        if len(matches) != 1:
            what = "matches no dataset" if not matches else f"matches {len(matches)} datasets"
            raise UsageError(
                f"FINGERPRINT {fingerprint!r} {what} in the cache at {root} "
                f"(`shardloader cache info` lists them)"
            )
        fingerprint = matches[0]
    elif cache_dir is None and os.path.abspath(legacy_root()) != root:
        legacy = legacy_root()
        problem = _legacy_problem(legacy)
        if problem is None:
            roots.append(legacy)
        elif os.path.lexists(legacy):
            click.echo(
                f"left {legacy} (an earlier shardloader's cache, in the shared temp dir) alone: "
                f"it {problem}"
            )
    for where in roots:
        report = clear(where, fingerprint)
        if where == root or report.files:
            click.echo(_cleared(where, report))


def _legacy_problem(path: str) -> str | None:
    """Why the legacy root must not be touched (anyone may create it, or a link there)."""
    from shardloader.storage.cachedir import root_problem

    if os.path.islink(path):
        return "is a symbolic link"
    return root_problem(path)


def _cleared(root: str, r: ClearReport) -> str:
    text = f"removed {r.files} staged shard files ({human_bytes(r.bytes)}) from {root}"
    if r.busy:
        text += f"; {len(r.busy)} being staged by another process right now were left in place"
    return text


def _uploads_info(out: str, options: dict[str, object], as_json: bool) -> None:
    """What ``pack --resume``/``--overwrite`` would abort (NOTE [multipart journal] in
    storage/uploads.py), and what it leaves to its own writer."""
    from dataclasses import asdict

    from shardloader.storage.store import Store
    from shardloader.storage.uploads import incomplete_uploads

    store = Store(out, options)
    if store.is_local or store.protocol not in ("s3", "s3a"):
        raise UsageError(f"--uploads {out!r}: incomplete multipart uploads exist on s3:// only")
    found = incomplete_uploads(store)
    if as_json:
        click.echo(json.dumps({"out": store.url, "uploads": [asdict(u) for u in found]}, indent=1))
        return
    lines = [f"incomplete multipart uploads under {store.url}: {len(found)}"]
    for u in found:
        whose = (
            f"shardloader run {u.run} (killed; the next pack --resume or --overwrite aborts it)"
            if u.run
            else "another writer's (left alone)"
        )
        lines.append(f"  {u.key}  started {u.initiated}  {whose}")
    click.echo("\n".join(lines))
