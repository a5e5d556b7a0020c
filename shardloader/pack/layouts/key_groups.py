"""``key-groups``: webdataset's rule, the layout that fits any tree.

Files sharing a key (the path up to the first dot of the basename) form one sample with one field
per extension (``a/0001.jpg`` + ``a/0001.seg.png`` → sample ``a/0001``, fields ``jpg`` and
``seg.png``); ``--alias image=jpg,png`` makes several extensions one field (see
:mod:`shardloader.read.fields`).  A file without an extension cannot be a field: a usage error.

Names as people have them: extensions are compared without case (``.JPG`` is ``jpg``: the tar
member is ``<key>.jpg``), and image extensions (``jpg``, ``jpeg``, ``png``, ...) fill one field
``image``, as in class folders, unless a sample holds two images (an image and its mask) or a
field is already called ``image``; the pack summary says so.  A sample that shares no field
with most samples, and looks like few others (a ``val_labels.csv`` among images), is junk:
left out and listed with the files the listing left out, never packed as a sample.  A tar
shard (img2dataset's tar output) is no field: the ``tars`` layout packs such shards, and
``shardloader index`` adopts them in place.

Detection: key groups fit any tree, but as the fallback (rank 0) unless the names show real
grouping (:func:`grouped`), when they answer at rank 10 beside the other built-in layouts: a
folder of class folders whose names merely hold dots (``cat.0.jpg``, ``lfw.000.jpg``) is not
a set of samples with a thousand fields.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterator, Sequence

from shardloader.codecs.allowlist import IMAGE_EXTENSIONS, codec_for_extension
from shardloader.errors import UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import FITS, Description, Inputs, Layout, OnSkip, Source, Verdict
from shardloader.pack.refs import InputFile, SampleRef

__all__ = ["KeyGroups", "grouped", "image_alias", "junk"]

_MAX_FIELDS = 16  # more distinct fields than this, and than samples: not a webdataset
_COMPRESSED = ("gz", "zst", "zstd")
_RARE = 20  # junk is rarer than one sample in 20 (or a single one)
_TAR_SHARDS = ("tar", "tgz", "tar.gz", "tar.zst", "tar.zstd")


def _family(ext: str) -> str:
    """What the junk rule compares: every image extension is one (``jpg`` and ``png`` samples
    share their image), other extensions are themselves."""
    return "image" if ext in IMAGE_EXTENSIONS else ext


def junk(samples: dict[str, set[str]]) -> tuple[set[str], tuple[str, ...]]:
    """(keys of junk samples, the common fields).

    Common: the fields more than half the samples have.  Junk: a sample with none of them whose
    kind (its set of fields) is rare, held by one sample or by under 5 % of them: a
    ``val_labels.csv`` among images, not the ``.flac`` half of a folder of ``.wav`` and
    ``.flac`` files.  Nothing is junk when no field is that common."""
    kinds = Counter(frozenset(map(_family, exts)) for exts in samples.values())
    counts: Counter[str] = Counter()  # samples holding each family
    for families, n in kinds.items():
        counts.update(dict.fromkeys(families, n))
    common = tuple(sorted(f for f, n in counts.items() if 2 * n > len(samples)))
    if not common:
        return set(), common
    rare = max(1, len(samples) // _RARE)
    bad = {
        k
        for k, exts in samples.items()
        if not (families := frozenset(_family(e) for e in exts)) & set(common)
        and kinds[families] <= rare
    }
    return bad, common


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
        fields.add(parts[1].lower())
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
        samples = _groups(inputs)
        for group in samples.values():
            for ext, f in group.items():
                if ext in _TAR_SHARDS:
                    raise UsageError(
                        f"{inputs.url}: {f.rel!r} is a tar shard, not a field of a sample: pack "
                        "webdataset (img2dataset) tars with --layout tars, or adopt them in "
                        f"place with `shardloader index {inputs.url} OUT`"
                    )
        bad, common = junk({k: set(v) for k, v in samples.items()})
        left_out = tuple(
            sorted(
                (f.rel, f"junk: shares no field with most samples ({', '.join(common)})")
                for k in bad
                for f in samples[k].values()
            )
        )
        kept = [exts for k, exts in samples.items() if k not in bad]
        names = sorted({ext for exts in kept for ext in exts})
        fields = {ext: FieldInfo(codec_for_extension(ext)) for ext in names}
        aliases, notes = image_alias(fields, kept)
        return Description(fields, (), aliases, left_out, notes)

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef]:
        """Checked whole before the first sample: one field may hold one file per sample."""
        member_of = source.field_map.member_of
        groups = _groups(source.inputs)
        for key, group in groups.items():
            filled: dict[str, InputFile] = {}
            for ext, f in group.items():
                name = member_of.get(ext)
                if name and name in filled:
                    raise UsageError(
                        f"{source.url}: {filled[name].rel!r} and {f.rel!r} both fill field "
                        f"{name!r} of sample {key!r} (--alias); a sample may hold only one of them"
                    )
                filled[name or ""] = f
        return iter([SampleRef(key, tuple(sorted(groups[key].items()))) for key in sorted(groups)])


def _groups(inputs: Inputs) -> dict[str, dict[str, InputFile]]:
    """``{key: {extension: file}}``: files sharing a key, in listing order; a file without an
    extension, or two that give one sample the same field, is a UsageError naming them."""
    from shardloader.format.tar.format import split_key

    groups: dict[str, dict[str, InputFile]] = {}
    for f in inputs.files:
        parts = split_key(f.rel)
        if parts is None or not parts[1]:
            raise UsageError(
                f"{inputs.url}: unknown layout: {f.rel!r} has no extension, so it cannot be a "
                "field of a sample (key groups need <key>.<ext> names); pass --layout or "
                "remove it"
            )
        key, ext = parts[0], parts[1].lower()
        group = groups.setdefault(key, {})
        if ext in group:
            raise UsageError(
                f"{inputs.url}: {group[ext].rel!r} and {f.rel!r} are both field {ext!r} of "
                f"sample {key!r} (extensions are compared without case); rename one of them"
            )
        group[ext] = f
    return groups


def image_alias(
    fields: dict[str, FieldInfo], samples: Sequence[Collection[str]]
) -> tuple[dict[str, tuple[str, ...]], tuple[str, ...]]:
    """``{"image": image extensions}`` and the note saying so, as class folders have it;
    nothing when a sample holds two images (``0001.jpg`` and its mask ``0001.png``) or a
    field is already called ``image``."""
    images = tuple(sorted(e for e in fields if e in IMAGE_EXTENSIONS))
    if not images or "image" in fields:
        return {}, ()
    two = next((s for s in samples if sum(e in IMAGE_EXTENSIONS for e in s) > 1), None)
    if two is not None:
        return {}, ()
    shown = ", ".join(f".{e}" for e in images)
    return {"image": images}, (
        f"image files ({shown}) fill the field 'image', as in class folders (--alias "
        f"{images[0]}={images[0]} keeps them apart)",
    )
