"""``index``: adopt existing webdataset tar shards without rewriting them.

Each shard is streamed once: its stored bytes are hashed, and the uncompressed tar is walked to
record every sample's key, byte offset, size (from the first header of its first member to the
padding of its last) and checksum (XXH3-64), the same sidecar ``pack`` writes.  Sidecars and
``index.json`` go to OUT; the manifest points at the shards where they are (paths relative to
OUT, so the shards must lie inside OUT).

Shards are untrusted: members are streamed in bounded chunks and never held in memory, a
member larger than ``max_member_bytes`` (or trailing data after the end-of-archive marker
larger than that) is refused from its header, before it is decompressed, and so is a member
whose name would give a sample key that could escape a directory (``../x``, ``/abs``).

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

import numpy as np
import xxhash
import zstandard

from shardloader.codecs import codec_for_extension
from shardloader.errors import OutputExistsError, ShardError, StorageError, UsageError
from shardloader.format.tar import BLOCK, TarStream, _decompressed, split_key, walk_members
from shardloader.keys import unsafe_key_reason
from shardloader.manifest import MANIFEST_NAME, FieldInfo, Manifest, SampleIndex, ShardInfo
from shardloader.pack.discover import list_inputs, record_kind
from shardloader.pack.outdir import list_out, remove_temps
from shardloader.storage import is_local, join, local_path, open_read, remove, write_bytes_atomic

__all__ = [
    "DEFAULT_MAX_MEMBER",
    "HashingReader",
    "IndexReport",
    "index_shards",
    "tar_compression",
]

log = logging.getLogger(__name__)

_TAR_SUFFIXES = {
    ".tar": "none",
    ".tar.gz": "gzip",
    ".tgz": "gzip",
    ".tar.zst": "zstd",
    ".tar.zstd": "zstd",
}
_TEXT_FIELDS = ("txt", "text")
DEFAULT_MAX_MEMBER = 1 << 30  # one member (one field of one sample) of an indexed shard


@dataclass(frozen=True)
class IndexReport:
    out: str
    manifest: Manifest


def tar_compression(url: str) -> tuple[str, str] | None:
    """(compression, name without the suffix) of a tar shard URL, or None."""
    lower = url.lower()
    for suffix in sorted(_TAR_SUFFIXES, key=len, reverse=True):
        if lower.endswith(suffix):
            return _TAR_SUFFIXES[suffix], url[: -len(suffix)]
    return None


class HashingReader:
    """Reader that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO, hashing: bool) -> None:
        self._f = f
        self.sha = hashlib.sha256() if hashing else None
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self.sha is not None:
            self.sha.update(data)
        self.pos += len(data)
        return data

    def readable(self) -> bool:
        return True

    def drain(self) -> None:
        while self.read(4 << 20):
            pass


@dataclass
class _Scanned:
    index: SampleIndex
    fields: dict[str, int]  # extension → number of samples that have it
    stored: int
    raw: int
    sha256: str


class _HashStream(TarStream):
    """A tar stream that keeps the checksum of the sample being scanned, both ways.

    A sample's byte range starts where the previous regular member ended, but whether the
    bytes after that point (folders, pax headers, the next header) begin a new sample is known
    only once the next member's name is parsed.  So two hashes run over them: ``cont`` as if
    they continue the current sample, ``new`` as if they start the next one.
    """

    def __init__(self, f: BinaryIO, where: str) -> None:
        super().__init__(f, where)
        self.cont = xxhash.xxh3_64()
        self.new = xxhash.xxh3_64()

    def on_data(self, data: bytes) -> None:
        self.cont.update(data)
        self.new.update(data)


def _unsafe_member(url: str, name: str, key: str, reason: str) -> ShardError:
    return ShardError(
        f"{url}: member {name!r} gives sample key {key!r}, which {reason}: it could escape a "
        "directory when samples are written to disk, so shardloader refuses it; rewrite the "
        "shard with relative member names (no '..', no leading '/')"
    )


def _scan(url: str, compression: str, so: Mapping[str, Any], max_member: int | None) -> _Scanned:
    keys: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    sums: list[int] = []
    texts: list[int | None] = []
    seen: dict[str, int] = {}
    with open_read(url, so) as raw:
        stored = HashingReader(raw, hashing=True)
        tar = _HashStream(_decompressed(stored, compression), url)  # type: ignore[arg-type]
        key: str | None = None
        exts: set[str] = set()
        start = end = text = run = mark = 0
        has_text = False

        def finish() -> None:
            assert key is not None
            keys.append(key)
            offsets.append(start)
            sizes.append(end - start)
            sums.append(run)
            texts.append(text if has_text else None)

        try:
            for name, size in walk_members(tar, True, max_member):
                parts = split_key(name)
                if parts is not None:
                    k, ext = parts
                    if k != key:
                        if key is not None:
                            finish()
                        problem = unsafe_key_reason(k)
                        if problem is not None:
                            raise _unsafe_member(url, name, k, problem)
                        key, exts, start, has_text = k, set(), mark, False
                        # this sample's bytes so far: those since `mark`
                        tar.cont = cast(xxhash.xxh3_64, tar.new.copy())
                    if ext in exts:
                        raise ShardError(f"{url}: sample {k!r} has two {ext!r} members")
                    exts.add(ext)
                    seen[ext] = seen.get(ext, 0) + 1
                    if ext in _TEXT_FIELDS and not has_text:
                        text, has_text = size, True
                tar.skip(size + (-size % BLOCK), f"member {name!r}")  # streamed, never held
                if parts is not None:
                    run, end = tar.cont.intdigest(), tar.pos
                tar.new, mark = xxhash.xxh3_64(), tar.pos
            if key is not None:
                finish()
            trailing = 0
            while chunk := tar.read(1 << 20):  # GNU tar pads to 10 KiB records
                trailing += len(chunk)
                if max_member is not None and trailing > max_member:
                    raise ShardError(
                        f"{url}: more than {max_member:,} bytes after the end-of-archive "
                        "marker; the shard is corrupt or hostile (a decompression bomb?)"
                    )
        except (OSError, EOFError, ValueError, zstandard.ZstdError) as err:
            if isinstance(err, ShardError):
                raise
            raise ShardError(f"{url}: cannot read as a tar shard ({err})") from err
        stored.drain()
    lengths = None
    if texts and all(t is not None for t in texts):
        lengths = np.asarray(texts, np.int64)
    index = SampleIndex(
        keys, np.asarray(offsets, np.int64), np.asarray(sizes, np.int64), lengths,
        np.asarray(sums, np.uint64),
    )
    assert stored.sha is not None
    return _Scanned(index, seen, stored.pos, tar.pos, stored.sha.hexdigest())


def _expand(shards: Sequence[str], so: Mapping[str, Any]) -> list[str]:
    """Folders become the tar shards inside them (sorted); files stay in the given order."""
    out: list[str] = []
    for s in shards:
        if is_local(s) and os.path.isdir(local_path(s)):
            found = [f.url for f in list_inputs(s, so) if tar_compression(f.rel)]
            if not found:
                raise UsageError(f"{s}: no tar shards (.tar, .tar.gz, .tar.zst) in this folder")
            out.extend(found)
        else:
            out.append(s)
    return out


def _relative(url: str, out: str) -> str:
    """``url`` relative to OUT; a manifest's paths never leave its folder (see schema.py)."""
    if is_local(url) and is_local(out):
        rel = os.path.relpath(
            os.path.abspath(local_path(url)), os.path.abspath(local_path(out))
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


def index_shards(
    shards: Sequence[str],
    out: str,
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_member_bytes: int | None = DEFAULT_MAX_MEMBER,
) -> IndexReport:
    """Write sidecars and a manifest in ``out`` for existing tar shards (not rewritten).

    ``max_member_bytes``: the largest member (one field of one sample) accepted, checked from
    its header before it is decompressed; ``None`` or 0 for no limit (members are streamed
    either way, so memory stays flat, but readers will hold whole samples).
    """
    if max_member_bytes is not None and max_member_bytes < 0:
        raise UsageError(f"max_member_bytes {max_member_bytes} must be >= 0 (0: no limit)")
    max_member = max_member_bytes or None
    so = dict(storage_options or {})
    urls = _expand(shards, so)
    if not urls:
        raise UsageError("index needs at least one shard")
    compressions = set()
    for u in urls:
        if record_kind(u):
            raise UsageError(
                f"{u}: JSONL/Parquet/Arrow files cannot be indexed in place (manifest v1 knows "
                "tar and Arrow IPC shards only); convert them with `shardloader pack`"
            )
        found = tar_compression(u)
        if found is None:
            raise UsageError(f"{u}: not a tar shard (.tar, .tar.gz, .tgz, .tar.zst)")
        compressions.add(found[0])
    if len(compressions) > 1:
        raise UsageError(
            f"shards mix compressions {sorted(compressions)}; one manifest has one compression: "
            "index each kind into its own OUT"
        )
    compression = compressions.pop()
    existing = list_out(out, so)
    if MANIFEST_NAME in existing and not overwrite:
        raise OutputExistsError(
            f"{out} already has a {MANIFEST_NAME}; pass --overwrite to replace it"
        )
    if MANIFEST_NAME in existing:
        remove(join(out, MANIFEST_NAME), so)
    remove_temps(out, existing, so)

    infos = []
    fields: dict[str, int] = {}
    sidecar_names: dict[str, str] = {}
    all_text = True
    scans = []
    for i, url in enumerate(urls):
        rel = _relative(url, out)
        stem = tar_compression(rel)[1]  # type: ignore[index]
        index_path = f"{stem}.idx.arrow"
        if index_path in sidecar_names:
            raise UsageError(
                f"{url} and {sidecar_names[index_path]} would share the sidecar {index_path}; "
                "index them into separate OUT folders"
            )
        sidecar_names[index_path] = url
        try:
            scanned = _scan(url, compression, so, max_member)
        except StorageError as err:
            raise ShardError(f"{url}: cannot read ({err})") from err
        scans.append((rel, index_path, scanned))
        for ext, n in scanned.fields.items():
            fields[ext] = fields.get(ext, 0) + n
        all_text = all_text and scanned.index.lengths is not None
        if progress is not None:
            progress(i + 1, len(urls))
    for rel, index_path, scanned in scans:
        index = scanned.index if all_text else SampleIndex(
            scanned.index.keys, scanned.index.offsets, scanned.index.sizes,
            checksums=scanned.index.checksums,
        )
        data = index.to_arrow_bytes()
        write_bytes_atomic(join(out, index_path), data, so)
        infos.append(ShardInfo(
            rel, len(index), scanned.stored, scanned.raw, scanned.sha256, index_path,
            hashlib.sha256(data).hexdigest(),
        ))
    manifest = Manifest(
        format="tar",
        compression=compression,
        fields={ext: FieldInfo(codec_for_extension(ext)) for ext in sorted(fields)},
        shards=infos,
        layout="indexed",
        length_field=next((t for t in _TEXT_FIELDS if t in fields), None) if all_text else None,
        extra={"skipped": 0, "length_unit": "bytes"} if all_text else {"skipped": 0},
    )
    write_bytes_atomic(join(out, MANIFEST_NAME), manifest.to_json(), so)
    return IndexReport(out, manifest)
