"""``merge``: combine the outputs of ``pack --num-parts N --part I`` into one manifest.

Each part's manifest records the global number of every shard it packed (NOTE [parts] in
plan.py), so merging restores the single-machine order exactly.  Two ways to place the shards:

- **copy** (default when a part folder is not inside OUT): shards and sidecars are copied into
  OUT under their single-machine names (``shard-00007.tar.zst``), each checked against its
  sha256 on the way.  The result is byte-identical to what a single-machine ``pack`` writes.
- **reference** (default when every part folder is inside OUT, e.g. ``OUT/part-0003``): nothing
  is copied; the manifest points at ``part-0003/part-0003-shard-00001.tar.zst``.  This is the
  cheap way on object stores, where a cluster job writes its parts next to each other.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shardloader.errors import ChecksumError, ManifestError, UsageError
from shardloader.manifest import MANIFEST_NAME, Manifest, ShardInfo, load_manifest
from shardloader.pack.listing import below
from shardloader.pack.lock import out_lock
from shardloader.pack.outdir import note_skips, open_out, remove_stale
from shardloader.pack.plan import shard_names
from shardloader.storage.retry import RetryPolicy
from shardloader.storage.store import Store, as_store
from shardloader.storage.streams import HashingReader
from shardloader.storage.uploads import put_file_recorded

__all__ = ["MergeReport", "merge"]

log = logging.getLogger(__name__)

_SAME = ("format", "compression", "fields", "classes", "layout", "length_field", "aliases")
_PER_PART_EXTRA = ("part", "skipped", "skip_report", "field_samples")


@dataclass(frozen=True)
class MergeReport:
    out: str
    manifest: Manifest
    mode: str  # "copy" | "reference"
    parts: int
    bytes_copied: int


def _load_parts(
    part_dirs: Sequence[str], store: Store
) -> list[tuple[str, Manifest, Store, Mapping[str, Any]]]:
    loaded = []
    for d in part_dirs:
        manifest, base = load_manifest(Store(d, store.options, store.retry))
        part = manifest.extra.get("part")
        if not isinstance(part, Mapping):
            raise ManifestError(
                f"{d}: not the output of a partial pack (no 'part' in its manifest); merge "
                "combines folders written by `pack --num-parts N --part I`"
            )
        loaded.append((d, manifest, base, part))
    loaded.sort(key=lambda t: int(t[3]["index"]))
    count = int(loaded[0][3]["count"])
    indices = [int(t[3]["index"]) for t in loaded]
    if indices != list(range(count)):
        missing = sorted(set(range(count)) - set(indices))
        dup = sorted({i for i in indices if indices.count(i) > 1})
        raise UsageError(
            f"merge needs each of the {count} parts exactly once; got parts {indices}"
            + (f", missing {missing}" if missing else "")
            + (f", repeated {dup}" if dup else "")
        )
    first_dir, first, _, first_part = loaded[0]
    for d, m, _, part in loaded[1:]:
        if int(part["count"]) != count or part["planned_shards"] != first_part["planned_shards"]:
            raise ManifestError(
                f"{d}: packed as part of a different plan than {first_dir} "
                f"({part['count']} parts, {part['planned_shards']} shards vs {count}, "
                f"{first_part['planned_shards']}); re-pack the parts with the same input and "
                "options"
            )
        for attr in _SAME:
            if getattr(m, attr) != getattr(first, attr):
                raise ManifestError(
                    f"{d}: {attr} {getattr(m, attr)!r} differs from {first_dir}'s "
                    f"{getattr(first, attr)!r}; parts must be packed with the same options"
                )
        if _shared_extra(m) != _shared_extra(first):
            raise ManifestError(f"{d}: packing options differ from {first_dir}'s (manifest extra)")
    return loaded


def _shared_extra(m: Manifest) -> dict[str, Any]:
    return {k: v for k, v in m.extra.items() if k not in _PER_PART_EXTRA}


def _copy_verified(src: Store, dst: Store, sha256: str, staging: str, run_id: str) -> int:
    """Copy ``src`` to ``dst`` through a temporary file, checking its sha256."""
    name = dst.url.rsplit("/", 1)[-1]
    tmp = os.path.join(staging, f".{name}.tmp-{run_id}")
    try:
        with src.open_read() as fin, open(tmp, "wb") as fout:
            read = HashingReader(fin)
            while chunk := read.read(4 << 20):
                fout.write(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if read.hexdigest() != sha256:
            raise ChecksumError(
                f"{src.url}: sha256 {read.hexdigest()} does not match its manifest ({sha256}); "
                "re-pack this part"
            )
        parent, _, name = dst.url.rpartition("/")  # recorded if it goes up in parts
        put_file_recorded(Store(parent, dst.options, dst.retry), name, tmp, run_id)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return read.pos


def merge(
    part_dirs: Sequence[str],
    out: str | Store,
    *,
    mode: str = "auto",
    overwrite: bool = False,
    storage_options: Mapping[str, Any] | None = None,
    retry: RetryPolicy | None = None,
) -> MergeReport:
    """Combine part outputs into ``out``; the manifest is written last.

    ``out``: a URL (with ``storage_options`` and ``retry``, the policy of every remote call)
    or a Store carrying them; the part folders are read with the same options and policy.
    """
    store = as_store(out, storage_options, retry)
    with out_lock(store, "merge") as lock:  # NOTE [the OUT lock] in pack/lock.py
        return _merge(part_dirs, store, mode, overwrite, lock.run_id)


def _merge(
    part_dirs: Sequence[str], store: Store, mode: str, overwrite: bool, run_id: str
) -> MergeReport:
    if mode not in ("auto", "copy", "reference"):
        raise UsageError(f"merge mode {mode!r}: choose 'auto', 'copy' or 'reference'")
    if not part_dirs:
        raise UsageError("merge needs at least one part folder")
    out = store.url
    loaded = _load_parts(part_dirs, store)
    inside = [below(base, store, real=True) or None for _, _, base, _ in loaded]
    if mode == "reference" and None in inside:
        bad = loaded[inside.index(None)][0]
        raise UsageError(f"--reference needs every part inside OUT; {bad} is not in {out}")
    if mode == "auto":
        mode = "reference" if None not in inside else "copy"
    allowed = [p for p in inside if p is not None] if mode == "reference" else []
    existing, old = open_out(store, overwrite=overwrite, allowed=allowed)

    first = loaded[0][1]
    planned = int(loaded[0][3]["planned_shards"])
    by_number: dict[int, tuple[ShardInfo, Store, str | None]] = {}
    skips: list[dict[str, Any]] = []
    for (d, m, base, part), rel in zip(loaded, inside, strict=True):
        numbers = list(part["shard_numbers"])
        if len(numbers) != len(m.shards):
            raise ManifestError(f"{d}: lists {len(m.shards)} shards but {len(numbers)} numbers")
        for number, shard in zip(numbers, m.shards, strict=True):
            if number in by_number or not 0 <= number < planned:
                raise ManifestError(f"{d}: shard number {number} is repeated or out of range")
            by_number[number] = (shard, base, rel)
        if m.extra.get("skip_report"):
            report = base.join(str(m.extra["skip_report"])).read_bytes().decode()
            skips.extend(json.loads(line) for line in report.splitlines() if line.strip())

    # The parts are read and checked: only now does an old manifest go (NOTE [replacing a
    # dataset] in pack/replace.py), before shards it may name are copied over.
    if existing:
        store.join(MANIFEST_NAME).remove()
    staging = store.local_path if store.is_local else tempfile.mkdtemp(prefix="shardloader-merge-")
    os.makedirs(staging, exist_ok=True)
    shards = []
    copied = 0
    for number in sorted(by_number):
        shard, base, rel = by_number[number]
        if mode == "reference":
            name, index_name = f"{rel}/{shard.path}", f"{rel}/{shard.index_path}"
        else:
            name, index_name = shard_names(number, first.format, first.compression)
            for path, to, sha in (
                (shard.path, name, shard.sha256),
                (shard.index_path, index_name, shard.index_sha256),
            ):
                copied += _copy_verified(base.join(path), store.join(to), sha, staging, run_id)
        shards.append(replace(shard, path=name, index_path=index_name))
    if not store.is_local:
        os.rmdir(staging)

    extra = _shared_extra(first)
    note_skips(store, skips, extra)
    counts = [m.extra.get("field_samples") for _, m, _, _ in loaded]
    if all(isinstance(c, dict) for c in counts):  # samples holding each extension, summed
        total: Counter[str] = sum(map(Counter, counts), Counter())
        extra["field_samples"] = dict(sorted(total.items()))
    manifest = replace(first, shards=shards, extra=extra)  # the rest is the same in every part
    store.join(MANIFEST_NAME).write_bytes_atomic(manifest.to_json())
    if existing:
        remove_stale(store, existing, manifest, None, old)
    log.info("merged %d parts into %s (%s)", len(loaded), out, mode)
    return MergeReport(out, manifest, mode, len(loaded), copied)
