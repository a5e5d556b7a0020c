"""The ``shardloader`` click group: library errors become exit codes, in one place."""

from __future__ import annotations

import sys
from typing import Any

import click

from shardloader import __version__
from shardloader.cli.advice import in_cli_terms
from shardloader.errors import ShardloaderError, UsageError

__all__ = ["main"]


class _Group(click.Group):
    """Maps library errors to exit codes in one place."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ShardloaderError as err:
            click.echo(f"error: {in_cli_terms(str(err))}", err=True)
            sys.exit(2 if isinstance(err, UsageError) else 1)


# every option shows its default in --help (one that has none shows nothing)
@click.group(cls=_Group, context_settings={"show_default": True})
# the package's own version (no installed metadata needed: a checkout on PYTHONPATH has none),
# and one name whichever way it was started (`shardloader` or `python -m shardloader`)
@click.version_option(__version__, prog_name="shardloader", message="%(prog)s %(version)s")
def main() -> None:
    """Pack raw files into verified shards and stream them into PyTorch."""
