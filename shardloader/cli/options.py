"""Options and helpers several commands share: storage options, retries, a dataset's flags,
progress bars, interruption.

Like every module of this package it imports only click and light shardloader modules at the
top (see NOTE in :mod:`shardloader.cli`).
"""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click

from shardloader.errors import UsageError
from shardloader.presets import TRANSFORMS  # light: dataclasses and errors only

__all__ = [
    "DATASET_FLAGS",
    "dataset_options",
    "dataset_preset",
    "interruptible",
    "parse_pairs",
    "retry_options",
    "retry_policy",
    "show_progress",
    "storage_options",
]


if TYPE_CHECKING:
    from shardloader.presets import DatasetPreset
    from shardloader.storage.retry import RetryPolicy

F = TypeVar("F", bound=Callable[..., Any])

storage_option = click.option(
    "--storage-option",
    "-o",
    "storage_option",
    multiple=True,
    metavar="KEY=VALUE",
    help="fsspec storage option for the URLs given, e.g. endpoint_url=http://host:9000 "
    "(repeatable; VALUE parsed as JSON if it can be).",
)


def parse_pairs(values: Iterable[str], flag: str, form: str) -> dict[str, Any]:
    """A repeatable ``flag``'s ``NAME=VALUE`` values as ``{name: value}``, the value parsed as
    JSON where it is JSON (a number, ``null``...), else the text itself: ``--fill txt= --fill
    cls=-1`` → ``{"txt": "", "cls": -1}``.  A value without ``=`` or name is a UsageError
    naming ``flag``, the value and the ``form`` to give."""
    out: dict[str, Any] = {}
    for value in values:
        name, sep, text = value.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"{flag} {value!r}: give {form}")
        try:
            out[name.strip()] = json.loads(text)
        except ValueError:
            out[name.strip()] = text
    return out


def storage_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``-o KEY=VALUE`` options as fsspec storage options."""
    return parse_pairs(
        pairs, "--storage-option", "KEY=VALUE, e.g. -o endpoint_url=http://host:9000"
    )


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


# -- retries: the library's RetryPolicy, for every command that reads or writes storage ------

# Copies of RetryPolicy()'s defaults for the help text (tests/test_cli_imports.py checks them);
# unset flags leave the library's own policy in place.
DEFAULT_RETRIES = 99  # = RetryPolicy().max_attempts - 1
DEFAULT_RETRY_SECONDS = 120.0  # = RetryPolicy().max_total_seconds
RETRY_FLAGS = ("retries", "retry_seconds")


def retry_options(f: F) -> F:
    """``--retries N`` and ``--retry-seconds S``: :func:`retry_policy` turns them into the
    library's ``RetryPolicy``."""
    f = click.option(
        "--retry-seconds",
        type=click.FloatRange(min=0, min_open=True),
        metavar="S",
        help="Time budget of a storage request: retry transient faults (timeout, reset, "
        "refused connection, 5xx, throttling) with backoff growing to 10 s between tries, "
        "and start no new attempt S seconds after the first, so an outage shorter than S "
        f"is ridden out (default {DEFAULT_RETRY_SECONDS:g}).",
    )(f)
    return click.option(
        "--retries",
        type=click.IntRange(min=0),
        metavar="N",
        help="At most N retries of a storage request within --retry-seconds: a cap for "
        "failures faster than the backoff; at the default the time budget ends a request "
        f"first (default {DEFAULT_RETRIES}).",
    )(f)


def retry_policy(retries: int | None, retry_seconds: float | None) -> RetryPolicy | None:
    """The ``RetryPolicy`` the flags ask for; None when neither is given (library default)."""
    if retries is None and retry_seconds is None:
        return None
    from shardloader.storage.retry import RetryPolicy

    changes: dict[str, Any] = {}
    if retries is not None:
        changes["max_attempts"] = retries + 1
    if retry_seconds is not None:
        changes["max_total_seconds"] = retry_seconds
    return RetryPolicy(**changes)


# -- a dataset from flags: serve DATASET and bench DATASET -----------------------------------

DATASET_FLAGS = (
    "batch_size",
    "shuffle",
    "seed",
    "transform",
    "image_size",
    "image_field",
    "cache_dir",
    "storage_option",
    *RETRY_FLAGS,
)


def dataset_options(*, batch_size: int | None, transform: str) -> Callable[[F], F]:
    """The flags that describe a dataset (:class:`shardloader.presets.DatasetPreset`), one set
    for every command that reads one; ``batch_size`` and ``transform`` are the command's
    defaults.  :func:`dataset_preset` collects them."""
    options = [
        click.option(
            "--batch-size",
            type=click.IntRange(min=1),
            default=batch_size,
            help="Samples per batch"
            + ("." if batch_size else " (default: none, samples one by one)."),
        ),
        click.option(
            "--shuffle/--no-shuffle",
            default=False,
            help="Shuffle shards and samples (seeded by --seed).",
        ),
        click.option(
            "--seed",
            type=int,
            default=0,
            help="Seed of the shuffle and of the transform's random draws.",
        ),
        click.option(
            "--transform",
            type=click.Choice(TRANSFORMS),
            default=transform,
            help="Built-in image transform to --image-size "
            "(shardloader.vision): train (random resized crop + flip), eval (resize + "
            "centre crop), auto (train when the dataset has an image field) or none.",
        ),
        click.option(
            "--image-size",
            type=click.IntRange(min=1),
            default=224,
            help="Output side of the image transform.",
        ),
        click.option(
            "--image-field",
            help="Image field the transform applies to (default: "
            "'image', which class-folder packs hold whatever the extensions, else the "
            "first).",
        ),
        click.option(
            "--cache-dir",
            type=click.Path(file_okay=False),
            help="Node-local cache for staged shards.",
        ),
        storage_option,
        retry_options,
    ]

    def decorate(f: F) -> F:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate


def dataset_preset(flags: dict[str, Any], **extra: Any) -> DatasetPreset:
    """Take the :func:`dataset_options` flags out of a command's keyword arguments, as a
    preset; ``extra`` sets further preset fields (serve's ``uneven`` and ``decode``)."""
    from shardloader.presets import DatasetPreset

    f = {name: flags.pop(name) for name in DATASET_FLAGS}
    return DatasetPreset(
        storage_options=storage_options(f.pop("storage_option")),
        retry=retry_policy(f.pop("retries"), f.pop("retry_seconds")),
        **f,
        **extra,
    )
