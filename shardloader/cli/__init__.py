"""The ``shardloader`` command: thin commands over the library; errors become exit codes.

``ShardloaderError`` → exit 1 with its message; ``UsageError`` (and click's own usage errors)
→ exit 2.  The library never exits and never prints, except the report line of ``monitor()``, an
explicit channel with an off switch (``report=None``); only this package prints otherwise.
"""

from __future__ import annotations

from shardloader.cli.group import main

__all__ = ["main"]

# One module per command family; importing one registers its commands on ``main``.
# NOTE: these modules import only click and shardloader.errors at the top; each command imports
# the library (torch, numpy, pyarrow, fsspec) when it runs, so `--help` and usage errors answer
# at once.  tests/test_cli_imports.py checks it in fresh processes.
from shardloader.cli import adopt as _adopt  # noqa: E402,F401
from shardloader.cli import bench as _bench  # noqa: E402,F401
from shardloader.cli import cache as _cache  # noqa: E402,F401
from shardloader.cli import inspection as _inspection  # noqa: E402,F401
from shardloader.cli import pack as _pack  # noqa: E402,F401
from shardloader.cli import plan as _plan  # noqa: E402,F401
from shardloader.cli import serve as _serve  # noqa: E402,F401
