"""A mixture's virtual shards: one manifest over every source's, and reads routed back.

A :class:`~shardloader.mixture.Mixture` numbers source ``s``'s sample ``i`` as
``offset[s] + i`` and its shards after the previous sources' (sources in the order given).
:func:`virtual_manifest` lays the shards out so; a pass and its read-ahead then ask for samples
and shards by those numbers, and :class:`MixedShards` routes each back to its source's own
:class:`~shardloader.read.shardset.ShardSet` (its manifest, storage options, cache and error
messages).  Both follow the same numbering, so they live together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from shardloader.errors import UsageError
from shardloader.format.base import Rows
from shardloader.manifest import FieldInfo, Manifest
from shardloader.read.shardset import ReadOptions, ShardSet

__all__ = ["MixedShards", "virtual_manifest"]


def virtual_manifest(names: Sequence[str], manifests: Sequence[Manifest]) -> Manifest:
    """One manifest over every source's shards (paths prefixed with the source name):
    the fingerprint covers all sources, and the sizes define the virtual ids."""
    shards: list[Any] = []
    fields: dict[str, FieldInfo] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    lengths = {m.length_field for m in manifests}
    for name, m in zip(names, manifests, strict=True):
        for ext, info in m.fields.items():
            known: FieldInfo | None = fields.get(ext)
            if known is not None and known != info:
                raise UsageError(
                    f"source {name!r}: field {ext!r} is {info.codec}, another source's is "
                    f"{known.codec}; sources of a mixture must agree on shared fields"
                )
            fields[ext] = info
        aliases.update(m.aliases)
        shards += [
            dataclasses.replace(s, path=f"{name}/{s.path}", index_path=f"{name}/{s.index_path}")
            for s in m.shards
        ]
    first = manifests[0]
    return Manifest(
        first.format,
        first.compression,
        fields,
        shards,
        length_field=lengths.pop() if len(lengths) == 1 else None,
        extra={"mixture": list(names)},
        aliases=aliases,
    )


class MixedShards:
    """Reads virtual ids through one :class:`ShardSet` per source (the interface a pass and
    its read-ahead use: locate, read_batch, ready, prefetch, staging, local_file, close)."""

    def __init__(self, sets: list[ShardSet], options: ReadOptions) -> None:
        self.sets, self.options = sets, options
        sizes = [s.manifest.num_samples for s in sets]
        self.id_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        counts = [len(s.manifest.shards) for s in sets]
        self.shard_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        shard_sizes = np.concatenate([s.manifest.shard_sizes for s in sets])
        self.starts = np.concatenate([[0], np.cumsum(shard_sizes)]).astype(np.int64)
        self.in_place = all(s.in_place for s in sets)

    def restage(self, shard: int) -> bool:
        own, local = self._source_of_shard(shard)
        return own.restage(local)

    def _source_of_shard(self, shard: int) -> tuple[ShardSet, int]:
        s = int(np.searchsorted(self.shard_offsets, shard, side="right") - 1)
        return self.sets[s], int(shard - self.shard_offsets[s])

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(virtual shard number, index inside it) of each virtual id."""
        shards = np.searchsorted(self.starts, ids, side="right") - 1
        return shards, ids - self.starts[shards]

    def describe(self, shard: int) -> str:
        own, local = self._source_of_shard(shard)
        return own.describe(local)

    def local_file(self, shard: int) -> str:
        own, local = self._source_of_shard(shard)
        return own.local_file(local)

    def _split(self, ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(source, positions in ``ids``) of each source present."""
        source = np.searchsorted(self.id_offsets, ids, side="right") - 1
        return [(int(s), np.flatnonzero(source == s)) for s in np.unique(source)]

    def read_batch(self, ids: np.ndarray) -> Rows:
        out = Rows(len(ids))
        for s, at in self._split(ids):
            self.sets[s].read_into(ids[at] - self.id_offsets[s], out, at.tolist())
        return out

    def ready(self, batches: list[np.ndarray]) -> int:
        if self.in_place:
            return len(batches)
        for k, ids in enumerate(batches):
            for s, at in self._split(ids):
                if not self.sets[s].ready([ids[at] - self.id_offsets[s]]):
                    return k
        return len(batches)

    def _by_source(self, shards: Any) -> dict[ShardSet, list[int]]:
        groups: dict[ShardSet, list[int]] = {}
        for shard in shards:
            own, local = self._source_of_shard(shard)
            groups.setdefault(own, []).append(local)
        return groups

    def prefetch(self, shards: Any) -> None:
        for own, local in self._by_source(shards).items():
            own.prefetch(local)

    def staging(self, shards: Any) -> bool:
        return any(own.staging(local) for own, local in self._by_source(shards).items())

    def close(self) -> None:
        for s in self.sets:
            s.close()
