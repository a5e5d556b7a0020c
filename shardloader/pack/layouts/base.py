"""What an input layout is: the :class:`Layout` contract, its answers, and the discovered source.

A layout turns a listed source tree into fields, classes and one deterministic sample stream.
Each one lives in its own module under :mod:`shardloader.pack.layouts` and is registered once
(:func:`~shardloader.pack.layouts.registry.register_layout`); discovery asks every registered
layout whether the files are its own and never names one itself.

NOTE [layouts run in the main process]: ``detect``, ``describe`` and ``enumerate`` run where
``pack`` was called, never in a pack worker.  The samples they yield cross into workers as
:class:`~shardloader.pack.refs.SampleRef` tuples (record bytes, or file references that the
worker opens), so a layout needs no registration in the worker and may import what it likes.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from shardloader.errors import InputError
from shardloader.manifest import FieldInfo
from shardloader.pack.refs import InputFile, LineRun, SampleRef, TextRule
from shardloader.read.fields import Aliases, FieldMap
from shardloader.storage.store import Store

__all__ = [
    "Layout",
    "Verdict",
    "FITS",
    "NO_FIT",
    "mixed",
    "Inputs",
    "Description",
    "Source",
    "OnSkip",
    "each_file",
    "text_rule",
    "extension",
]

log = logging.getLogger(__name__)

OnSkip = Callable[[str, str, str], None]  # (file relative to SRC, where in it, reason)


@dataclass(frozen=True)
class Verdict:
    """A layout's answer to "are these files mine?".

    ``fits``: every file belongs to it.  ``mixed``: some files are unmistakably its own and
    others are not, which is an error rather than a reason to fall back to another layout; it
    says what, e.g. ``"record files (e.g. 'a.jsonl') next to other files (e.g. 'b.jpg')"``.
    ``rank``: this answer's rank when it differs from the layout's (key groups answer at 10
    when the names show real grouping, at their own 0, a fallback, otherwise).  ``reading``:
    what packing the files this way gives (``"40 samples, one per image, in 2 classes"``),
    for the message that names both readings when two layouts fit.
    """

    fits: bool
    mixed: str = ""
    rank: int | None = None
    reading: str = ""


FITS = Verdict(True)
NO_FIT = Verdict(False)


def mixed(what: str, mine: str, other: str) -> Verdict:
    """Some files are ``what`` (e.g. ``mine``) and others (e.g. ``other``) are not."""
    return Verdict(False, f"{what} (e.g. {mine!r}) next to other files (e.g. {other!r})")


@dataclass(frozen=True)
class Inputs:
    """What discovery listed (:func:`shardloader.pack.listing.scan_inputs`): the source's store
    (URL, options, retry policy) and its files (sorted); :meth:`open` is the store of one of
    them."""

    store: Store
    files: tuple[InputFile, ...]
    # left out by the listing: (path relative to SRC, why), e.g. ("cat/Thumbs.db", "system file")
    ignored: tuple[tuple[str, str], ...] = ()

    @property
    def url(self) -> str:
        return self.store.url

    def without(self, left_out: Iterable[tuple[str, str]]) -> Inputs:
        """These inputs but ``left_out`` (``(path relative to SRC, why)``), which are reported
        with what the listing left out."""
        left_out = tuple(left_out)
        if not left_out:
            return self
        drop = {rel for rel, _ in left_out}
        kept = tuple(f for f in self.files if f.rel not in drop)
        return Inputs(self.store, kept, tuple(sorted((*self.ignored, *left_out))))

    def open(self, f: InputFile | LineRun) -> Store:
        """The store of listed file ``f``: its URL with the source's options and policy."""
        return Store(f.url, self.store.options, self.store.retry)


@dataclass(frozen=True)
class Description:
    """What a layout found in its inputs.

    ``fields`` are per member extension (what the writers and checks see); ``aliases`` are the
    layout's own ``{logical field: member extensions}`` (class folders and key groups: every
    image extension is ``image``), which ``--alias`` extends.  ``left_out``: files the layout
    recognised as no sample's (``(path relative to SRC, why)``, e.g. a ``labels.csv`` among
    images); discovery drops them from the inputs and reports them with the listing's own.
    ``notes``: what the layout decided for the user, printed on the pack summary.
    """

    fields: Mapping[str, FieldInfo]
    classes: tuple[str, ...] = ()
    aliases: Aliases = field(default_factory=dict)
    left_out: tuple[tuple[str, str], ...] = ()
    notes: tuple[str, ...] = ()


class Layout(ABC):
    """One input layout.  Subclass it in one module, then register an instance.

    ``name`` is what ``--layout`` and the manifest's ``layout`` say.  ``rank`` orders detection:
    among the layouts whose :meth:`detect` answers (fits or mixed), the highest rank wins (an
    answer may carry a rank of its own, :attr:`Verdict.rank`); a tie of two that fit is an
    ambiguity error naming both readings (pass ``--layout``).  Key groups, which fit anything,
    rank 0 (10 when the names show real grouping); the other built-in layouts rank 10.
    """

    name: ClassVar[str]
    rank: ClassVar[int] = 10

    @abstractmethod
    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Whether ``files`` (sorted, non-empty, sizes only: nothing is read) are this layout's."""

    @abstractmethod
    def describe(self, inputs: Inputs) -> Description:
        """Fields, classes and own aliases; a :class:`~shardloader.errors.UsageError` naming the
        file when one does not fit (also when ``--layout`` forced this layout)."""

    @abstractmethod
    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef | LineRun]:
        """The samples, fields sorted by name, in an order that is a pure function of the tree
        (file layouts: sorted by key; records: file after file, line or row after line or row).
        A :class:`~shardloader.pack.refs.LineRun` stands for a run of line samples that the
        pack worker reads by byte range (the built-in ``records`` layout's plain line files).

        A layout that reads files here (records) raises
        :class:`~shardloader.errors.InputError` naming the file, or, when ``on_skip`` is given,
        reports the rest of that file through it and goes on.
        """

    def text_rule(
        self, fields: Mapping[str, FieldInfo], text_field: str, tokenize: bool
    ) -> TextRule | None:
        """Which field holds a sample's text (its length goes into the sidecar); ``None``: none."""
        return text_rule(fields, text_field, tokenize)

    def __repr__(self) -> str:
        return f"<layout {self.name!r}>"


@dataclass(frozen=True)
class Source:
    """A discovered input: its layout, files, fields, classes, text rule and the sample stream."""

    inputs: Inputs
    impl: Layout
    fields: Mapping[str, FieldInfo]
    classes: tuple[str, ...] = ()
    text: TextRule | None = None
    # {logical field: member extensions}: the layout's own merged with --alias
    aliases: Aliases = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # what discovery decided for the user (the pack summary)
    # --labels: {sample key: label bytes}, filled into the field ``cls`` of each sample
    labels: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def layout(self) -> str:
        return self.impl.name

    @property
    def url(self) -> str:
        return self.inputs.url

    @property
    def files(self) -> tuple[InputFile, ...]:
        return self.inputs.files

    @property
    def ignored(self) -> tuple[tuple[str, str], ...]:
        """What the listing left out (hidden and system files, symlink loops), and why."""
        return self.inputs.ignored

    @property
    def field_map(self) -> FieldMap:
        return FieldMap.build(self.fields, self.aliases, "--alias")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def items(self, on_skip: OnSkip | None = None) -> Iterator[SampleRef | LineRun]:
        """The deterministic sample stream as the planner takes it (see
        :meth:`Layout.enumerate`): samples, and runs of lines by position."""
        items = self.impl.enumerate(self, on_skip)
        return _labelled(items, self.labels) if self.labels else items


def _labelled(
    items: Iterator[SampleRef | LineRun], labels: Mapping[str, bytes]
) -> Iterator[SampleRef | LineRun]:
    """Each sample with its ``--labels`` label as field ``cls`` (discovery checked that every
    sample has one)."""
    for item in items:
        if isinstance(item, SampleRef):
            fields = dict(item.fields)
            fields["cls"] = labels[item.key]
            item = item._replace(fields=tuple(sorted(fields.items())))
        yield item


def each_file(
    source: Source,
    on_skip: OnSkip | None,
    errors: tuple[type[BaseException], ...],
    items: Callable[[InputFile], Iterator[SampleRef | LineRun]],
) -> Iterator[SampleRef | LineRun]:
    """The ``items`` of every file of ``source`` in turn.  A file that fails mid-way (one of
    ``errors``) fails the pack naming it or, with ``on_skip``, has the rest of it skipped."""
    for f in source.files:
        last = ""
        try:
            for item in items(f):
                last = f"line {int(item.numbers[-1])}" if isinstance(item, LineRun) else item.where
                yield item
        except errors as err:
            after = f" after {last}" if last else ""
            reason = f"cannot read{after} ({err})"
            if on_skip is None:
                raise InputError(
                    f"{f.url}: {reason}; fix or remove the file, or pass --on-error skip"
                ) from err
            log.warning("%s: %s; skipping the rest of the file", f.url, reason)
            on_skip(f.rel, last, reason)


def extension(rel: str) -> str:
    """The lower-cased last extension of a path's basename ('' if none)."""
    base = rel.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base.lstrip(".") else ""


def text_rule(fields: Mapping[str, FieldInfo], text_field: str, tokenize: bool) -> TextRule | None:
    """The usual rule: ``text_field`` if it is text, else ``txt``, else the key ``text_field``
    of a ``json`` field; the length is counted in tokens when tokenized."""
    candidates: list[tuple[str, str]] = []
    if text_field in fields and fields[text_field].codec == "text":
        candidates.append(("field", text_field))
    if "txt" in fields and ("field", "txt") not in candidates:
        candidates.append(("field", "txt"))
    if "json" in fields and fields["json"].codec == "json":
        candidates.append(("json", text_field))
    if not candidates:
        return None
    if tokenize:
        name = "tokens"
    elif candidates[0][0] == "json":
        name = text_field
    else:
        name = candidates[0][1]
    return TextRule(tuple(candidates), name)
