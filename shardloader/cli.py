"""The ``shardloader`` command: thin commands over the library; errors become exit codes.

``ShardloaderError`` → exit 1 with its message; ``UsageError`` (and click's own usage errors)
→ exit 2.  The library never prints or exits; only this module does.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from shardloader.errors import ShardloaderError, UsageError


class _Group(click.Group):
    """Maps library errors to exit codes in one place."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(2)
        except ShardloaderError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(package_name="shardloader")
def main() -> None:
    """Pack raw files into verified shards and stream them into PyTorch."""


# Commands live next to what they drive; importing registers them on ``main``.
from shardloader import bench_commands as _bench_commands  # noqa: E402,F401
from shardloader.pack import commands as _pack_commands  # noqa: E402,F401
from shardloader.service import commands as _service_commands  # noqa: E402,F401
