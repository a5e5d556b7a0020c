"""Every sample's length (a document's token count), from the sidecars' ``length`` columns alone.

What length-aware planners (:class:`~shardloader.batching.blocks.TokenBlocks`, bucketing, token
budgets, packing) plan from.  Each sidecar is read within its bound and must hash to the
manifest's ``index_sha256`` before its one column is decoded; keys, offsets and checksums, which
only per-sample reads use, are not (parsing and checking 200,000 keys took longer than the whole
first batch).

Lengths are untrusted like the rest of a sidecar: each must fit its sample (a token count
times the token width, or a text length in bytes, is never more than the sample's ``size``
column), and a shard's lengths together its ``raw_bytes``, before any planner sees them.  So a
lying ``length`` column is a :class:`~shardloader.errors.ManifestError` naming the sample,
never rows or segments sized by it: what planning allocates stays bounded by the data the
manifest declares.

NOTE [shared lengths]: the lengths are written once per node into the node cache
(``<cache>/<fingerprint>/lengths-<source>.npy.raw``: temp file, then rename) and
memory-mapped, so every process of the node (ranks, DataLoader workers) reads the same
page-cache pages: a :class:`SharedLengths` pickles as its path (and what rebuilds it), never as
N integers, and a worker started by spawn or forkserver maps the file again instead of
receiving a copy.  The file is a pure function of what it is built from, and named by it:
``<source>`` hashes the manifest's length field and every shard's sidecar path, digest and
sample count (the fingerprint alone covers the shards' bytes, which two datasets can share with
different sidecars), and each sidecar's digest is checked as it is read, so processes that
build it at once write the same bytes and the last rename wins.  It is a cache entry like a
staged shard (8 bytes a sample count against the limit; eviction and ``shardloader cache
clear`` remove it): a mapping stays valid after its file goes, and a process that finds it
gone builds it again.  Where the cache cannot be written, the
lengths stay an in-memory array.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from shardloader.errors import ManifestError, ShardError, StorageError, UsageError, located
from shardloader.format.arrow.ipc import declared_sizes
from shardloader.manifest import int_column
from shardloader.read.sidecar import check_digest, read_sidecar
from shardloader.schema import sidecar_bound

if TYPE_CHECKING:
    from shardloader.manifest import Manifest, ShardInfo
    from shardloader.read.shardset import ReadOptions

__all__ = ["SharedLengths", "load_lengths"]

log = logging.getLogger(__name__)


class SharedLengths(np.ndarray):
    """An int64 array mapped from the node cache's lengths file (NOTE [shared lengths]):
    read like any array; pickles as its path, so workers map it rather than copy it."""

    path: str
    reopen: functools.partial[np.ndarray | None]  # the load_lengths call that maps it again

    def __reduce__(self) -> Any:
        reopen = getattr(self, "reopen", None)  # a slice or arithmetic result has none: a copy
        if reopen is None:
            return np.array(self, np.int64).__reduce__()
        return (reopen, ())


def _open_shared(
    path: str, count: int, reopen: functools.partial[np.ndarray | None]
) -> SharedLengths:
    try:
        mapped = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise StorageError(f"no sample lengths at {path} ({err})") from err
    if mapped.dtype != np.int64 or mapped.shape != (count,):
        raise StorageError(f"the sample lengths at {path} do not hold {count} int64 values")
    out: SharedLengths = mapped.view(SharedLengths)
    out.path, out.reopen = path, reopen
    return out


def load_lengths(
    manifest: Manifest,
    base: str,
    read: ReadOptions,
    *,
    required: bool = True,
    hint: str = "pack with a text/token field (manifest length_field) to record them",
) -> np.ndarray | None:
    """Every sample's recorded length (int64, by global id): the node cache's mapped copy,
    built from the sidecars' ``length`` columns on first use (NOTE [shared lengths]).
    ``None`` if a shard records none and not ``required`` (else a UsageError naming it)."""
    path = None
    reopen = functools.partial(load_lengths, manifest, base, read, required=required, hint=hint)
    try:
        from shardloader.storage.cache import ShardCache

        path = ShardCache(read.cache, manifest.fingerprint).path_for(_cache_name(manifest))
        return _open_shared(path, manifest.num_samples, reopen)
    except StorageError:
        pass  # not built yet (or no writable cache): read the sidecars
    lengths = _read_lengths(manifest, base, read, required, hint)
    if lengths is None or path is None:
        return lengths
    temp = f"{path}.tmp-{uuid.uuid4().hex}"  # a temp name the cache's eviction recognises
    try:
        np.save(temp, lengths, allow_pickle=False)
        os.replace(temp + ".npy", path)
        return _open_shared(path, manifest.num_samples, reopen)
    except (OSError, StorageError) as err:
        log.info("sample lengths stay in memory: cannot write %s (%s)", path, err)
        with contextlib.suppress(OSError):
            os.unlink(temp + ".npy")
        return lengths


def _cache_name(manifest: Manifest) -> str:
    """The lengths file's name in the dataset's cache folder: what the lengths are built from
    (NOTE [shared lengths]), hashed."""
    source: list[Any] = [manifest.length_field]
    source += [[s.index_path, s.index_sha256, s.num_samples] for s in manifest.shards]
    digest = hashlib.sha256(json.dumps(source).encode()).hexdigest()[:16]
    return f"lengths-{digest}.npy"


def _unit(manifest: Manifest) -> int:
    """Bytes a sample holds per unit of its length: the token width of a ``tokens`` length
    field (``uint32`` unless it says), else 1 (text lengths are bytes)."""
    info = manifest.fields.get(manifest.length_field or "")
    if info is None or info.codec != "tokens":
        return 1
    return int(np.dtype(info.dtype or "uint32").itemsize)


def _read_lengths(
    manifest: Manifest, base: str, read: ReadOptions, required: bool, hint: str
) -> np.ndarray | None:
    """The sidecars' length columns, into one preallocated array (no list of N integers)."""
    store = read.store(base)
    unit = _unit(manifest)
    out = np.empty(manifest.num_samples, np.int64)
    at = 0
    for info in manifest.shards:
        if not info.num_samples:  # nothing to record (its writer may have left the column out)
            continue
        sidecar = store.join(info.index_path)
        with located(f"sample index {sidecar.url}"):
            data = read_sidecar(sidecar, info)
            check_digest(data, info)
            column = _lengths_column(data, info.num_samples, sidecar_bound(info))
            if column is not None:
                _check_fit(data, column, unit, info, manifest.length_field)
        if column is None:
            if not required:
                return None
            raise UsageError(
                f"the planner needs per-sample lengths but {info.index_path} has none; {hint}"
            )
        out[at : at + len(column)] = column
        at += len(column)
    # Arrow's allocator keeps what decompressing the columns took (~6 MB); workers would
    # inherit it: hand it back before they fork
    pa.default_memory_pool().release_unused()
    return out


def _lengths_column(data: bytes, count: int, bound: int) -> np.ndarray | None:
    try:
        if declared_sizes(data).uncompressed_bytes > bound:
            raise ManifestError("it declares more bytes than its shard's entry allows")
    except ShardError as err:
        raise ManifestError(f"not a valid shardloader sample index: {err}") from err
    column = _column(data, "length")
    if column is None:
        return None
    if len(column) != count:
        raise ManifestError(
            f"its length column ({len(column)} values) does not give the {count} token counts "
            "of its shard"
        )
    lengths = int_column(column, "length")  # integers without nulls, or a ManifestError
    if lengths.size and lengths.min() < 0:
        raise ManifestError("the sample index has negative lengths")
    return lengths


def _check_fit(
    data: bytes, lengths: np.ndarray, unit: int, info: ShardInfo, field: str | None
) -> None:
    """ManifestError unless every length fits its sample's ``size`` and all of them the
    shard's ``raw_bytes`` (the module docstring): read from the sidecar's size column, and
    its key column only to name a sample that does not fit."""
    need = lengths * unit
    total = int(need.sum())
    column = _column(data, "size")
    if column is None or len(column) != len(lengths):
        raise ManifestError("the sample index has no size for every sample")
    sizes = int_column(column, "size")
    over = np.flatnonzero((need > sizes) | (sizes < 0))
    if not over.size and total <= info.raw_bytes:
        return
    what = f"{field!r} " if field else ""
    if over.size:
        i = int(over[0])
        keys = _column(data, "key")
        key = keys[i].as_py() if keys is not None and i < len(keys) else f"#{i}"
        per = f" {unit}-byte tokens" if unit > 1 else " bytes"
        problem = (
            f"sample {key!r} records a {what}length of {int(lengths[i]):,}{per}, more than "
            f"its {int(sizes[i]):,}-byte sample holds"
        )
    else:
        problem = (
            f"its {what}lengths add up to {total:,} bytes, more than the shard's "
            f"{info.raw_bytes:,} raw_bytes"
        )
    raise ManifestError(
        f"{problem}; the sidecar's length column does not match its shard, so no "
        "batch is planned from it: re-pack or re-index the dataset"
    )


def _column(data: bytes, name: str) -> pa.ChunkedArray | None:
    """One column of a sidecar (hashed and bounded already), or None where it has none."""
    try:
        buffer = pa.py_buffer(data)
        pool = pa.system_memory_pool()  # freed to the system: no allocator arena stays behind
        at = pa.ipc.open_file(buffer, memory_pool=pool).schema.get_field_index(name)
        if at < 0:
            return None
        options = pa.ipc.IpcReadOptions(included_fields=[at], use_threads=False)
        table = pa.ipc.open_file(buffer, options=options, memory_pool=pool).read_all()
        table.validate(full=True)  # corrupt offsets would crash pyarrow's reads, not raise
        return table.column(0)
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        raise ManifestError(f"not a valid shardloader sample index: {err}") from err
