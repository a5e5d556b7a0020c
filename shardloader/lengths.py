"""Every document's token count, from the sidecars' ``length`` columns alone.

What :class:`~shardloader.batching.blocks.TokenBlocks` plans and assembles from.  Each sidecar
is read within its bound and must hash to the manifest's ``index_sha256`` before its one column
is decoded; keys, offsets and checksums, which only per-sample reads use, are not (parsing and
checking 200,000 keys took longer than the whole first batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from shardloader.errors import ManifestError, ShardError
from shardloader.format.ipc import declared_sizes
from shardloader.schema import sidecar_bound
from shardloader.sidecar import check_digest, read_sidecar

if TYPE_CHECKING:
    from shardloader.manifest import Manifest
    from shardloader.shards import ReadOptions

__all__ = ["load_token_lengths"]


def load_token_lengths(manifest: Manifest, base: str, read: ReadOptions) -> np.ndarray:
    """Every document's token count (int64, by global id), from the sidecars' ``length``
    columns alone: each sidecar is read within its bound and must hash to the manifest's
    ``index_sha256`` before its one column is decoded (keys, offsets and checksums, which
    only per-sample reads use, are not)."""
    store = read.store(base)
    parts = []
    for info in manifest.shards:
        sidecar = store.join(info.index_path)
        where = f"sample index {sidecar.url}"
        data = read_sidecar(sidecar, info, where)
        check_digest(data, info, where)
        parts.append(_lengths_column(data, info.num_samples, sidecar_bound(info), where))
    # Arrow's allocator keeps what decompressing the columns took (~6 MB); workers would
    # inherit it: hand it back before they fork
    pa.default_memory_pool().release_unused()
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _lengths_column(data: bytes, count: int, bound: int, where: str) -> np.ndarray:
    try:
        if declared_sizes(data, where).uncompressed_bytes > bound:
            raise ManifestError(f"{where} declares more bytes than its shard's entry allows")
        buffer = pa.py_buffer(data)
        pool = pa.system_memory_pool()  # freed to the system: no allocator arena stays behind
        at = pa.ipc.open_file(buffer, memory_pool=pool).schema.get_field_index("length")
        if at < 0:
            raise ManifestError(f"{where} records no lengths; re-pack with --tokenizer")
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
