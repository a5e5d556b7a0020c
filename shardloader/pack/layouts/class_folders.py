"""``class-folders``: ``SRC/<class>/<image>``, one sample per image with its class index.

Every file sits exactly one level down and is an image.  Key ``<class>/<stem>`` (dots in the stem
become ``_``), the image under the field ``image`` whatever its extension (the tar member keeps
its lower-cased extension; the manifest's ``aliases`` lists the extensions seen), plus ``cls`` =
the class index (ASCII digits) into the sorted class list.  No text is measured.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from shardloader.codecs import IMAGE_EXTENSIONS
from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import (
    FITS,
    NO_FIT,
    Description,
    Inputs,
    Layout,
    OnSkip,
    Source,
    Verdict,
    extension,
)
from shardloader.pack.refs import FileRef, InputFile, SampleRef, TextRule

__all__ = ["ClassFolders"]


def _is_class_image(rel: str) -> bool:
    return rel.count("/") == 1 and extension(rel) in IMAGE_EXTENSIONS


def _key(rel: str) -> tuple[str, str]:
    cls, base = rel.split("/", 1)
    stem, ext = base.rsplit(".", 1)
    return f"{cls}/{stem.replace('.', '_')}", ext.lower()


class ClassFolders(Layout):
    name = "class-folders"

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Images one level down, no two sharing a webdataset key (``a/1.jpg`` + ``a/1.png`` is
        one sample with two fields: key groups)."""
        from shardloader.format.tar import split_key

        if not all(_is_class_image(f.rel) for f in files):
            return NO_FIT
        keys = [parts[0] for f in files if (parts := split_key(f.rel)) is not None]
        return FITS if len(keys) == len(set(keys)) else NO_FIT

    def describe(self, inputs: Inputs) -> Description:
        for f in inputs.files:
            if not _is_class_image(f.rel):
                raise UsageError(
                    f"{inputs.url}: {f.rel!r} is not an image at SRC/<class>/<file>; class "
                    "folders hold only images one level down (use --layout key-groups for "
                    "other trees)"
                )
        classes = tuple(sorted({f.rel.split("/", 1)[0] for f in inputs.files}))
        fields = {"cls": FieldInfo("int")}
        for f in inputs.files:
            fields.setdefault(extension(f.rel), FieldInfo("image"))
        images = tuple(sorted(e for e, i in fields.items() if i.codec == "image"))
        return Description(fields, classes, {"image": images})

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef]:
        """Checked whole before the first sample: two files may not give one key."""
        class_index = {c: i for i, c in enumerate(source.classes)}
        groups: dict[str, tuple[str, FileRef, int]] = {}
        for f in source.files:
            key, ext = _key(f.rel)
            if key in groups:
                raise UsageError(
                    f"{source.url}: {groups[key][1].rel!r} and {f.rel!r} both become sample key "
                    f"{key!r}; rename one of them"
                )
            groups[key] = (ext, FileRef(f.url, f.rel, f.size), class_index[f.rel.split("/")[0]])
        out = []
        for key in sorted(groups):
            ext, ref, cls = groups[key]
            fields: dict[str, FileRef | bytes] = {ext: ref, "cls": str(cls).encode("ascii")}
            out.append(SampleRef(key, tuple(sorted(fields.items()))))
        return iter(out)

    def text_rule(
        self, fields: Mapping[str, FieldInfo], text_field: str, tokenize: bool
    ) -> TextRule | None:
        return None
