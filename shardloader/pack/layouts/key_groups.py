"""``key-groups``: webdataset's rule, the layout that fits any tree.

Files sharing a key (the path up to the first dot of the basename) form one sample with one field
per extension (``a/0001.jpg`` + ``a/0001.seg.png`` → sample ``a/0001``, fields ``jpg`` and
``seg.png``); ``--alias image=jpg,png`` makes several extensions one field (see
:mod:`shardloader.read.fields`).  A file without an extension cannot be a field: a usage error.

Detection: key groups fit any tree, but as the fallback (rank 0) unless the names show real
grouping (:func:`grouped`), when they answer at rank 10 beside the other built-in layouts: a
folder of class folders whose names merely hold dots (``cat.0.jpg``, ``lfw.000.jpg``) is not
a set of samples with a thousand fields.
"""

from __future__ import annotations

from collections.abc import Iterator

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import FITS, Description, Inputs, Layout, OnSkip, Source, Verdict
from shardloader.pack.refs import FileRef, InputFile, SampleRef

__all__ = ["KeyGroups", "grouped"]

_MAX_FIELDS = 16  # more distinct fields than this, and than samples: not a webdataset
_COMPRESSED = ("gz", "zst", "zstd")


def _kind(ext: str) -> str:
    """What a field holds, by its last extension before any compression's: ``jsonl.gz`` →
    ``jsonl``."""
    parts = ext.lower().split(".")
    if len(parts) > 1 and parts[-1] in _COMPRESSED:
        parts.pop()
    return parts[-1]


def grouped(files: tuple[InputFile, ...]) -> tuple[int, tuple[str, ...]] | None:
    """(samples, fields) when the names show real grouping, else None.

    Real grouping: most keys (more than half) hold files of several kinds, by their last
    extension, ``.gz``/``.zst`` aside (``0001.jpg`` + ``0001.json``; not ``cat.0.jpg`` +
    ``cat.1.jpg``, images numbered under one prefix, nor ``train.00.jsonl`` +
    ``train.01.jsonl.gz``, shards of one corpus), and
    there are few fields (at most 16, or at most one per sample).
    """
    from shardloader.format.tar.format import split_key

    kinds: dict[str, set[str]] = {}
    fields: set[str] = set()
    for f in files:
        parts = split_key(f.rel)
        if parts is None or not parts[1]:
            return None
        kinds.setdefault(parts[0], set()).add(_kind(parts[1]))
        fields.add(parts[1])
    several = sum(1 for k in kinds.values() if len(k) > 1)
    if 2 * several <= len(kinds) or len(fields) > max(_MAX_FIELDS, len(kinds)):
        return None
    return len(kinds), tuple(sorted(fields))


class KeyGroups(Layout):
    name = "key-groups"
    rank = 0  # the fallback: every more specific layout that fits wins

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Anything (files without an extension are refused by :meth:`describe`, naming one);
        at rank 10 when the names show real grouping (:func:`grouped`)."""
        found = grouped(files)
        if found is None:
            return FITS
        samples, fields = found
        shown = ", ".join(fields[:6]) + (", ..." if len(fields) > 6 else "")
        plural = "s" if samples != 1 else ""
        return Verdict(True, rank=10, reading=f"{samples:,} sample{plural} with fields {shown}")

    def describe(self, inputs: Inputs) -> Description:
        from shardloader.format.tar.format import split_key

        fields: dict[str, FieldInfo] = {}
        for f in inputs.files:
            parts = split_key(f.rel)
            if parts is None or not parts[1]:
                raise UsageError(
                    f"{inputs.url}: unknown layout: {f.rel!r} has no extension, so it cannot be a "
                    "field of a sample (key groups need <key>.<ext> names); pass --layout or "
                    "remove it"
                )
            fields.setdefault(parts[1], FieldInfo(codec_for_extension(parts[1])))
        return Description(fields)

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef]:
        """Checked whole before the first sample: one field may hold one file per sample."""
        from shardloader.format.tar.format import split_key

        member_of = source.field_map.member_of
        groups: dict[str, dict[str, FileRef]] = {}
        for f in source.files:
            parts = split_key(f.rel)
            if parts is None:
                raise UsageError(f"{source.url}: {f.rel!r} has no extension")
            key, ext = parts
            group = groups.setdefault(key, {})
            name = member_of.get(ext)
            same = next((r for e, r in group.items() if name and member_of.get(e) == name), None)
            if same is not None:
                raise UsageError(
                    f"{source.url}: {same.rel!r} and {f.rel!r} both fill field {name!r} of "
                    f"sample {key!r} (--alias); a sample may hold only one of them"
                )
            group[ext] = FileRef(f.url, f.rel, f.size)
        return iter([SampleRef(key, tuple(sorted(groups[key].items()))) for key in sorted(groups)])
