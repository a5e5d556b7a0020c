"""Options and helpers several commands share: storage options, progress bars, interruption.

Like every module of this package it imports only click and light shardloader modules at the
top (see NOTE in :mod:`shardloader.cli`).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import click

from shardloader.errors import UsageError

storage_option = click.option(
    "--storage-option", "-o", "storage_option", multiple=True, metavar="KEY=VALUE",
    help="fsspec storage option for SRC and OUT (repeatable; VALUE parsed as JSON if it can be).",
)


def storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``-o KEY=VALUE`` options as fsspec storage options (VALUE parsed as JSON if it can be)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {pair!r}: use KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def show_progress(quiet: bool) -> bool:
    """Progress bars only on a terminal, and never with ``--quiet``."""
    return not quiet and sys.stderr.isatty()


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C: the library cleans up its temporary files."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
