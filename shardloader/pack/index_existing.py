"""``index``: adopt existing shards (webdataset tars) without rewriting them.

Each shard is streamed once: its stored bytes are hashed here, and its format (one with
``indexable``: tar, see format/tar/index.py) records every sample's key, byte offset, size and
checksum (XXH3-64), the same sidecar ``pack`` writes.  Sidecars and ``index.json`` go to OUT;
the manifest points at the shards where they are (paths relative to OUT, so the shards must lie
inside OUT).

Shards are untrusted: members are streamed in bounded chunks and never held in memory, a
member larger than ``max_member_bytes`` is refused from its header, before it is decompressed,
and so is a member whose name would give a sample key that could escape a directory (``../x``,
``/abs``).

JSONL and Parquet files are not shards of a format that manifest v1 knows (``tar``/``arrow``),
so they cannot be indexed in place; ``shardloader pack`` converts them.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

from shardloader.codecs.allowlist import codec_for_extension
from shardloader.errors import OutputExistsError, ShardError, StorageError, UsageError
from shardloader.format.base import Format
from shardloader.format.registry import get_format, known_formats
from shardloader.manifest import MANIFEST_NAME, FieldInfo, Manifest, SampleIndex, ShardInfo
from shardloader.pack.discover import list_inputs, record_kind
from shardloader.pack.lock import holding_out_lock
from shardloader.pack.outdir import list_out, remove_temps
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store, as_store
from shardloader.storage.streams import HashingReader

__all__ = [
    "DEFAULT_MAX_MEMBER",
    "IndexReport",
    "index_shards",
    "shard_kind",
    "tar_compression",
]

log = logging.getLogger(__name__)

_TEXT_FIELDS = ("txt", "text")
DEFAULT_MAX_MEMBER = 1 << 30  # one member (one field of one sample) of an indexed shard


@dataclass(frozen=True)
class IndexReport:
    out: str
    manifest: Manifest


def _indexable() -> list[Format]:
    return [f for f in map(get_format, known_formats()) if f.indexable]


def shard_kind(url: str) -> tuple[Format, str, str] | None:
    """(format, compression, name without the suffix) of a shard ``index`` can adopt, or None."""
    for fmt in _indexable():
        found = fmt.parse_name(url)
        if found is not None:
            return fmt, found[0], found[1]
    return None


def tar_compression(url: str) -> tuple[str, str] | None:
    """(compression, name without the suffix) of a tar shard URL, or None."""
    return get_format("tar").parse_name(url)


def _kinds() -> str:
    """``tar shard (.tar, .tgz, ...)``: the shards index can adopt, for messages."""
    names, found = [], []
    for fmt in _indexable():
        names.append(fmt.name)
        found += [*fmt.suffixes.values(), *fmt.index_suffixes]
    suffixes = ", ".join(sorted(set(found), key=lambda s: (len(s), s)))
    return f"{' or '.join(names)} shard ({suffixes})"


@dataclass
class _Scanned:
    index: SampleIndex
    fields: dict[str, int]  # extension → number of samples that have it
    stored: int
    raw: int
    sha256: str


def _scan(shard: Store, fmt: Format, compression: str, max_member: int | None) -> _Scanned:
    with shard.open_read() as raw:
        stored = HashingReader(raw)
        found = fmt.scan(cast(BinaryIO, stored), compression, shard.url, max_member, _TEXT_FIELDS)
        stored.drain()
    return _Scanned(found.index, found.fields, stored.pos, found.raw_bytes, stored.hexdigest())


def _expand(shards: Sequence[str], store: Store) -> list[str]:
    """Folders become the shards inside them (sorted); files stay in the given order."""
    out: list[str] = []
    for s in shards:
        if Store(s).is_local and os.path.isdir(Store(s).local_path):
            found = [
                f.url
                for f in list_inputs(Store(s, store.options, store.retry))
                if shard_kind(f.rel)
            ]
            if not found:
                raise UsageError(f"{s}: no {_kinds()} in this folder")
            out.extend(found)
        elif Store(s).is_local and not os.path.exists(Store(s).local_path):
            what = "matches no file" if any(c in s for c in "*?[") else "does not exist"
            raise UsageError(f"{s}: {what}; give existing {_kinds()} files, or folders of them")
        else:
            out.append(s)
    return out


def _relative(url: str, out: str) -> str:
    """``url`` relative to OUT; a manifest's paths never leave its folder (see schema.py)."""
    if Store(url).is_local and Store(out).is_local:
        rel = os.path.relpath(
            os.path.abspath(Store(url).local_path), os.path.abspath(Store(out).local_path)
        ).replace(os.sep, "/")
        if rel != ".." and not rel.startswith("../"):
            return rel
    else:
        o = out.rstrip("/") + "/"
        if url.startswith(o):
            return url[len(o) :]
    raise UsageError(
        f"{url} is not below {out}: a manifest only points at shards inside its own folder; "
        "index into the shards' folder or one above it (OUT may be the shards' folder itself)"
    )


@holding_out_lock("index")  # NOTE [the OUT lock] in pack/lock.py
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
    if max_member_bytes is not None and max_member_bytes < 0:
        raise UsageError(f"max_member_bytes {max_member_bytes} must be >= 0 (0: no limit)")
    max_member = max_member_bytes or None
    store = as_store(out, storage_options, retry)
    out = store.url
    urls = _expand(shards, store)
    if not urls:
        raise UsageError("index needs at least one shard")
    compressions = set()
    formats: dict[str, Format] = {}
    for u in urls:
        if record_kind(u):
            raise UsageError(
                f"{u}: JSONL/Parquet/Arrow files cannot be indexed in place (manifest v1 knows "
                "tar and Arrow IPC shards only); convert them with `shardloader pack`"
            )
        found = shard_kind(u)
        if found is None:
            raise UsageError(f"{u}: not a {_kinds()}")
        formats[found[0].name] = found[0]
        compressions.add(found[1])
    if len(formats) > 1:
        raise UsageError(
            f"shards mix formats {sorted(formats)}; one manifest has one format: index each "
            "kind into its own OUT"
        )
    [fmt] = formats.values()
    if len(compressions) > 1:
        raise UsageError(
            f"shards mix compressions {sorted(compressions)}; one manifest has one compression: "
            "index each kind into its own OUT"
        )
    compression = compressions.pop()
    existing = list_out(store)
    if MANIFEST_NAME in existing and not overwrite:
        raise OutputExistsError(
            f"{out} already has an {MANIFEST_NAME}; pass --overwrite to replace it"
        )
    remove_temps(store, existing)

    infos = []
    fields: dict[str, int] = {}
    sidecar_names: dict[str, str] = {}
    all_text = True
    scans = []
    if progress is not None:  # the total at once, before the first (maybe large) shard
        progress(0, len(urls))
    for i, url in enumerate(urls):
        rel = _relative(url, out)
        stem = fmt.parse_name(rel)[1]  # type: ignore[index]
        index_path = f"{stem}.idx.arrow"
        if index_path in sidecar_names:
            raise UsageError(
                f"{url} and {sidecar_names[index_path]} would share the sidecar {index_path}; "
                "index them into separate OUT folders"
            )
        sidecar_names[index_path] = url
        try:
            scanned = _scan(Store(url, store.options, store.retry), fmt, compression, max_member)
        except StorageError as err:
            raise ShardError(f"{url}: cannot read ({err})") from err
        scans.append((rel, index_path, scanned))
        for ext, n in scanned.fields.items():
            fields[ext] = fields.get(ext, 0) + n
        all_text = all_text and scanned.index.lengths is not None
        if progress is not None:
            progress(i + 1, len(urls))
    # NOTE [replacing a dataset] (pack/replace.py): every shard is scanned, so the new index
    # is whole; the old manifest goes only now, before the sidecars it may name are rewritten.
    if MANIFEST_NAME in existing:
        store.join(MANIFEST_NAME).remove()
    for rel, index_path, scanned in scans:
        index = (
            scanned.index
            if all_text
            else SampleIndex(
                scanned.index.keys,
                scanned.index.offsets,
                scanned.index.sizes,
                checksums=scanned.index.checksums,
            )
        )
        data = index.to_arrow_bytes()
        store.join(index_path).write_bytes_atomic(data)
        infos.append(
            ShardInfo(
                rel,
                len(index),
                scanned.stored,
                scanned.raw,
                scanned.sha256,
                index_path,
                hashlib.sha256(data).hexdigest(),
            )
        )
    manifest = Manifest(
        format=fmt.name,
        compression=compression,
        fields={ext: FieldInfo(codec_for_extension(ext)) for ext in sorted(fields)},
        shards=infos,
        layout="indexed",
        length_field=next((t for t in _TEXT_FIELDS if t in fields), None) if all_text else None,
        extra={
            "skipped": 0,
            **({"length_unit": "bytes"} if all_text else {}),
            "field_samples": dict(sorted(fields.items())),  # samples holding each extension
        },
    )
    store.join(MANIFEST_NAME).write_bytes_atomic(manifest.to_json())
    return IndexReport(out, manifest)
