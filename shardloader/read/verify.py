"""``verify``: a full check of a packed dataset; every bad shard with its reasons.

It streams every shard once: re-hashes the stored bytes, parses every sample with the format's
reader, compares keys, counts and each sample's checksum with the sidecar (the XXH3-64 that
reading checks, computed by the format's ``iter_checked`` as the stream passes), and runs each
field's codec check (images are decoded).  The sample index a zstd tar carries
(format/embedded.py) is checked too: whole, true to its manifest entry and equal to the sidecar.
It returns data; ``shardloader verify`` prints it.

The dataset is untrusted: files are read no further than the manifest's sizes, sidecars are
checked against their manifest entries, and the format's stream refuses any member whose header
declares more than its sample's extent in the sidecar (or the shard's ``raw_bytes``) before
decompressing it, so a decompression bomb costs no memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, BinaryIO, cast

import numpy as np

from shardloader.codecs.allowlist import check_field
from shardloader.errors import InputError, ShardloaderError, located
from shardloader.format.base import Sample
from shardloader.format.embedded import carried_index, tail_to_keep
from shardloader.format.registry import get_format
from shardloader.manifest import Manifest, SampleIndex, ShardInfo, load_manifest
from shardloader.read.fields import FieldMap
from shardloader.read.sidecar import check_digest, parse_sidecar, read_sidecar
from shardloader.schema import sidecar_bound
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store, as_store
from shardloader.storage.streams import HashingReader, TailReader

__all__ = ["ShardProblem", "VerifyReport", "verify_dataset"]

log = logging.getLogger(__name__)

_MAX_REASONS = 20


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
        return {**asdict(self), "ok": self.ok}


class _Reasons(list[str]):
    def add(self, reason: str) -> None:
        if len(self) < _MAX_REASONS:
            self.append(reason)
        elif len(self) == _MAX_REASONS:
            self.append("... (more problems not listed)")


def _check_sample(
    manifest: Manifest,
    index: SampleIndex | None,
    n: int,
    key: str,
    fields: Mapping[str, bytes],
    images: bool,
    reasons: _Reasons,
    member_of: Mapping[str, str],
    digest: int | None = None,
) -> None:
    if index is not None:
        if n >= len(index):
            reasons.add(f"sample {n} ({key!r}) is not in the sidecar")
            return
        if index.keys[n] != key:
            reasons.add(f"sample {n}: key {key!r}, but the sidecar says {index.keys[n]!r}")
        if digest is not None and index.checksums is not None:
            want = int(index.checksums[n])
            if digest != want:
                reasons.add(
                    f"sample {key!r} has checksum {digest:016x}, its sidecar says {want:016x} "
                    "(reading it fails with a ChecksumError)"
                )
    for ext, data in sorted(fields.items()):
        info = manifest.fields.get(member_of.get(ext, ext))
        if info is None:
            reasons.add(f"sample {key!r}: field {ext!r} is not in the manifest")
            continue
        if info.codec == "tokens":
            width = np.dtype(info.dtype or "uint32").itemsize
            if len(data) % width:
                reasons.add(f"sample {key!r}: tokens field is not a whole number of {info.dtype}")
            elif (
                index is not None
                and index.lengths is not None
                and manifest.length_field == ext
                and len(data) // width != index.lengths[n]
            ):
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
    manifest: Manifest, base: Store, shard: ShardInfo, images: bool
) -> tuple[int, _Reasons]:
    reasons = _Reasons()
    index: SampleIndex | None = None
    sidecar = base.join(shard.index_path)
    try:
        data = read_sidecar(sidecar, shard)
        try:
            check_digest(data, shard)
        except ShardloaderError:
            reasons.add(f"sidecar {shard.index_path} does not match its sha256 in the manifest")
        with located(f"sample index {sidecar.url}"):
            index = parse_sidecar(data, sidecar.url, manifest.format, shard)
    except (ShardloaderError, OSError) as err:
        reasons.add(f"sidecar {shard.index_path}: {err}")
    stored = base.join(shard.path)
    url = stored.url
    member_of = FieldMap.of_manifest(manifest).member_of  # aliases: key.png fills "image"
    fmt = get_format(manifest.format)
    limit = fmt.staged_bound(shard, len(manifest.fields))
    # A member is never larger than the largest sample the sidecar declares (or, without a
    # usable sidecar, than the whole shard): checked from its header, before decompressing.
    biggest = int(index.sizes.max()) if index is not None and len(index) else limit
    n = 0
    try:
        with stored.open_stream(shard.bytes) as raw:
            kept = TailReader(raw, tail_to_keep(sidecar_bound(shard)))
            tap = HashingReader(kept)
            src, compression = cast(BinaryIO, tap), manifest.compression
            stream: Iterator[tuple[Sample, int | None]]
            if index is not None and index.checksums is not None:
                stream = fmt.iter_checked(src, compression, url, index, limit, biggest)
            else:
                stream = ((s, None) for s in fmt.iter_stored(src, compression, url, limit, biggest))
            for (key, fields), digest in stream:
                _check_sample(manifest, index, n, key, fields, images, reasons, member_of, digest)
                n += 1
            tap.drain()
    except (ShardloaderError, OSError) as err:
        reasons.add(str(err))
        return n, reasons
    if tap.hexdigest() != shard.sha256:
        reasons.add(f"sha256 {tap.hexdigest()} does not match the manifest's {shard.sha256}")
    if tap.pos != shard.bytes:
        reasons.add(f"{tap.pos} bytes, the manifest says {shard.bytes}")
    if n != shard.num_samples:
        reasons.add(f"{n} samples, the manifest says {shard.num_samples}")
    if index is not None and len(index) != n:
        reasons.add(f"{n} samples, the sidecar lists {len(index)}")
    _check_carried(manifest, shard, kept, index, reasons)
    return n, reasons


def _check_carried(
    manifest: Manifest,
    shard: ShardInfo,
    stored: TailReader,
    sidecar: SampleIndex | None,
    reasons: _Reasons,
) -> None:
    """The sample index the shard carries (format/embedded.py), if it does: whole (its frame's
    SHA-256), true to the manifest entry and equal to the sidecar's."""
    carried = carried_index(stored.tail)
    if carried is None:
        return
    damaged = "the sample index it carries is damaged"
    passed_over = "readers pass it over for the sidecar; re-pack or re-index the dataset"
    if not carried.whole:
        reasons.add(f"{damaged} (not the SHA-256 its frame carries); {passed_over}")
        return
    try:
        with located(damaged):
            index = parse_sidecar(carried.data, damaged, manifest.format, shard)
    except ShardloaderError as err:
        reasons.add(f"{err}; {passed_over}")
        return
    differ = [] if sidecar is None else _differing(index, sidecar)
    if differ:  # either may be the damaged one: remote readers use this, local ones the sidecar
        reasons.add(
            f"the sample index it carries differs from its sidecar ({', '.join(differ)}), and "
            "remote readers use it instead of the sidecar; re-pack or re-index the dataset"
        )


def _differing(index: SampleIndex, sidecar: SampleIndex) -> list[str]:
    """The columns of ``index`` that are not the sidecar's."""
    differ = [] if list(index.keys) == list(sidecar.keys) else ["keys"]
    for column in ("offsets", "sizes", "lengths", "checksums"):
        ours, theirs = getattr(index, column), getattr(sidecar, column)
        if (ours is None) != (theirs is None) or (
            ours is not None and not np.array_equal(ours, theirs)
        ):
            differ.append(column)
    return differ


def verify_dataset(
    url: str | Store,
    storage_options: Mapping[str, Any] | None = None,
    *,
    images: bool = True,
    progress: Callable[[int, int], None] | None = None,
    retry: RetryPolicy | None = None,
) -> VerifyReport:
    """Re-hash every shard and parse every sample; list the bad shards with their reasons.

    ``url``: a URL (with ``storage_options`` and ``retry``, the policy of every read, as for
    :class:`~shardloader.ReadOptions`) or a Store carrying them.
    """
    store = as_store(url, storage_options, retry)
    manifest, base = load_manifest(store)
    bad = []
    samples = 0
    if progress is not None:  # the total at once, before the first shard (which may be big)
        progress(0, len(manifest.shards))
    for i, shard in enumerate(manifest.shards):
        n, reasons = _verify_shard(manifest, base, shard, images)
        samples += n
        if reasons:
            log.warning("%s: %s", shard.path, "; ".join(reasons))
            bad.append(ShardProblem(shard.path, tuple(reasons)))
        if progress is not None:
            progress(i + 1, len(manifest.shards))
    return VerifyReport(store.url, len(manifest.shards), samples, tuple(bad))
