"""Every sample's length (a document's token count), from the sidecars' ``length`` columns alone.

What length-aware planners (:class:`~shardloader.batching.blocks.TokenBlocks`, bucketing, token
budgets, packing) plan from.  Each sidecar is read within its bound and must hash to the
manifest's ``index_sha256`` before its one column is decoded; keys, offsets and checksums, which
only per-sample reads use, are not (parsing and checking 200,000 keys took longer than the whole
first batch).

NOTE [shared lengths]: the lengths are written once per node into the node cache
(``<cache>/<fingerprint>/lengths.npy.raw``: temp file, then rename) and memory-mapped, so every
process of the node (ranks, DataLoader workers) reads the same page-cache pages: a
:class:`SharedLengths` pickles as its path (and what rebuilds it), never as N integers, and a
worker started by spawn or forkserver maps the file again instead of receiving a copy.  The
file is a pure function of the manifest (its fingerprint names the folder, each sidecar's digest
is checked as it is read), so processes that build it at once write the same bytes and the last
rename wins.  It is a cache entry like a staged shard (8 bytes a sample count against the
limit; eviction and ``shardloader cache clear`` remove it): a mapping stays valid after its file
goes, and a process that finds it gone builds it again.  Where the cache cannot be written, the
lengths stay an in-memory array.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from shardloader.errors import ManifestError, ShardError, StorageError, UsageError
from shardloader.format.ipc import declared_sizes
from shardloader.schema import sidecar_bound
from shardloader.sidecar import check_digest, read_sidecar

if TYPE_CHECKING:
    from shardloader.manifest import Manifest
    from shardloader.shards import ReadOptions

__all__ = ["SharedLengths", "load_lengths", "load_token_lengths"]

log = logging.getLogger(__name__)
_NAME = "lengths.npy"


class SharedLengths(np.ndarray):
    """An int64 array mapped from the node cache's lengths file (NOTE [shared lengths]):
    read like any array; pickles as its path, so workers map it rather than copy it."""

    path: str
    source: tuple[Any, ...]  # (manifest, base, read, required, hint): to build it again

    def __reduce__(self) -> Any:
        source = getattr(self, "source", None)  # a slice or arithmetic result has none: a copy
        if source is None:
            return np.array(self, np.int64).__reduce__()
        return (_reopen, source)


def _reopen(
    manifest: Manifest, base: str, read: ReadOptions, required: bool, hint: str
) -> np.ndarray | None:
    return load_lengths(manifest, base, read, required=required, hint=hint)


def _open_shared(path: str, count: int) -> SharedLengths:
    try:
        mapped = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        raise StorageError(f"no sample lengths at {path} ({err})") from err
    if mapped.dtype != np.int64 or mapped.shape != (count,):
        raise StorageError(f"the sample lengths at {path} do not hold {count} int64 values")
    out: SharedLengths = mapped.view(SharedLengths)
    out.path = path
    return out


def load_token_lengths(manifest: Manifest, base: str, read: ReadOptions) -> np.ndarray:
    """Every document's token count (int64, by global id), from the sidecars' ``length``
    columns alone, shared through the node cache (NOTE [shared lengths])."""
    try:
        lengths = load_lengths(manifest, base, read, hint="re-pack with --tokenizer")
    except UsageError as err:  # a token shard always records them: its sidecar is wrong
        raise ManifestError(str(err)) from err
    assert lengths is not None
    return lengths


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
    source = (manifest, base, read, required, hint)
    try:
        from shardloader.storage.cache import ShardCache

        path = ShardCache(read.cache, manifest.fingerprint).path_for(_NAME)
        shared = _open_shared(path, manifest.num_samples)
        shared.source = source
        return shared
    except StorageError:
        pass  # not built yet (or no writable cache): read the sidecars
    lengths = _read_lengths(manifest, base, read, required, hint)
    if lengths is None or path is None:
        return lengths
    temp = f"{path}.tmp-{uuid.uuid4().hex}"  # a temp name the cache's eviction recognises
    try:
        np.save(temp, lengths, allow_pickle=False)
        os.replace(temp + ".npy", path)
        shared = _open_shared(path, manifest.num_samples)
        shared.source = source
        return shared
    except (OSError, StorageError) as err:
        log.info("sample lengths stay in memory: cannot write %s (%s)", path, err)
        try:
            os.unlink(temp + ".npy")
        except OSError:
            pass
        return lengths


def _read_lengths(
    manifest: Manifest, base: str, read: ReadOptions, required: bool, hint: str
) -> np.ndarray | None:
    """The sidecars' length columns, into one preallocated array (no list of N integers)."""
    store = read.store(base)
    out = np.empty(manifest.num_samples, np.int64)
    at = 0
    for info in manifest.shards:
        if not info.num_samples:  # nothing to record (its writer may have left the column out)
            continue
        sidecar = store.join(info.index_path)
        where = f"sample index {sidecar.url}"
        data = read_sidecar(sidecar, info, where)
        check_digest(data, info, where)
        column = _lengths_column(data, info.num_samples, sidecar_bound(info), where)
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


def _lengths_column(data: bytes, count: int, bound: int, where: str) -> np.ndarray | None:
    try:
        if declared_sizes(data, where).uncompressed_bytes > bound:
            raise ManifestError(f"{where} declares more bytes than its shard's entry allows")
        buffer = pa.py_buffer(data)
        pool = pa.system_memory_pool()  # freed to the system: no allocator arena stays behind
        at = pa.ipc.open_file(buffer, memory_pool=pool).schema.get_field_index("length")
        if at < 0:
            return None
        options = pa.ipc.IpcReadOptions(included_fields=[at], use_threads=False)
        column = pa.ipc.open_file(buffer, options=options, memory_pool=pool).read_all().column(0)
    except (pa.ArrowException, ShardError) as err:
        raise ManifestError(f"{where} is not a valid shardloader sample index: {err}") from err
    if not pa.types.is_integer(column.type) or column.null_count or len(column) != count:
        raise ManifestError(
            f"{where}: its length column ({column.type}, {len(column)} values) does not give "
            f"the {count} token counts of its shard"
        )
    array = column.combine_chunks()
    width = array.type.bit_width // 8
    kind = "i" if pa.types.is_signed_integer(array.type) else "u"
    lengths = np.frombuffer(  # not to_numpy(): that imports pandas (a second, in every process)
        array.buffers()[1], np.dtype(f"<{kind}{width}"), len(array), array.offset * width
    ).astype(np.int64)
    if lengths.size and lengths.min() < 0:
        raise ManifestError(f"{where}: the sample index has negative lengths")
    return lengths
