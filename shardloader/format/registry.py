"""Shard formats by name: the one place that maps ``"tar"`` to its :class:`Format` object.

The built-in formats register themselves when their module is first imported, which happens on
the first lookup of their name, so importing this module costs nothing (``shardloader --help``
may ask for the names).  A third-party format registers from its own module::

    from shardloader.format.registry import register_format
    register_format(MyFormat())

and must be imported before a manifest naming it is read, in every process that reads one:
DataLoader workers forked from the training process (the default on Linux) inherit it; spawned
ones need the module imported where the dataset is unpickled.  Pack workers import it
themselves (``WriteSpec.format_module``).  An unknown name is an error that lists the known ones:
nothing falls through to a default format.

Everything else is asked of the format object: ``get_format(name).method(...)``.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, BinaryIO

from shardloader.errors import UsageError
from shardloader.format.base import Format, ShardWriter

if TYPE_CHECKING:
    from shardloader.manifest import FieldInfo

__all__ = [
    "COMPRESSIONS",
    "check_pack_format",
    "format_module",
    "get_format",
    "known_formats",
    "open_writer",
    "register_format",
    "unregister_format",
]

log = logging.getLogger(__name__)

# Whole-stream compressions the manifest knows (schema.MAX_EXPANSION bounds each one).
COMPRESSIONS = ("zstd", "gzip", "none")

_BUILTIN = {
    "tar": "shardloader.format.tar.format",
    "arrow": "shardloader.format.arrow.format",
    "tokens": "shardloader.format.tokens.format",
    "parquet": "shardloader.format.parquet.format",
}
_FORMATS: dict[str, Format] = {}


def register_format(fmt: Format, *, replace: bool = False) -> Format:
    """Make ``fmt`` known under ``fmt.name``; return it (usable as a module-level statement).

    A second format under a taken name is a UsageError unless ``replace``: two plugins that
    claim one name would otherwise read each other's shards.
    """
    if not isinstance(fmt, Format):
        raise UsageError(f"register_format needs a shardloader.format.Format, got {fmt!r}")
    name = fmt.name
    if not name or not name.isidentifier():
        raise UsageError(f"a shard format needs a name like 'tar' (an identifier), got {name!r}")
    unknown = [c for c in fmt.suffixes if c not in COMPRESSIONS]
    if not fmt.suffixes or unknown:
        raise UsageError(
            f"shard format {name!r}: suffixes must map some of {', '.join(COMPRESSIONS)} to "
            f"file suffixes, got {dict(fmt.suffixes)!r}"
        )
    if "where" in inspect.signature(fmt.reader).parameters:
        raise UsageError(
            f"shard format {name!r}: reader() and stage() no longer take `where` (the caller "
            "names the shard in their errors); drop that argument"
        )
    old = _FORMATS.get(name)
    if old is not None and old is not fmt and not replace:
        raise UsageError(
            f"shard format {name!r} is registered already ({old!r}); pass replace=True to "
            "replace it"
        )
    _FORMATS[name] = fmt
    log.debug("registered shard format %r", name)
    return fmt


def unregister_format(name: str) -> None:
    """Forget a registered format (a built-in comes back on its next lookup)."""
    _FORMATS.pop(name, None)


def known_formats() -> tuple[str, ...]:
    """Names of the built-in and registered formats, built-ins first."""
    return tuple(_BUILTIN) + tuple(n for n in _FORMATS if n not in _BUILTIN)


def get_format(name: str, module: str = "") -> Format:
    """The format called ``name``; UsageError naming the known ones if there is none.

    ``module``: where the format is defined (:func:`format_module`), imported when the name is
    unknown here: how a fresh process (a pack worker) finds a third-party format.
    """
    fmt = _FORMATS.get(name)
    if fmt is None and name in _BUILTIN:  # its module registers it on import (again if needed)
        fmt = _FORMATS.setdefault(name, importlib.import_module(_BUILTIN[name]).FORMAT)
    if fmt is None and module:
        importlib.import_module(module)
        fmt = _FORMATS.get(name)
    if fmt is None:
        raise UsageError(
            f"unknown shard format {name!r}; known: {', '.join(known_formats())} (a "
            "third-party format is known once its module has called register_format)"
        )
    return fmt


def format_module(name: str) -> str:
    """The module that defines format ``name`` (for :func:`get_format` in another process)."""
    return type(get_format(name)).__module__


def check_pack_format(fmt: str, compression: str) -> None:
    """The ``--format``/``--compression`` checks of PackOptions, as UsageErrors."""
    if fmt not in known_formats():
        raise UsageError(f"--format {fmt!r}: choose one of {', '.join(known_formats())}")
    if compression not in COMPRESSIONS:
        raise UsageError(f"--compression {compression!r}: choose one of {', '.join(COMPRESSIONS)}")
    found = get_format(fmt)
    if not found.packable:  # read in place only (parquet: ``index``)
        raise UsageError(
            f"--format {fmt!r}: pack does not write {fmt} shards (`shardloader index` adopts "
            f"existing ones); choose one of "
            f"{', '.join(n for n in known_formats() if get_format(n).packable)}"
        )
    found.check_compression(compression)


# -- opening a writer ------------------------------------------------------------


def open_writer(
    fmt: str, fileobj: BinaryIO, compression: str, fields: Mapping[str, FieldInfo]
) -> ShardWriter:
    """A writer of format ``fmt``, once ``compression`` is checked to be one it writes."""
    f = get_format(fmt)
    f.check_compression(compression)
    return f.writer(fileobj, compression, fields)
