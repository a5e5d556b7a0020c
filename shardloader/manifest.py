"""The versioned manifest (``index.json``): what every later stage reads.

The manifest is written last, after every shard and its sample index are complete, so a
manifest never points at a partial shard.  It records, per shard, the stored and raw sizes, a
SHA-256 of the stored bytes, and the path of a small Arrow sidecar (``*.idx.arrow``) with each
sample's key, byte offset and size inside the *uncompressed* shard, so readers seek instead of
scanning.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from shardloader.errors import ManifestError, ShardError, located
from shardloader.schema import check_format, check_manifest_dict

if TYPE_CHECKING:
    from shardloader.storage.retry import RetryPolicy
    from shardloader.storage.store import Store

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_MANIFEST_BYTES",
    "FieldInfo",
    "int_column",
    "ShardInfo",
    "Manifest",
    "SampleIndex",
    "load_manifest",
    "read_manifest",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "index.json"
# The most bytes an index.json is read to: about 650,000 shards.  An endless response or a
# link to /dev/zero stops here, at a bounded cost, never held whole.
MAX_MANIFEST_BYTES = 256 << 20
CHECKSUM_COLUMN = "xxh3_64"  # per-sample checksum in sidecars (optional: older ones lack it)
# per-field checksums (Parquet adopted in place, for projected reads): one column a field
FIELD_CHECKSUM_PREFIX = "xxh3_64:"


@dataclass(frozen=True)
class FieldInfo:
    """A field (tar member extension / arrow column) and how to decode it."""

    codec: str
    dtype: str | None = None  # element type of ``tokens`` fields, e.g. "uint16"


@dataclass(frozen=True)
class ShardInfo:
    """One shard: where it is, how big, and how to check it."""

    path: str  # relative to the manifest's folder
    num_samples: int
    bytes: int  # stored (compressed) size
    raw_bytes: int  # uncompressed size: what a staged copy occupies
    sha256: str  # of the stored bytes
    index_path: str  # Arrow sidecar: key, offset, size (+ length) per sample
    index_sha256: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs, and nothing that changes between runs (no timestamps)."""

    format: str
    compression: str
    fields: Mapping[str, FieldInfo]
    shards: Sequence[ShardInfo]
    classes: Sequence[str] = ()
    layout: str = ""
    length_field: str | None = None  # field whose per-sample length the sidecars record
    extra: Mapping[str, Any] = field(default_factory=dict)
    # {logical field: member extensions}: tar members ``key.jpg``/``key.png`` both fill
    # ``image`` (see shardloader.read.fields); ``fields`` is keyed by the logical name
    aliases: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_format(self.format, self.compression)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def shard_sizes(self) -> np.ndarray:
        """Sample count of every shard, in manifest order (int64)."""
        return np.fromiter((s.num_samples for s in self.shards), np.int64, len(self.shards))

    @functools.cached_property
    def fingerprint(self) -> str:
        """Short hash of what decides sample identity and order; saved with loader states.

        Computed once (a 10,000-shard manifest takes tens of milliseconds) and pickled along
        into DataLoader workers."""
        ident: list[Any] = [self.format, self.compression]
        ident += [[s.path, s.num_samples, s.sha256] for s in self.shards]
        return hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "format": self.format,
            "compression": self.compression,
            "layout": self.layout,
            "num_samples": self.num_samples,
            "num_shards": len(self.shards),
            "bytes": sum(s.bytes for s in self.shards),
            "raw_bytes": sum(s.raw_bytes for s in self.shards),
            "checksum_algorithm": "sha256",
            "fields": {k: _drop_none(asdict(v)) for k, v in sorted(self.fields.items())},
            "classes": list(self.classes),
            "length_field": self.length_field,
            "extra": dict(self.extra),
            "shards": [asdict(s) for s in self.shards],
        }
        if self.aliases:  # only when used: manifests without aliases keep their exact bytes
            out["aliases"] = {k: sorted(v) for k, v in sorted(self.aliases.items())}
        return out

    def to_json(self) -> bytes:
        """Canonical bytes: same manifest, same bytes."""
        return (json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = "manifest") -> Manifest:
        """Parse and check a manifest; the first wrong value is a ManifestError naming
        ``where`` and the value's JSON path."""
        with located(where):
            try:
                raw = json.loads(data)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ManifestError(f"not valid JSON: {err}") from err
            except RecursionError as err:
                raise ManifestError("nested too deeply to be a manifest") from err
            if not isinstance(raw, dict):
                raise ManifestError("not a JSON object")
            version = raw.get("format_version")
            if version != FORMAT_VERSION:
                raise ManifestError(
                    f"format_version {version!r}; this shardloader reads version "
                    f"{FORMAT_VERSION}: upgrade shardloader or re-pack the data"
                )
            check_manifest_dict(raw)
        return cls(
            format=raw["format"],
            compression=raw["compression"],
            fields={k: FieldInfo(**v) for k, v in raw["fields"].items()},
            shards=tuple(ShardInfo(**s) for s in raw["shards"]),
            classes=tuple(raw.get("classes", ())),
            layout=raw.get("layout", ""),
            length_field=raw.get("length_field"),
            extra=raw.get("extra", {}),
            aliases={k: tuple(v) for k, v in raw.get("aliases", {}).items()},
        )


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


@dataclass(frozen=True)
class SampleIndex:
    """Per-shard sample table: key, byte offset and size in the uncompressed shard.

    For arrow shards ``offsets`` are row numbers and ``sizes`` the bytes of the row's fields.
    ``lengths`` (optional) is the length of the manifest's ``length_field`` per sample.
    ``checksums`` (optional; sidecars written before it existed lack it) is an XXH3-64 per
    sample (column ``xxh3_64``), checked as samples are read: of the sample's bytes
    ``[offset, offset + size)`` in a tar shard, of its key and fields in an Arrow shard
    (:func:`shardloader.format.arrow.format.row_checksum`).  ``field_checksums`` (optional,
    Parquet files adopted by ``index``) holds per field the XXH3-64 of the key and that field
    alone (column ``xxh3_64:<field>``), so a read of some columns is checked without the rest.
    """

    keys: Sequence[str]
    offsets: np.ndarray
    sizes: np.ndarray
    lengths: np.ndarray | None = None
    checksums: np.ndarray | None = None  # uint64
    field_checksums: Mapping[str, np.ndarray] | None = None  # field -> uint64 per sample

    def __len__(self) -> int:
        return len(self.offsets)

    def to_arrow_bytes(self, compression: str | None = None) -> bytes:
        """Arrow IPC file bytes; ``compression`` ("zstd"): compressed buffers, which every
        reader of sidecars already decompresses."""
        columns = {
            "key": pa.array(list(self.keys), pa.string()),
            "offset": pa.array(self.offsets, pa.uint64()),
            "size": pa.array(self.sizes, pa.uint64()),
        }
        if self.lengths is not None:
            columns["length"] = pa.array(self.lengths, pa.uint32())
        if self.checksums is not None:
            columns[CHECKSUM_COLUMN] = pa.array(self.checksums, pa.uint64())
        for name, sums in sorted((self.field_checksums or {}).items()):
            columns[FIELD_CHECKSUM_PREFIX + name] = pa.array(sums, pa.uint64())
        table = pa.table(columns)
        sink = pa.BufferOutputStream()
        options = pa.ipc.IpcWriteOptions(compression=compression)
        with pa.ipc.new_file(sink, table.schema, options=options) as writer:
            writer.write_table(table)
        return sink.getvalue().to_pybytes()

    @classmethod
    def from_arrow_bytes(
        cls, data: bytes, where: str = "sample index", limit: int | None = None
    ) -> SampleIndex:
        """Parse a sidecar; ``limit`` bounds what its (compressed) columns may expand to."""
        with located(where):
            try:
                if limit is not None:
                    from shardloader.format.arrow.ipc import declared_sizes

                    declared = declared_sizes(data).uncompressed_bytes
                    if declared > limit:
                        raise ManifestError(
                            f"declares {declared:,} bytes of columns, more than the {limit:,} "
                            "its shard's manifest entry allows; the sidecar is corrupt or hostile"
                        )
                # malloc, not pyarrow's default pool: that one keeps the decompressed columns'
                # pages after they are freed, about 20 MB per process over a few large sidecars
                pool = pa.system_memory_pool()
                table = pa.ipc.open_file(pa.py_buffer(data), memory_pool=pool).read_all()
                # pyarrow trusts the file's offsets: reading through corrupt ones crashes the
                # process, so every offset, length and string is checked once first
                table.validate(full=True)
                names = table.column_names
                key = table["key"]
                if not (pa.types.is_string(key.type) or pa.types.is_large_string(key.type)):
                    raise ManifestError(f"column 'key' is {key.type}, not a string")
                return cls(
                    keys=key.to_pylist(),
                    offsets=int_column(table["offset"], "offset"),
                    sizes=int_column(table["size"], "size"),
                    lengths=int_column(table["length"], "length") if "length" in names else None,
                    checksums=_u64(table[CHECKSUM_COLUMN]) if CHECKSUM_COLUMN in names else None,
                    field_checksums={
                        n[len(FIELD_CHECKSUM_PREFIX) :]: _u64(table[n], n)
                        for n in names
                        if n.startswith(FIELD_CHECKSUM_PREFIX)
                    }
                    or None,
                )
            except (
                pa.ArrowException,
                OSError,
                UnicodeDecodeError,
                KeyError,
                ManifestError,
                ShardError,
            ) as err:
                raise ManifestError(f"not a valid shardloader sample index: {err}") from err


def _u64(column: pa.ChunkedArray, name: str = CHECKSUM_COLUMN) -> np.ndarray:
    """A checksum column as uint64 (``int_column`` would turn half of all digests negative)."""
    if not pa.types.is_uint64(column.type):
        raise ManifestError(f"column {name!r} is {column.type}, not uint64")
    return int_column(column, name, np.uint64)


def int_column(column: pa.ChunkedArray, name: str, dtype: type = np.int64) -> np.ndarray:
    """An integer column of a sample index as ``dtype``, read from its buffer: a column of
    another type or with nulls is a ManifestError naming ``name``.

    ``to_numpy()`` would import pandas (about 1.5 s in every fresh worker) to check for it.
    Unsigned values past 2**63 come out negative as int64, which the sidecar checks refuse.
    """
    if not pa.types.is_integer(column.type):
        raise ManifestError(f"column {name!r} is {column.type}, not integers")
    array = column.combine_chunks()
    if array.null_count:
        raise ManifestError(f"column {name!r} has missing values")
    width = array.type.bit_width // 8
    kind = "i" if pa.types.is_signed_integer(array.type) else "u"
    data = np.frombuffer(
        array.buffers()[1],
        dtype=np.dtype(f"<{kind}{width}"),
        count=len(array),
        offset=array.offset * width,
    )
    return data.astype(dtype)  # a copy: the result outlives the Arrow buffer


def load_manifest(store: Store) -> tuple[Manifest, Store]:
    """Fetch and parse the manifest of the dataset at ``store`` (its folder or its
    ``index.json``); return it with the store of the folder its shards' paths start from."""
    from shardloader.errors import ChecksumError, ObjectNotFoundError, StorageError
    from shardloader.storage.protocols import NO_BUCKET, classify
    from shardloader.storage.store import Store, join

    url = store.url
    if url.endswith(".json"):  # the manifest itself: its folder is the base
        base, murl = (url.rsplit("/", 1)[0] if "/" in url else "."), url
    else:
        base, murl = url.rstrip("/") or "/", join(url, MANIFEST_NAME)
    try:
        data = Store(murl, store.options, store.retry).read_bytes(limit=MAX_MANIFEST_BYTES)
    except ChecksumError as err:  # past the bound: an endless body, a huge file
        raise ManifestError(
            f"{murl!r} is larger than {MAX_MANIFEST_BYTES >> 20} MiB, more than any manifest "
            "shardloader writes (about 400 bytes a shard); it is not a dataset's index.json"
        ) from err
    except ObjectNotFoundError as err:
        # Only a missing object is a missing manifest; a missing bucket, credentials or a
        # store that stayed unreachable are storage failures and keep their own message.
        if err.__cause__ is not None and classify(err.__cause__, store.protocol) == NO_BUCKET:
            raise
        raise ManifestError(_no_manifest(murl, Store(base, store.options, store.retry))) from err
    except StorageError as err:  # it names its own cause: no credentials, refused, a FIFO
        raise ManifestError(f"cannot read the manifest {murl!r}: {err}") from err
    return Manifest.from_json(data, murl), Store(base, store.options, store.retry)


def _no_manifest(murl: str, base: Store) -> str:
    """Why there is no manifest: never packed, or a pack that is running or was interrupted
    (its shards are there, the manifest comes last)."""
    import os

    from shardloader.errors import ShardloaderError

    try:
        found = base.list_files() if not base.is_local or os.path.isdir(base.local_path) else []
    except (OSError, ShardloaderError):
        found = []
    shards = [p for p in found if ".idx.arrow" in p or p.startswith(".shard-")]
    if shards:
        return (
            f"no manifest at {murl!r} yet: the folder holds shards (e.g. {shards[0]!r}) but no "
            f"{MANIFEST_NAME}, which a pack writes last: a pack is writing it now, or was "
            "interrupted (finish it with `shardloader pack SRC OUT --resume`)"
        )
    return (
        f"no manifest at {murl!r}: pack the data first with `shardloader pack SRC OUT`, or "
        "index existing shards with `shardloader index`"
    )


def read_manifest(
    url: str | Store,
    storage_options: Mapping[str, Any] | None = None,
    *,
    policy: RetryPolicy | None = None,
) -> tuple[Manifest, str]:
    """Fetch and parse a dataset's manifest once; return it with the base URL of its shards.

    ``url`` is a URL (with ``storage_options`` and ``policy``) or a
    :class:`~shardloader.storage.Store`, which carries both.
    """
    from shardloader.storage.store import as_store

    manifest, base = load_manifest(as_store(url, storage_options, policy))
    return manifest, base.url
