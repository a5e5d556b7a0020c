"""Look at a packed dataset: a summary (``inspect``) and a full check (``verify``).

Both return data; ``shardloader inspect`` / ``verify`` print it.  ``inspect`` reads the manifest
and the small sidecars only.  ``verify`` streams every shard once: it re-hashes the stored
bytes, parses every sample with the format's reader, compares keys and counts with the sidecar,
and runs each field's codec check (images are decoded).

Both treat the dataset as untrusted: files are read no further than the manifest's sizes,
sidecars are checked against their manifest entries, and ``verify`` streams tar members,
refusing any whose header declares more than its sample's extent in the sidecar (or the
shard's ``raw_bytes``) before decompressing it, so a decompression bomb costs no memory.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shardloader.aliases import FieldMap
from shardloader.codecs import check_field
from shardloader.errors import ChecksumError, InputError, ShardloaderError
from shardloader.format.registry import get_format
from shardloader.manifest import Manifest, SampleIndex, ShardInfo, read_manifest
from shardloader.pack.index_existing import HashingReader
from shardloader.schema import check_sample_index, sidecar_bound, staged_bound
from shardloader.shards import BoundedReader
from shardloader.storage import join, open_read

__all__ = [
    "Stats",
    "DatasetSummary",
    "ShardProblem",
    "VerifyReport",
    "inspect_dataset",
    "verify_dataset",
]

log = logging.getLogger(__name__)

_MAX_REASONS = 20


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
            int(v.size), int(v.sum()), int(v.min()), float(v.mean()), float(np.median(v)),
            float(np.percentile(v, 95)), int(v.max()),
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
    lengths: Stats | None
    skipped: int

    @property
    def ratio(self) -> float:
        return self.raw_bytes / self.bytes if self.bytes else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["classes"] = [{"name": n, "samples": c} for n, c in self.classes]
        out["ratio"] = self.ratio
        return out


def _read_sidecar(base: str, shard: ShardInfo, so: Mapping[str, Any]) -> tuple[bytes, str]:
    url = join(base, shard.index_path)
    with BoundedReader(open_read(url, so), sidecar_bound(shard), f"sample index {url}") as f:
        return f.read(), url


def _parse_sidecar(data: bytes, url: str, fmt: str, shard: ShardInfo) -> SampleIndex:
    index = SampleIndex.from_arrow_bytes(data, url, limit=sidecar_bound(shard))
    check_sample_index(index, fmt, shard, f"sample index {url}")
    return index


def _sidecar(base: str, shard: ShardInfo, so: Mapping[str, Any], fmt: str) -> SampleIndex:
    data, url = _read_sidecar(base, shard, so)
    digest = hashlib.sha256(data).hexdigest()
    if digest != shard.index_sha256:
        raise ChecksumError(
            f"sample index {url} hashes to {digest}, the manifest says {shard.index_sha256}; "
            "re-pack or re-index the dataset"
        )
    return _parse_sidecar(data, url, fmt, shard)


def inspect_dataset(url: str, storage_options: Mapping[str, Any] | None = None) -> DatasetSummary:
    """Summarise a dataset from its manifest and sidecars (shards are not read)."""
    so = dict(storage_options or {})
    manifest, base = read_manifest(url, so)
    sizes, lengths = [], []
    counts: dict[str, int] = {}
    has_lengths = manifest.length_field is not None
    for shard in manifest.shards:
        index = _sidecar(base, shard, so, manifest.format)
        sizes.append(np.asarray(index.sizes))
        if index.lengths is None:
            has_lengths = False
        elif has_lengths:
            lengths.append(np.asarray(index.lengths))
        if manifest.layout == "class-folders":
            for key in index.keys:
                name = key.split("/", 1)[0]
                counts[name] = counts.get(name, 0) + 1
    classes = tuple(
        (c, counts.get(c, 0) if manifest.layout == "class-folders" else None)
        for c in manifest.classes
    )
    cat = np.concatenate(sizes) if sizes else np.zeros(0, np.int64)
    return DatasetSummary(
        url=url,
        format=manifest.format,
        compression=manifest.compression,
        layout=manifest.layout,
        num_shards=len(manifest.shards),
        num_samples=manifest.num_samples,
        bytes=sum(s.bytes for s in manifest.shards),
        raw_bytes=sum(s.raw_bytes for s in manifest.shards),
        fields={k: {kk: vv for kk, vv in asdict(v).items() if vv is not None}
                for k, v in sorted(manifest.fields.items())},
        classes=classes,
        shard_samples=Stats.of(manifest.shard_sizes),
        shard_bytes=Stats.of(np.asarray([s.bytes for s in manifest.shards], np.int64)),
        sample_bytes=Stats.of(cat),
        length_field=manifest.length_field if has_lengths else None,
        length_unit=manifest.extra.get("length_unit") if has_lengths else None,
        lengths=Stats.of(np.concatenate(lengths)) if has_lengths and lengths else None,
        skipped=int(manifest.extra.get("skipped", 0) or 0),
    )


# -- verify ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardProblem:
    path: str
    reasons: tuple[str, ...]


@dataclass(frozen=True)
class VerifyReport:
    url: str
    shards: int
    samples: int  # samples parsed and checked
    bad: tuple[ShardProblem, ...]

    @property
    def ok(self) -> bool:
        return not self.bad

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "ok": self.ok,
            "shards": self.shards,
            "samples": self.samples,
            "bad": [{"path": b.path, "reasons": list(b.reasons)} for b in self.bad],
        }


class _Reasons(list[str]):
    def add(self, reason: str) -> None:
        if len(self) < _MAX_REASONS:
            self.append(reason)
        elif len(self) == _MAX_REASONS:
            self.append("... (more problems not listed)")


def _check_sample(
    manifest: Manifest, index: SampleIndex | None, n: int, key: str,
    fields: Mapping[str, bytes], images: bool, reasons: _Reasons,
    member_of: Mapping[str, str],
) -> None:
    if index is not None:
        if n >= len(index):
            reasons.add(f"sample {n} ({key!r}) is not in the sidecar")
            return
        if index.keys[n] != key:
            reasons.add(f"sample {n}: key {key!r}, but the sidecar says {index.keys[n]!r}")
    for ext, data in sorted(fields.items()):
        info = manifest.fields.get(member_of.get(ext, ext))
        if info is None:
            reasons.add(f"sample {key!r}: field {ext!r} is not in the manifest")
            continue
        if info.codec == "tokens":
            width = np.dtype(info.dtype or "uint32").itemsize
            if len(data) % width:
                reasons.add(f"sample {key!r}: tokens field is not a whole number of {info.dtype}")
            elif (index is not None and index.lengths is not None
                  and manifest.length_field == ext and len(data) // width != index.lengths[n]):
                reasons.add(
                    f"sample {key!r}: {len(data) // width} tokens, sidecar length "
                    f"{int(index.lengths[n])}"
                )
            continue
        try:
            check_field(info.codec, data, validate_images=images)
        except InputError as err:
            reasons.add(f"sample {key!r}: field {ext!r}: {err}")


def _verify_shard(
    manifest: Manifest, base: str, shard: ShardInfo, images: bool, so: Mapping[str, Any]
) -> tuple[int, _Reasons]:
    reasons = _Reasons()
    index: SampleIndex | None = None
    index_url = join(base, shard.index_path)
    try:
        data, index_url = _read_sidecar(base, shard, so)
        if hashlib.sha256(data).hexdigest() != shard.index_sha256:
            reasons.add(f"sidecar {shard.index_path} does not match its sha256 in the manifest")
        index = _parse_sidecar(data, index_url, manifest.format, shard)
    except (ShardloaderError, OSError) as err:
        reasons.add(f"sidecar {shard.index_path}: {err}")
        index = None
    url = join(base, shard.path)
    member_of = FieldMap.of_manifest(manifest).member_of  # aliases: key.png fills "image"
    limit = staged_bound(manifest.format, shard, len(manifest.fields))
    # A member is never larger than the largest sample the sidecar declares (or, without a
    # usable sidecar, than the whole shard): checked from its header, before decompressing.
    biggest = int(index.sizes.max()) if index is not None and len(index) else limit
    n = 0
    try:
        with BoundedReader(open_read(url, so), shard.bytes, url) as raw:
            tap = HashingReader(raw, hashing=True)  # type: ignore[arg-type]
            stream = get_format(manifest.format).iter_stored(
                tap, manifest.compression, url, limit, biggest  # type: ignore[arg-type]
            )
            for key, fields in stream:
                _check_sample(manifest, index, n, key, fields, images, reasons, member_of)
                n += 1
            tap.drain()
    except (ShardloaderError, OSError) as err:
        reasons.add(str(err))
        return n, reasons
    assert tap.sha is not None
    if tap.sha.hexdigest() != shard.sha256:
        reasons.add(f"sha256 {tap.sha.hexdigest()} does not match the manifest's {shard.sha256}")
    if tap.pos != shard.bytes:
        reasons.add(f"{tap.pos} bytes, the manifest says {shard.bytes}")
    if n != shard.num_samples:
        reasons.add(f"{n} samples, the manifest says {shard.num_samples}")
    if index is not None and len(index) != n:
        reasons.add(f"{n} samples, the sidecar lists {len(index)}")
    return n, reasons


def verify_dataset(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    images: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Re-hash every shard and parse every sample; list the bad shards with their reasons."""
    so = dict(storage_options or {})
    manifest, base = read_manifest(url, so)
    bad = []
    samples = 0
    for i, shard in enumerate(manifest.shards):
        n, reasons = _verify_shard(manifest, base, shard, images, so)
        samples += n
        if reasons:
            log.warning("%s: %s", shard.path, "; ".join(reasons))
            bad.append(ShardProblem(shard.path, tuple(reasons)))
        if progress is not None:
            progress(i + 1, len(manifest.shards))
    return VerifyReport(url, len(manifest.shards), samples, tuple(bad))
