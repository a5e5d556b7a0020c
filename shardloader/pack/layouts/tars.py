"""``tars``: a folder of webdataset tar shards (img2dataset's tar output) packed again.

Each tar (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.zst``) is read front to back in sorted file
order; consecutive members that share a key (webdataset's rule: the path up to the first dot of
the basename) are one sample with one field per extension, compared without case as in key
groups, image extensions filling the field ``image``.  Keys are kept as the tars have them (a
key two tars share is an error naming both); a member name that is not UTF-8 is keyed by its
percent-escape (:func:`shardloader.format.keys.escape_name`).  Only regular members count.
img2dataset's side files (``00000.parquet``, ``00000_stats.json``) are left out by the listing.

To adopt such tars in place, without rewriting them, ``shardloader index`` is the command; this
layout is for re-sharding, re-compressing or converting them to Arrow.
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Iterator

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.errors import InputError, StorageError, UsageError
from shardloader.format.keys import escape_name
from shardloader.manifest import FieldInfo
from shardloader.pack.layouts.base import (
    NO_FIT,
    Description,
    Inputs,
    Layout,
    OnSkip,
    Source,
    Verdict,
    each_file,
    mixed,
)
from shardloader.pack.layouts.key_groups import image_alias
from shardloader.pack.refs import InputFile, LineRun, SampleRef

__all__ = ["Tars", "is_tar_shard"]

log = logging.getLogger(__name__)

_SUFFIXES = (".tar", ".tgz", ".tar.gz", ".tar.zst", ".tar.zstd")
_MAX_MEMBER = 1 << 30  # one field of one sample is read into memory: refuse larger members


def is_tar_shard(rel: str) -> bool:
    return rel.lower().endswith(_SUFFIXES)


def _members(inputs: Inputs, f: InputFile) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular member, in tar order; names as text (see escape_name)."""
    import zstandard

    with inputs.open(f).open_read() as raw:
        src = raw
        if f.rel.lower().endswith((".zst", ".zstd")):
            src = zstandard.ZstdDecompressor().stream_reader(raw)
        with tarfile.open(fileobj=src, mode="r|*", errors="surrogateescape") as tar:
            for member in tar:
                if not member.isfile():
                    continue
                if member.size > _MAX_MEMBER:
                    raise InputError(
                        f"{f.url}: member {escape_name(member.name)!r} holds {member.size:,} "
                        f"bytes, more than the {_MAX_MEMBER:,} a field may; split it"
                    )
                data = tar.extractfile(member)
                yield escape_name(member.name), data.read() if data is not None else b""


def _samples(inputs: Inputs, f: InputFile) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of each sample of one tar: consecutive members of one key."""
    from shardloader.format.tar.format import split_key

    key: str | None = None
    fields: dict[str, bytes] = {}
    for name, data in _members(inputs, f):
        parts = split_key(name[2:] if name.startswith("./") else name)
        if parts is None:
            log.info("%s: member %r has no extension; not a field, left out", f.url, name)
            continue
        k, ext = parts[0], parts[1].lower()
        if k != key:
            if key is not None:
                yield key, fields
            key, fields = k, {}
        if ext in fields:
            raise InputError(f"{f.url}: sample {k!r} has two {ext!r} members; rename one")
        fields[ext] = data
    if key is not None:
        yield key, fields


_READ_ERRORS = (OSError, EOFError, tarfile.TarError, StorageError)


class Tars(Layout):
    name = "tars"

    def detect(self, files: tuple[InputFile, ...]) -> Verdict:
        """Tar shards only; tars beside other files are mixed (pack them apart)."""
        tars = [f for f in files if is_tar_shard(f.rel)]
        if not tars:
            return NO_FIT
        if len(tars) == len(files):
            return Verdict(True, reading=f"the samples of {len(tars):,} webdataset tar shards")
        other = next(f for f in files if not is_tar_shard(f.rel))
        return mixed("webdataset tar shards", tars[0].rel, other.rel)

    def describe(self, inputs: Inputs) -> Description:
        """Reads every tar once to learn its fields (a tar has no table of contents)."""
        fields: dict[str, FieldInfo] = {}
        samples: list[tuple[str, ...]] = []
        for f in inputs.files:
            if not is_tar_shard(f.rel):
                raise UsageError(
                    f"{inputs.url}: {f.rel!r} is not a tar shard (.tar, .tar.gz, .tar.zst); "
                    "pack it apart"
                )
            try:
                for _, found in _samples(inputs, f):
                    for ext in found:
                        fields.setdefault(ext, FieldInfo(codec_for_extension(ext)))
                    samples.append(tuple(found))  # its fields, not their bytes
            except _READ_ERRORS as err:  # enumerate refuses or skips it, naming it
                log.warning("%s: cannot read (%s)", f.url, err)
        aliases, notes = image_alias(fields, samples)
        return Description(dict(sorted(fields.items())), (), aliases, (), notes)

    def enumerate(self, source: Source, on_skip: OnSkip | None) -> Iterator[SampleRef | LineRun]:
        """Tar after tar, sample after sample; a tar that fails mid-way fails the pack or, with
        ``on_skip``, has the rest of it skipped."""
        seen: dict[str, str] = {}

        def items(f: InputFile) -> Iterator[SampleRef | LineRun]:
            for key, fields in _samples(source.inputs, f):
                if key in seen:
                    raise UsageError(
                        f"{source.url}: sample {key!r} is in both {seen[key]!r} and "
                        f"{f.rel!r}; keys must be unique across the tars"
                    )
                seen[key] = f.rel
                yield SampleRef(key, tuple(sorted(fields.items())), f.rel, f"sample {key!r}")

        return each_file(source, on_skip, _READ_ERRORS, items)
