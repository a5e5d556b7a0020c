"""Find the raw inputs, ask the registered layouts whose they are, and describe the source.

Files are listed (sizes from ``stat``/``find``, never read) in sorted order; the chosen layout
(``--layout``, or the one whose ``detect`` wins, see :class:`~shardloader.pack.layouts.Layout`)
works out fields, classes and the sample stream, sorted by key, so the stream is a pure function
of the input tree.  Hidden files and folders (names starting with ``.``) are ignored.  The layouts
themselves live in :mod:`shardloader.pack.layouts`, one module each; this module names none.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from shardloader.aliases import Aliases, merge, normalize
from shardloader.errors import StorageError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import Inputs, Layout, OnSkip, Source
from shardloader.pack.layouts.records import record_kind
from shardloader.pack.layouts.registry import AUTO, get_layout, layout_names, registered_layouts
from shardloader.pack.refs import FileRef, InputFile, SampleRef, TextRule
from shardloader.storage.store import Store, as_store, join

__all__ = [
    "FileRef",
    "SampleRef",
    "InputFile",
    "OnSkip",
    "TextRule",
    "Source",
    "detect",
    "discover",
    "list_inputs",
    "record_kind",  # index_existing refuses record files with it
]

log = logging.getLogger(__name__)


# -- listing --------------------------------------------------------------------------------


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def list_inputs(src: str | Store) -> list[InputFile]:
    """Every non-hidden file below ``src`` (a URL, or a Store with its options and retry
    policy), or ``src`` itself if it is a file, sorted.

    A file that cannot be stat'ed (a symlink loop, a dangling link) is listed with size 0, so
    the error surfaces where the file is read, under the pack's ``--on-error`` policy.
    """
    store = as_store(src)
    if store.is_local:
        root = os.path.abspath(store.local_path)
        if os.path.isfile(root) or (os.path.exists(root) and not os.path.isdir(root)):
            return [InputFile(os.path.basename(root), root, os.stat(root).st_size)]
        if not os.path.isdir(root):
            raise UsageError(f"source {store.url!r} does not exist")
        out = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if name.startswith("."):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                try:
                    size = os.stat(path).st_size
                except OSError as err:
                    # Listed anyway (size 0): reading it fails and, like any unreadable file,
                    # fails the pack naming it, or under --on-error skip is reported and skipped.
                    log.warning("%s: cannot stat (%s)", path, err.strerror)
                    size = 0
                out.append(InputFile(rel, path, size))
        return sorted(out, key=lambda f: f.rel)
    fs, path = store.filesystem()
    path = path.rstrip("/")
    src = store.url
    try:
        if fs.isfile(path):
            return [InputFile(path.rsplit("/", 1)[-1], src, int(fs.size(path)))]
        found = fs.find(path, detail=True)
    except OSError as err:
        raise StorageError(f"cannot list {src!r}: {err}") from err
    out = []
    for full, info in found.items():
        if info.get("type", "file") != "file":
            continue
        rel = full[len(path) + 1 :]
        if rel and not _hidden(rel):
            out.append(InputFile(rel, join(src, rel), int(info.get("size") or 0)))
    return sorted(out, key=lambda f: f.rel)


# -- layout detection -----------------------------------------------------------------------


def detect(src: str, files: tuple[InputFile, ...]) -> Layout:
    """Ask every registered layout; the highest-ranked answer wins.

    An answer is "fits" or "mixed" (some files are unmistakably that layout's, others not).  At
    the top rank a mixed answer is an error naming one file of each kind, and two layouts that
    both fit are an ambiguity error: either way ``--layout`` settles it.
    """
    answers = [(layout, layout.detect(files)) for layout in registered_layouts()]
    answers = [(layout, v) for layout, v in answers if v.fits or v.mixed]
    if not answers:
        raise UsageError(
            f"{src}: unknown layout: no registered layout ({', '.join(layout_names())}) takes "
            "these files; pass --layout"
        )
    top = max(layout.rank for layout, _ in answers)
    for layout, v in answers:
        if layout.rank == top and v.mixed:
            raise UsageError(
                f"{src}: mixed layouts: {v.mixed}; pack them separately or pass --layout"
            )
    fitting = [layout for layout, _ in answers if layout.rank == top]
    if len(fitting) > 1:
        names = " and ".join(repr(layout.name) for layout in fitting)
        raise UsageError(f"{src}: ambiguous layout: {names} both fit; pass --layout")
    return fitting[0]


def discover(
    src: str | Store,
    layout: str = AUTO,
    *,
    text_field: str = "text",
    tokenize: bool = False,
    aliases: Aliases | None = None,
) -> Source:
    """List ``src`` (a URL, or a Store carrying its storage options and retry policy), decide
    its layout, and work out fields, classes, aliases and the text rule.

    ``aliases`` (``--alias``) merge over the layout's own (class folders: ``image``)."""
    impl = None if layout == AUTO else get_layout(layout)
    store = as_store(src)
    src = store.url
    files = tuple(list_inputs(store))
    if not files:
        raise UsageError(f"{src}: no input files (empty source); nothing to pack")
    if impl is None:
        impl = detect(src, files)
        log.info("%s: detected layout %s (%d files)", src, impl.name, len(files))
    inputs = Inputs(store, files)
    found = impl.describe(inputs)
    fields = dict(found.fields)
    text = impl.text_rule(fields, text_field, tokenize)
    if tokenize and text is None:
        raise UsageError(
            f"--tokenizer needs text: {src} ({impl.name}) has no field {text_field!r}, 'txt' or "
            "'json'; pass --text-field"
        )
    groups = _aliases(src, fields, found.aliases, normalize(aliases, "--alias"))
    source = Source(inputs, impl, fields, found.classes, text, groups)
    source.field_map  # noqa: B018 - checks the aliases now, before anything is read
    return source


def _aliases(
    src: str, fields: Mapping[str, FieldInfo], own: Aliases, given: Aliases
) -> dict[str, tuple[str, ...]]:
    """The layout's own aliases with the given ones over them, keeping only extensions the
    source has."""
    out = {}
    for name, exts in merge(own, given).items():
        seen = tuple(e for e in exts if e in fields)
        if not seen:
            raise UsageError(
                f"--alias {name}={','.join(exts)}: {src} has none of these fields "
                f"(fields: {', '.join(sorted(fields))})"
            )
        out[name] = seen
    return out
