"""``class-folders``: ``SRC/<class>/.../<image>``, one sample per image with its class index.

Every file is an image (by its last extension, whatever dots come before it: ``cat.0.jpg``,
``lfw.000.jpg``) at least one level down; the class is its top folder, and subfolders below it
belong to that class (as torchvision's ``ImageFolder`` reads them).  Key ``<folders>/<stem>``
(dots in the stem become ``_``, since webdataset's key ends at the basename's first dot; two
images of one folder with the same stem, ``001.jpg`` and ``001.png``, get their extension
appended: ``001_jpg``, ``001_png``), the image under the field ``image`` whatever its extension
(the tar member keeps its lower-cased extension; the manifest's ``aliases`` lists the
extensions seen), plus ``cls`` = the class index (ASCII digits) into the sorted class list.  No
text is measured.
"""

from __future__ import annotations

from collections.abc import Iterator

from shardloader.codecs.allowlist import IMAGE_EXTENSIONS
from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import (
    NO_FIT,
    Description,
    Inputs,
    Layout,
    OnSkip,
    Source,
    Verdict,
    extension,
    mixed,
)
from shardloader.pack.refs import InputFile, SampleRef

__all__ = ["ClassFolders", "class_keys"]


def _is_class_image(rel: str) -> bool:
    return "/" in rel and extension(rel) in IMAGE_EXTENSIONS


def _split(rel: str) -> tuple[str, str, str]:
    """(folders, stem with dots as ``_``, lower-cased extension) of a class image."""
    folders, base = rel.rsplit("/", 1)
    stem, ext = base.rsplit(".", 1)
    return folders, stem.replace(".", "_"), ext.lower()


def class_keys(files: tuple[InputFile, ...]) -> dict[str, tuple[str, InputFile]]:
    """``{key: (member extension, file)}`` of class images; a :class:`UsageError` naming both
    files when two would still share a key (``a.b.jpg`` and ``a_b.jpg``)."""
    by_stem: dict[str, list[tuple[str, InputFile]]] = {}
    for f in files:
        folders, stem, ext = _split(f.rel)
        by_stem.setdefault(f"{folders}/{stem}", []).append((ext, f))
    out: dict[str, tuple[str, InputFile]] = {}
    for stem_key, group in by_stem.items():
        for ext, f in group:
            key = stem_key if len(group) == 1 else f"{stem_key}_{ext}"
            if key in out:
                raise UsageError(
                    f"{out[key][1].rel!r} and {f.rel!r} both become sample key {key!r}; rename "
                    "one of them"
                )
            out[key] = (ext, f)
    return out


class ClassFolders(Layout):
    name = "class-folders"

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Images below class folders.  Mostly such images, with other files that are not an
        image's companion (``cat/001.json`` next to ``cat/001.jpg`` is key groups' evidence,
        ``notes.txt`` is not): mixed, an error rather than a silent fallback."""
        from shardloader.format.tar.format import split_key

        images = [f for f in files if _is_class_image(f.rel)]
        if len(images) == len(files):
            classes = {f.rel.split("/", 1)[0] for f in files}
            return Verdict(
                True,
                reading=f"{len(files):,} samples, one per image, in {len(classes):,} "
                f"class{'es' if len(classes) != 1 else ''}",
            )
        if 2 * len(images) <= len(files):
            return NO_FIT
        keys = {parts[0] for f in images if (parts := split_key(f.rel)) is not None}
        strays = [
            f
            for f in files
            if not _is_class_image(f.rel) and (split_key(f.rel) or ("",))[0] not in keys
        ]
        if not strays:
            return NO_FIT
        return mixed("images in class folders", images[0].rel, strays[0].rel)

    def describe(self, inputs: Inputs) -> Description:
        for f in inputs.files:
            if not _is_class_image(f.rel):
                raise UsageError(
                    f"{inputs.url}: {f.rel!r} is not an image at SRC/<class>/<image>; class "
                    "folders hold only images (.jpg, .png, .webp, .tiff, ...) below a class "
                    "folder (use --layout key-groups for other trees)"
                )
        classes = tuple(sorted({f.rel.split("/", 1)[0] for f in inputs.files}))
        images = tuple(sorted({extension(f.rel) for f in inputs.files}))
        fields = {"cls": FieldInfo("int"), **{ext: FieldInfo("image") for ext in images}}
        return Description(fields, classes, {"image": images})

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef]:
        """Checked whole before the first sample: two files may not give one key."""
        class_index = {c: i for i, c in enumerate(source.classes)}
        try:
            keys = class_keys(source.files)
        except UsageError as err:
            raise UsageError(f"{source.url}: {err}") from None
        out = []
        for key in sorted(keys):
            ext, f = keys[key]
            cls = class_index[f.rel.split("/", 1)[0]]
            fields: dict[str, InputFile | bytes] = {
                ext: f,
                "cls": str(cls).encode("ascii"),
            }
            out.append(SampleRef(key, tuple(sorted(fields.items()))))
        return iter(out)
