"""Find the raw inputs, decide their layout, and turn them into one deterministic sample stream.

Layouts (``--layout`` overrides the detection):

- ``class-folders``: every file sits exactly at ``SRC/<class>/<file>`` and is an image.  One
  sample per file, key ``<class>/<stem>`` (dots in the stem become ``_``), the image under the
  field ``image`` whatever its extension (the tar member keeps its lower-cased extension; the
  manifest's ``aliases`` lists the extensions seen), plus ``cls`` = the class index (ascii)
  into the sorted class list.
- ``records``: every file is a line file (``.jsonl``/``.txt``, optionally ``.gz``/``.zst``) or a
  table (``.parquet``, Arrow IPC ``.arrow``/``.feather``/``.ipc``).  One sample per non-empty line
  (key ``<path without suffixes>/<line number:09d>``, 1-based) or per row (``.../<row:09d>``,
  0-based).  Lines become field ``json`` or ``txt``; table columns become one field each.
- ``key-groups``: anything else.  Files sharing a key (the path up to the first dot of the
  basename, webdataset's rule) form one sample with one field per extension; ``--alias
  image=jpg,png`` makes several extensions one field (see :mod:`shardloader.aliases`).

Files are listed (sizes from ``stat``/``find``, never read) in sorted order and samples are
yielded sorted by key, so the stream is a pure function of the input tree.  Record files are read
here, in the main process: splitting lines is cheap next to compressing them.  Hidden files and
folders (names starting with ``.``) are ignored.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardloader.aliases import Aliases, FieldMap, merge, normalize
from shardloader.codecs import IMAGE_EXTENSIONS, codec_for_extension
from shardloader.errors import StorageError, UsageError
from shardloader.manifest import FieldInfo
from shardloader.pack.records import OnSkip, record_fields, record_kind, record_samples
from shardloader.pack.refs import FileRef, InputFile, SampleRef
from shardloader.storage import filesystem, is_local, join, local_path

__all__ = [
    "LAYOUTS",
    "FileRef",
    "SampleRef",
    "InputFile",
    "TextRule",
    "Source",
    "discover",
    "list_inputs",
    "record_kind",
]

log = logging.getLogger(__name__)

LAYOUTS = ("auto", "class-folders", "key-groups", "records")


@dataclass(frozen=True)
class TextRule:
    """Where a sample's text is, tried in order: ``("field", ext)`` or ``("json", key)``."""

    candidates: tuple[tuple[str, str], ...]
    length_field: str  # manifest ``length_field``: ``tokens`` when tokenized


@dataclass(frozen=True)
class Source:
    """A discovered input: its layout, files, fields, classes and the sample stream."""

    url: str
    layout: str
    files: tuple[InputFile, ...]
    fields: Mapping[str, FieldInfo]
    classes: tuple[str, ...] = ()
    text: TextRule | None = None
    storage_options: Mapping[str, Any] | None = None
    # {logical field: member extensions}; ``fields`` above are per member extension (what
    # the writers and checks see), ``field_map.fields`` what the manifest records
    aliases: Aliases = field(default_factory=dict)

    @property
    def field_map(self) -> FieldMap:
        return FieldMap.build(self.fields, self.aliases, "--alias")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def samples(self, on_skip: OnSkip | None = None) -> Iterator[SampleRef]:
        """The deterministic sample stream.

        Errors reading a record file raise :class:`InputError` naming the file, unless
        ``on_skip`` is given: then the rest of that file is skipped and reported through it.
        """
        if self.layout == "records":
            return record_samples(self.files, self.storage_options, on_skip)
        return iter(_file_samples(self))


# -- listing --------------------------------------------------------------------------------


def _hidden(rel: str) -> bool:
    return any(part.startswith(".") for part in rel.split("/"))


def list_inputs(src: str, storage_options: Mapping[str, Any] | None = None) -> list[InputFile]:
    """Every non-hidden file below ``src`` (or ``src`` itself if it is a file), sorted.

    A file that cannot be stat'ed (a symlink loop, a dangling link) is listed with size 0, so
    the error surfaces where the file is read, under the pack's ``--on-error`` policy.
    """
    if is_local(src):
        root = os.path.abspath(local_path(src))
        if os.path.isfile(root) or (os.path.exists(root) and not os.path.isdir(root)):
            return [InputFile(os.path.basename(root), root, os.stat(root).st_size)]
        if not os.path.isdir(root):
            raise UsageError(f"source {src!r} does not exist")
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
    fs, path = filesystem(src, storage_options)
    path = path.rstrip("/")
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


def _extension(rel: str) -> str:
    base = rel.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[-1].lower() if "." in base.lstrip(".") else ""


def _detect(src: str, files: list[InputFile]) -> str:
    """Records if every file is a record file, class folders if every file is an image one
    level down (and no two share a key), key groups otherwise.  A ``.txt``/``.jsonl`` that
    shares its key with another file (a caption next to its image) belongs to a key group,
    not to the records."""
    from shardloader.format.tar import split_key

    per_key: dict[str, int] = {}
    for f in files:
        parts = split_key(f.rel)
        if parts is not None:
            per_key[parts[0]] = per_key.get(parts[0], 0) + 1

    def is_record(f: InputFile) -> bool:
        parts = split_key(f.rel)
        return bool(record_kind(f.rel)) and (parts is None or per_key[parts[0]] == 1)

    records = [f for f in files if is_record(f)]
    if records and len(records) != len(files):
        other = next(f for f in files if not is_record(f))
        raise UsageError(
            f"{src}: mixed layouts: record files (e.g. {records[0].rel!r}) next to other files "
            f"(e.g. {other.rel!r}); pack them separately or pass --layout"
        )
    if records:
        return "records"
    if all(f.rel.count("/") == 1 and _extension(f.rel) in IMAGE_EXTENSIONS for f in files) and (
        max(per_key.values(), default=1) == 1  # a/1.jpg + a/1.png: one sample, two fields
    ):
        return "class-folders"
    return "key-groups"


def discover(
    src: str,
    layout: str = "auto",
    storage_options: Mapping[str, Any] | None = None,
    *,
    text_field: str = "text",
    tokenize: bool = False,
    aliases: Aliases | None = None,
) -> Source:
    """List ``src``, decide its layout, and work out fields, classes, aliases and the text rule.

    ``aliases`` (``--alias``) merge over the layout's own (class folders: ``image``)."""
    if layout not in LAYOUTS:
        raise UsageError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    files = list_inputs(src, storage_options)
    if not files:
        raise UsageError(f"{src}: no input files (empty source); nothing to pack")
    if layout == "auto":
        layout = _detect(src, files)
        log.info("%s: detected layout %s (%d files)", src, layout, len(files))
    classes: tuple[str, ...] = ()
    if layout == "class-folders":
        fields, classes = _class_folders(src, files)
    elif layout == "records":
        fields = record_fields(src, files, storage_options)
    else:
        fields = _key_groups(src, files)
    text = _text_rule(layout, fields, text_field, tokenize)
    if tokenize and text is None:
        raise UsageError(
            f"--tokenizer needs text: {src} ({layout}) has no field {text_field!r}, 'txt' or "
            "'json'; pass --text-field"
        )
    groups = _aliases(src, layout, fields, normalize(aliases, "--alias"))
    source = Source(src, layout, tuple(files), fields, classes, text, storage_options, groups)
    source.field_map  # noqa: B018 - checks the aliases now, before anything is read
    return source


def _aliases(
    src: str, layout: str, fields: Mapping[str, FieldInfo], given: Aliases
) -> dict[str, tuple[str, ...]]:
    """The layout's aliases (class folders: every image extension seen is ``image``) with the
    given ones over them, keeping only extensions the source has."""
    own = {}
    if layout == "class-folders":
        own = {"image": tuple(sorted(e for e, i in fields.items() if i.codec == "image"))}
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


def _class_folders(
    src: str, files: list[InputFile]
) -> tuple[dict[str, FieldInfo], tuple[str, ...]]:
    for f in files:
        if f.rel.count("/") != 1 or _extension(f.rel) not in IMAGE_EXTENSIONS:
            raise UsageError(
                f"{src}: {f.rel!r} is not an image at SRC/<class>/<file>; class folders hold "
                "only images one level down (use --layout key-groups for other trees)"
            )
    classes = tuple(sorted({f.rel.split("/", 1)[0] for f in files}))
    fields = {"cls": FieldInfo("int")}
    for f in files:
        fields.setdefault(_extension(f.rel), FieldInfo("image"))
    return fields, classes


def _class_key(rel: str) -> tuple[str, str]:
    cls, base = rel.split("/", 1)
    stem, ext = base.rsplit(".", 1)
    return f"{cls}/{stem.replace('.', '_')}", ext.lower()


def _key_groups(src: str, files: list[InputFile]) -> dict[str, FieldInfo]:
    from shardloader.format.tar import split_key

    fields: dict[str, FieldInfo] = {}
    for f in files:
        parts = split_key(f.rel)
        if parts is None or not parts[1]:
            raise UsageError(
                f"{src}: unknown layout: {f.rel!r} has no extension, so it cannot be a field of "
                "a sample (key groups need <key>.<ext> names); pass --layout or remove it"
            )
        fields.setdefault(parts[1], FieldInfo(codec_for_extension(parts[1])))
    return fields


def _file_samples(source: Source) -> list[SampleRef]:
    """Group files into samples; sorted by key, fields sorted by extension."""
    groups: dict[str, dict[str, FileRef]] = {}
    origin: dict[tuple[str, str], str] = {}
    if source.layout == "class-folders":
        class_index = {c: i for i, c in enumerate(source.classes)}
        for f in source.files:
            key, ext = _class_key(f.rel)
            if key in groups:
                other = next(iter(groups[key].values())).rel
                raise UsageError(
                    f"{source.url}: {other!r} and {f.rel!r} both become sample key {key!r}; "
                    "rename one of them"
                )
            groups[key] = {ext: FileRef(f.url, f.rel, f.size)}
            origin[(key, "cls")] = str(class_index[f.rel.split("/", 1)[0]])
    else:
        from shardloader.format.tar import split_key

        member_of = source.field_map.member_of
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
    out = []
    for key in sorted(groups):
        fields: dict[str, FileRef | bytes] = dict(groups[key])
        if (key, "cls") in origin:
            fields["cls"] = origin[(key, "cls")].encode("ascii")
        out.append(SampleRef(key, tuple(sorted(fields.items()))))
    return out


# -- text and lengths -----------------------------------------------------------------------


def _text_rule(
    layout: str, fields: Mapping[str, FieldInfo], text_field: str, tokenize: bool
) -> TextRule | None:
    """Which field holds a sample's text; its length (bytes or tokens) goes into the sidecar."""
    candidates: list[tuple[str, str]] = []
    if text_field in fields and fields[text_field].codec == "text":
        candidates.append(("field", text_field))
    if "txt" in fields and ("field", "txt") not in candidates:
        candidates.append(("field", "txt"))
    if "json" in fields and fields["json"].codec == "json":
        candidates.append(("json", text_field))
    if not candidates or layout == "class-folders":
        return None
    if tokenize:
        name = "tokens"
    elif candidates[0][0] == "json":
        name = text_field
    else:
        name = candidates[0][1]
    return TextRule(tuple(candidates), name)
