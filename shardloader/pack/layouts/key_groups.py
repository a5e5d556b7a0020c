"""``key-groups``: webdataset's rule, the layout that fits any tree.

Files sharing a key (the path up to the first dot of the basename) form one sample with one field
per extension (``a/0001.jpg`` + ``a/0001.seg.png`` → sample ``a/0001``, fields ``jpg`` and
``seg.png``); ``--alias image=jpg,png`` makes several extensions one field (see
:mod:`shardloader.aliases`).  A file without an extension cannot be a field: a usage error.
"""

from __future__ import annotations

from collections.abc import Iterator

from shardloader.codecs import codec_for_extension
from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import FITS, Description, Inputs, Layout, OnSkip, Source, Verdict
from shardloader.pack.refs import FileRef, InputFile, SampleRef

__all__ = ["KeyGroups"]


class KeyGroups(Layout):
    name = "key-groups"
    rank = 0  # the fallback: every more specific layout that fits wins

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Anything: files without an extension are refused by :meth:`describe`, naming one."""
        return FITS

    def describe(self, inputs: Inputs) -> Description:
        from shardloader.format.tar import split_key

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
        from shardloader.format.tar import split_key

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
