"""Find the raw inputs, ask the registered layouts whose they are, and describe the source.

Files are listed (:mod:`.listing`: sizes from ``stat``/``find``, never read; hidden and system
files left out and reported) in sorted order; the chosen layout (``--layout``, or the one whose
``detect`` wins, see :class:`~shardloader.pack.layouts.Layout`) works out fields, classes and
the sample stream, sorted by key, so the stream is a pure function of the input tree.  The
layouts themselves live in :mod:`shardloader.pack.layouts`, one module each; this module names
none.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.labels import Labelled, attach_labels, read_labels
from shardloader.pack.layouts.base import Inputs, Layout, Source
from shardloader.pack.layouts.registry import AUTO, get_layout, layout_names, registered_layouts
from shardloader.pack.listing import below, scan_inputs
from shardloader.pack.refs import InputFile
from shardloader.read.fields import Aliases, merge, normalize
from shardloader.storage.store import Store, as_store

__all__ = ["discover"]

log = logging.getLogger(__name__)


# -- layout detection -----------------------------------------------------------------------


def detect(src: str, files: tuple[InputFile, ...]) -> Layout:
    """Ask every registered layout; the highest-ranked answer wins.

    An answer is "fits" or "mixed" (some files are unmistakably that layout's, others not),
    at the layout's rank or at a rank of its own (:attr:`Verdict.rank`).  At the top rank a
    mixed answer is an error naming one file of each kind, and two layouts that both fit are
    an ambiguity error naming both readings: either way ``--layout`` settles it.
    """
    answers = [(layout, layout.detect(files)) for layout in registered_layouts()]
    ranked = [
        (layout, v, layout.rank if v.rank is None else v.rank)
        for layout, v in answers
        if v.fits or v.mixed
    ]
    if not ranked:
        raise UsageError(
            f"{src}: unknown layout: no registered layout ({', '.join(layout_names())}) takes "
            "these files; pass --layout"
        )
    top = max(rank for _, _, rank in ranked)
    for _, v, rank in ranked:
        if rank == top and v.mixed:
            raise UsageError(
                f"{src}: mixed layouts: {v.mixed}; pack them separately or pass --layout"
            )
    fitting = [(layout, v) for layout, v, rank in ranked if rank == top]
    if len(fitting) > 1:
        names = " and ".join(repr(layout.name) for layout, _ in fitting)
        readings = "; ".join(
            f"as {layout.name}{', ' + v.reading if v.reading else ''} (--layout {layout.name})"
            for layout, v in fitting
        )
        raise UsageError(
            f"{src}: ambiguous layout: {names} both fit: {readings}; pass the --layout you mean"
        )
    return fitting[0][0]


def discover(
    src: str | Store,
    layout: str = AUTO,
    *,
    text_field: str = "text",
    tokenize: bool = False,
    aliases: Aliases | None = None,
    labels: str | None = None,
    on_error: str = "fail",
) -> Source:
    """List ``src`` (a URL, or a Store carrying its storage options and retry policy), decide
    its layout, and work out fields, classes, aliases and the text rule.

    ``aliases`` (``--alias``) merge over the layout's own (class folders, key groups:
    ``image``).  ``labels`` (``--labels``): a labels file for a flat image folder (see
    :mod:`shardloader.pack.labels`); ``on_error="skip"`` leaves out and lists the files it has
    no label for, instead of refusing them."""
    impl = None if layout == AUTO else get_layout(layout)
    store = as_store(src)
    src = store.url
    inputs = scan_inputs(store)
    labels_store = None if labels is None else Store(labels, store.options, store.retry)
    inside = None if labels_store is None else below(labels_store, store)
    if inside:  # the labels file lies in SRC: it is no input
        inputs = inputs.without([(inside, "the --labels file")])
    ignored = inputs.ignored
    if ignored:
        log.info(
            "%s: left out %d hidden or system files (e.g. %r)", src, len(ignored), ignored[0][0]
        )
    if not inputs.files:
        only = f" (only hidden or system files, e.g. {ignored[0][0]!r})" if ignored else ""
        raise UsageError(f"{src}: no input files (empty source{only}); nothing to pack")
    if impl is None:
        impl = detect(src, inputs.files)
        log.info("%s: detected layout %s (%d files)", src, impl.name, len(inputs.files))
    found = impl.describe(inputs)
    if found.left_out:  # junk the layout recognised: reported as the listing's leftovers are
        inputs = inputs.without(found.left_out)
        log.info("%s: left out %d files that are no sample's", src, len(found.left_out))
    fields = dict(found.fields)
    classes = found.classes
    key_labels: Mapping[str, bytes] = {}
    if labels_store is not None:
        labelled = _labels(src, impl, inputs, fields, labels_store, on_error == "skip")
        inputs = inputs.without(labelled.left_out)
        fields["cls"] = FieldInfo("int")
        classes, key_labels = labelled.classes, labelled.labels
    text = impl.text_rule(fields, text_field, tokenize)
    if tokenize and text is None:
        raise UsageError(
            f"--tokenizer needs text: {src} ({impl.name}) has no field {text_field!r}, 'txt' or "
            "'json'; pass --text-field"
        )
    groups = _aliases(src, fields, found.aliases, normalize(_lower(aliases), "--alias"))
    # the layout's notes say what its own aliases did: moot once --alias took those over
    notes = found.notes if all(name in groups for name in found.aliases) else ()
    source = Source(inputs, impl, fields, classes, text, groups, notes, key_labels)
    source.field_map  # noqa: B018 - checks the aliases now, before anything is read
    return source


def _labels(
    src: str,
    impl: Layout,
    inputs: Inputs,
    fields: Mapping[str, FieldInfo],
    labels: Store,
    skip: bool,
) -> Labelled:
    """``--labels`` matched to the samples of a flat folder (key groups)."""
    from shardloader.format.tar.format import split_key

    if impl.name == "class-folders":
        why = "its layout is class-folders, whose folder names are the labels already"
    elif impl.name != "key-groups":
        why = f"its layout is {impl.name}, whose records hold their own fields"
    elif "cls" in fields:
        why = "its samples have a field 'cls' already"
    else:
        why = ""
    if why:
        raise UsageError(
            f"--labels {labels.url}: labels attach to a folder of files, one sample each (key "
            f"groups); {src}: {why}; drop --labels"
        )
    keys = {f.rel: split_key(f.rel)[0] for f in inputs.files}  # type: ignore[index]
    rows = read_labels(labels)
    return attach_labels(rows, inputs.files, keys, labels.url.rsplit("/", 1)[-1], skip)


def _lower(aliases: Aliases | None) -> dict[str, tuple[str, ...]] | None:
    """``--alias`` extensions without case, as layouts compare extensions: ``image=JPEG``."""
    if not aliases or not isinstance(aliases, Mapping):
        return aliases  # type: ignore[return-value]  # normalize names what is wrong
    return {
        name: tuple(e.lower() if isinstance(e, str) else e for e in exts)
        if isinstance(exts, (list, tuple, set, frozenset))
        else exts
        for name, exts in aliases.items()
    }


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
