"""``inspect``: a summary of a packed dataset, from its manifest and the small sidecars only.

It returns data; ``shardloader inspect`` prints it.  The dataset is untrusted: sidecars are read
no further than their bounds and checked against their manifest entries
(shardloader/read/sidecar.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardloader.manifest import load_manifest
from shardloader.read import fields
from shardloader.read.sidecar import load_sidecar
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store, as_store

__all__ = ["DatasetSummary", "Stats", "inspect_dataset"]


@dataclass(frozen=True)
class Stats:
    """Summary statistics of a list of numbers."""

    count: int
    total: int
    min: int
    mean: float
    median: float
    p95: float
    max: int

    @classmethod
    def of(cls, values: np.ndarray) -> Stats | None:
        v = np.asarray(values, np.int64)
        if v.size == 0:
            return None
        return cls(
            int(v.size),
            int(v.sum()),
            int(v.min()),
            float(v.mean()),
            float(np.median(v)),
            float(np.percentile(v, 95)),
            int(v.max()),
        )


@dataclass(frozen=True)
class DatasetSummary:
    url: str
    format: str
    compression: str
    layout: str
    num_shards: int
    num_samples: int
    bytes: int
    raw_bytes: int
    fields: Mapping[str, Mapping[str, str]]
    classes: tuple[tuple[str, int | None], ...]  # (name, samples) in class-index order
    shard_samples: Stats | None
    shard_bytes: Stats | None
    sample_bytes: Stats | None  # uncompressed bytes per sample (tar: with headers)
    length_field: str | None
    length_unit: str | None
    lengths: Stats | None  # of the samples that hold the length field
    skipped: int
    # samples holding each field (pack's counts; None where it recorded none): absent is
    # missing, not 0 bytes
    presence: Mapping[str, int] | None = None

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.bytes if self.bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["classes"] = [{"name": n, "samples": c} for n, c in self.classes]
        out["ratio"] = self.ratio
        return out


def inspect_dataset(
    url: str | Store,
    storage_options: Mapping[str, Any] | None = None,
    *,
    retry: RetryPolicy | None = None,
) -> DatasetSummary:
    """Summarise a dataset from its manifest and sidecars (shards are not read).

    ``url``: a URL (with ``storage_options`` and ``retry``) or a Store carrying them.
    """
    store = as_store(url, storage_options, retry)
    manifest, base = load_manifest(store)
    sizes, lengths = [], []
    counts: Counter[str] = Counter()
    has_lengths = manifest.length_field is not None
    for shard in manifest.shards:
        index = load_sidecar(base.join(shard.index_path), manifest.format, shard)
        sizes.append(np.asarray(index.sizes))
        if index.lengths is None:
            has_lengths = False
        elif has_lengths:
            lengths.append(np.asarray(index.lengths))
        if manifest.layout == "class-folders":
            counts.update(key.split("/", 1)[0] for key in index.keys)
    classes = tuple(
        (c, counts.get(c, 0) if manifest.layout == "class-folders" else None)
        for c in manifest.classes
    )
    cat = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    presence = fields.presence(
        manifest.extra.get("field_samples"), fields.FieldMap.of_manifest(manifest)
    )
    all_lengths = np.concatenate(lengths) if has_lengths and lengths else None
    if all_lengths is not None and presence is not None and manifest.length_field in presence:
        all_lengths = _without_missing(
            all_lengths, manifest.num_samples - presence[manifest.length_field]
        )
    return DatasetSummary(
        url=store.url,
        format=manifest.format,
        compression=manifest.compression,
        layout=manifest.layout,
        num_shards=len(manifest.shards),
        num_samples=manifest.num_samples,
        bytes=sum(s.bytes for s in manifest.shards),
        raw_bytes=sum(s.raw_bytes for s in manifest.shards),
        fields={
            k: {kk: vv for kk, vv in asdict(v).items() if vv is not None}
            for k, v in sorted(manifest.fields.items())
        },
        classes=classes,
        shard_samples=Stats.of(manifest.shard_sizes),
        shard_bytes=Stats.of(np.asarray([s.bytes for s in manifest.shards], np.int64)),
        sample_bytes=Stats.of(cat),
        length_field=manifest.length_field if has_lengths else None,
        length_unit=manifest.extra.get("length_unit") if has_lengths else None,
        lengths=None if all_lengths is None else Stats.of(all_lengths),
        skipped=int(manifest.extra.get("skipped", 0) or 0),
        presence=presence,
    )


def _without_missing(lengths: np.ndarray, missing: int) -> np.ndarray:
    """The lengths of the samples that hold the field: a sample without it is recorded with
    length 0, so ``missing`` of the zeros are theirs (exactly: what is left is the multiset of
    the present samples' lengths, empty ones included)."""
    zeros = np.flatnonzero(lengths == 0)
    if missing <= 0 or missing > len(zeros):
        return lengths
    return np.delete(lengths, zeros[:missing])
