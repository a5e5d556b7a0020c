"""``index``: adopt existing shards (webdataset tars, Parquet files) without rewriting them.

Each shard is streamed once: its stored bytes are hashed here, and its format (one with
``indexable``: tar, see format/tar/index.py; parquet, format/parquet/scan.py) records every
sample's key, offset, size and checksum (XXH3-64), the same sidecar ``pack`` writes.  Sidecars
and ``index.json`` go to OUT; the manifest points at the shards where they are (paths relative
to OUT, so the shards must lie inside OUT).

Parquet files become one shard each, a row a sample, a column a field stored as ``pack``
stores it (Hugging Face ``Image`` structs as images, ``ClassLabel`` names as ``classes``), the
row groups' byte ranges and row counts in the manifest's ``extra["parquet"]``.  Files named
as the Hub names a split's files (``data/train-00000-of-00042.parquet``) index per split when
there are several: one manifest ``index.<split>.json`` each, beside the shared sidecars.

Shards are untrusted: members are streamed in bounded chunks and never held in memory, a
member larger than ``max_member_bytes`` is refused from its header, before it is decompressed,
and so is a member whose name would give a sample key that could escape a directory (``../x``,
``/abs``).  JSONL and Arrow IPC files are not shards ``index`` can adopt; ``shardloader pack``
converts them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, cast

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.errors import OutputExistsError, ShardError, StorageError, UsageError
from shardloader.format.base import Format, ScannedShard
from shardloader.format.parquet.scan import ParquetScan
from shardloader.format.registry import get_format, known_formats
from shardloader.manifest import MANIFEST_NAME, FieldInfo, Manifest, ShardInfo
from shardloader.pack.layouts.records import record_kind
from shardloader.pack.listing import below, scan_inputs
from shardloader.pack.lock import out_lock
from shardloader.pack.outdir import list_out, remove_temps
from shardloader.schema import sidecar_bound
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store, as_store
from shardloader.storage.streams import HashingReader

__all__ = [
    "DEFAULT_MAX_MEMBER",
    "IndexReport",
    "index_shards",
    "shard_kind",
]

log = logging.getLogger(__name__)

_TEXT_FIELDS = ("txt", "text")
DEFAULT_MAX_MEMBER = 1 << 30  # one member (one field of one sample) of an indexed shard


_SPLIT_FILE = re.compile(r"^(?P<split>[A-Za-z0-9_][A-Za-z0-9_.]*)-\d{5,}-of-\d{5,}\.parquet$")


@dataclass(frozen=True)
class IndexReport:
    """``manifest``: the one written (the first split's when there are several); ``splits``:
    split name → its manifest, when files of several Hub splits were indexed."""

    out: str
    manifest: Manifest
    splits: Mapping[str, Manifest] = field(default_factory=dict)


def _indexable() -> list[Format]:
    return [f for f in map(get_format, known_formats()) if f.indexable]


def shard_kind(url: str) -> tuple[Format, str, str] | None:
    """(format, compression, name without the suffix) of a shard ``index`` can adopt, or None."""
    for fmt in _indexable():
        found = fmt.parse_name(url)
        if found is not None:
            return fmt, found[0], found[1]
    return None


def _kinds() -> str:
    """``tar shard or parquet file (.tar, .tgz, ...)``: what index can adopt, for messages."""
    names, found = [], []
    for fmt in _indexable():
        names.append(f"{fmt.name} {'shard' if getattr(fmt, 'packable', True) else 'file'}")
        found += [*fmt.suffixes.values(), *fmt.index_suffixes]
    suffixes = ", ".join(sorted(set(found), key=lambda s: (len(s), s)))
    return f"{' or '.join(names)} ({suffixes})"


_Scanned = tuple[ShardInfo, ScannedShard]  # the shard's entry (but its sidecar's sha256)


def _scan(
    shard: Store, rel: str, index_path: str, fmt: Format, compression: str, max_member: int | None
) -> _Scanned:
    """Stream the stored shard once: its samples indexed by its format, its bytes hashed."""
    with shard.open_read() as raw:
        stored = HashingReader(raw)
        found = fmt.scan(cast(BinaryIO, stored), compression, shard.url, max_member, _TEXT_FIELDS)
        stored.drain()
    entry = ShardInfo(
        rel, len(found.index), stored.pos, found.raw_bytes, stored.hexdigest(), index_path, ""
    )
    return entry, found


def _expand(shards: Sequence[str], store: Store) -> list[str]:
    """Folders become the shards inside them (sorted); files stay in the given order."""
    out: list[str] = []
    for s in shards:
        if Store(s).is_local and os.path.isdir(Store(s).local_path):
            listed = scan_inputs(Store(s, store.options, store.retry)).files
            found = [f.url for f in listed if shard_kind(f.rel)]
            if not found:
                raise UsageError(f"{s}: no {_kinds()} in this folder")
            out.extend(found)
        elif Store(s).is_local and not os.path.exists(Store(s).local_path):
            what = "matches no file" if any(c in s for c in "*?[") else "does not exist"
            raise UsageError(f"{s}: {what}; give existing {_kinds()} files, or folders of them")
        else:
            out.append(s)
    return out


def _relative(url: str, out: Store) -> str:
    """``url`` relative to OUT; a manifest's paths never leave its folder (see schema.py)."""
    rel = below(Store(url), out)
    if rel:
        return rel
    raise UsageError(
        f"{url} is not below {out.url}: a manifest only points at shards inside its own "
        "folder; index into the shards' folder or one above it (OUT may be the shards' folder "
        "itself)"
    )


def index_shards(
    shards: Sequence[str],
    out: str | Store,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_member_bytes: int | None = DEFAULT_MAX_MEMBER,
    retry: RetryPolicy | None = None,
) -> IndexReport:
    """Write sidecars and a manifest in ``out`` for existing shards (not rewritten).

    ``max_member_bytes``: the largest member (one field of one sample) accepted, checked from
    its header before it is decompressed; ``None`` or 0 for no limit (members are streamed
    either way, so memory stays flat, but readers will hold whole samples).  ``out``: a URL
    (with ``storage_options`` and ``retry``, the policy of every remote call, also for reading
    the shards) or a Store carrying them.
    """
    store = as_store(out, storage_options, retry)
    with out_lock(store, "index"):  # NOTE [the OUT lock] in pack/lock.py
        return _index(shards, store, overwrite, progress, max_member_bytes)


def _index(
    shards: Sequence[str],
    store: Store,
    overwrite: bool,
    progress: Callable[[int, int], None] | None,
    max_member_bytes: int | None,
) -> IndexReport:
    if max_member_bytes is not None and max_member_bytes < 0:
        raise UsageError(f"max_member_bytes {max_member_bytes} must be >= 0 (0: no limit)")
    max_member = max_member_bytes or None
    out = store.url
    urls = _expand(shards, store)
    if not urls:
        raise UsageError("index needs at least one shard")
    kinds: dict[tuple[str, str], Format] = {}  # (format, compression) of each shard
    for u in urls:
        found = shard_kind(u)
        if found is None and record_kind(u):
            raise UsageError(
                f"{u}: JSONL and Arrow IPC files cannot be indexed in place (index adopts "
                f"{_kinds()} files); convert them with `shardloader pack`"
            )
        if found is None:
            raise UsageError(f"{u}: not a {_kinds()}")
        kinds[found[0].name, found[1]] = found[0]
    for i, what in enumerate(("format", "compression")):
        seen = sorted({kind[i] for kind in kinds})
        if len(seen) > 1:
            raise UsageError(
                f"shards mix {what}s {seen}; one manifest has one {what}: index each kind into "
                "its own OUT"
            )
    [((_, compression), fmt)] = kinds.items()
    splits = _splits(urls)
    # a split's manifest: index.train.json (its shards' paths stay relative to OUT)
    names = [f"index.{k}.json" for k in splits] or [MANIFEST_NAME]
    existing = list_out(store)
    taken = [n for n in names if n in existing]
    if taken and not overwrite:
        raise OutputExistsError(
            f"{out} already has an {', '.join(taken)}; pass --overwrite to replace it"
        )
    remove_temps(store, existing)

    sidecar_names: dict[str, str] = {}
    scans: list[_Scanned] = []
    tell = progress or (lambda done, total: None)
    tell(0, len(urls))  # the total at once, before the first (maybe large) shard
    for i, url in enumerate(urls):
        rel = _relative(url, store)
        stem = fmt.parse_name(rel)[1]  # type: ignore[index]
        index_path = f"{stem}.idx.arrow"
        if index_path in sidecar_names:
            raise UsageError(
                f"{url} and {sidecar_names[index_path]} would share the sidecar {index_path}; "
                "index them into separate OUT folders"
            )
        sidecar_names[index_path] = url
        shard = Store(url, store.options, store.retry)
        try:
            scans.append(_scan(shard, rel, index_path, fmt, compression, max_member))
        except StorageError as err:
            raise ShardError(f"{url}: cannot read ({err})") from err
        tell(i + 1, len(urls))
    groups = {k: [scans[i] for i in v] for k, v in splits.items()} or {"": scans}
    described = {  # may refuse
        split: _describe(part, fmt.name, compression, split) for split, part in groups.items()
    }
    # NOTE [replacing a dataset] (pack/replace.py): every shard is scanned, so the new index
    # is whole; the old manifests go only now, before the sidecars they may name are rewritten.
    for name in taken:
        store.join(name).remove()
    manifests = {split: _write(store, groups[split], m) for split, m in described.items()}
    for manifest, name in zip(manifests.values(), names, strict=True):
        store.join(name).write_bytes_atomic(manifest.to_json())
    first = next(iter(manifests.values()))
    return IndexReport(out, first, manifests if splits else {})


def _splits(urls: Sequence[str]) -> dict[str, list[int]]:
    """Split → positions of its files, when the files name several Hub splits; else {}."""
    found: dict[str, list[int]] = {}
    for i, u in enumerate(urls):
        split = _SPLIT_FILE.match(u.rstrip("/").rsplit("/", 1)[-1])  # train-00000-of-00002
        if split is None:
            return {}
        found.setdefault(split.group("split"), []).append(i)
    return found if len(found) > 1 else {}


def _describe(scans: Sequence[_Scanned], fmt: str, compression: str, split: str) -> Manifest:
    """The manifest of ``scans`` but their shard entries: their fields together, codecs,
    classes; files whose fields or classes disagree: UsageError."""
    fields: dict[str, int] = {}  # field → samples that have it
    infos: dict[str, FieldInfo] = {}  # codecs the format read from the files (Parquet)
    classes: tuple[str, ...] = ()
    row_groups: dict[str, list[list[int]]] = {}  # Parquet: file → [first byte, bytes, rows]
    for entry, found in scans:
        for ext, n in found.fields.items():
            fields[ext] = fields.get(ext, 0) + n
        if isinstance(found, ParquetScan):
            for name, info in found.infos.items():
                if infos.setdefault(name, info) != info:
                    raise UsageError(
                        f"{entry.path}: column {name!r} reads as {info.codec} but as "
                        f"{infos[name].codec} in the files before it; one manifest has one "
                        "codec a field: index files of one schema together"
                    )
            if classes and found.classes and found.classes != classes:
                raise UsageError(
                    f"{entry.path}: its ClassLabel names {list(found.classes)[:5]} differ from "
                    f"those of the files before it {list(classes)[:5]}; make them agree"
                )
            classes = classes or found.classes
            row_groups[entry.path] = found.row_groups
    all_text = all(found.index.lengths is not None for _, found in scans)
    extra: dict[str, Any] = {"skipped": 0, "field_samples": dict(sorted(fields.items()))}
    if all_text:
        extra["length_unit"] = "bytes"
    if split:
        extra["split"] = split
    if row_groups:  # per file: [first byte, bytes, rows] of each row group
        extra["parquet"] = {"row_groups": row_groups}
    return Manifest(
        format=fmt,
        compression=compression,
        fields=(
            dict(sorted(infos.items()))
            if infos
            else {ext: FieldInfo(codec_for_extension(ext)) for ext in sorted(fields)}
        ),
        shards=[],
        classes=classes,
        layout="indexed",
        length_field=next((t for t in _TEXT_FIELDS if t in fields), None) if all_text else None,
        extra=extra,
    )


def _write(store: Store, scans: Sequence[_Scanned], manifest: Manifest) -> Manifest:
    """Write the sidecars of ``scans``; ``manifest`` with their entries (written by the
    caller)."""
    shards = []
    for entry, found in scans:
        index = found.index
        if manifest.length_field is None:
            index = replace(index, lengths=None)
        data = index.to_arrow_bytes()
        if index.field_checksums and len(data) > sidecar_bound(entry):
            # per-column checksums (8 bytes a cell) would outgrow the bound readers hold the
            # sidecar to (many small, well-compressed columns): this file is read whole rows
            data = replace(index, field_checksums=None).to_arrow_bytes()
        store.join(entry.index_path).write_bytes_atomic(data)
        shards.append(replace(entry, index_sha256=hashlib.sha256(data).hexdigest()))
    return replace(manifest, shards=shards)
