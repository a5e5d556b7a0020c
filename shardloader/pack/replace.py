"""Packing into an OUT that already holds a dataset: it stays readable until the new one is whole.

NOTE [replacing a dataset]: ``--overwrite`` over a finished pack (an ``index.json`` in OUT)
keeps the old manifest, and every shard it names, while the new shards are written under
temporary names: a bad input, a crash or Ctrl-C then leaves the old dataset as it was.  Only
when every new shard is written are they moved to their final names (renames, or uploads),
and only if one of those names is one the old manifest lists is the old manifest removed
first (a reader then finds no manifest rather than a shard that no longer matches it); the new
manifest follows, and the old dataset's other files go last.  ``index --overwrite`` and
``merge --overwrite`` keep the old manifest until their own is about to be written, likewise.

``--resume`` is for an interrupted pack of the same source: over a finished pack of another
source (its layout or its first sample differ from what SRC gives) it is refused, naming both,
instead of replacing that dataset shard by shard.
"""

from __future__ import annotations

from shardloader.errors import ManifestError, OutputExistsError, StorageError
from shardloader.manifest import MANIFEST_NAME, Manifest, SampleIndex
from shardloader.pack.layouts.base import Source
from shardloader.pack.refs import LineRun
from shardloader.storage.store import Store

__all__ = ["finished_manifest", "check_resume"]


def finished_manifest(out: Store) -> Manifest | None:
    """The manifest of the finished pack in ``out``; None when there is none (or it cannot be
    read: then there is no dataset to keep readable either)."""
    store = out.join(MANIFEST_NAME)
    try:
        if not store.exists():
            return None
        return Manifest.from_json(store.read_bytes(), store.url)
    except (ManifestError, StorageError):
        return None


def _first_keys(source: Source, n: int = 100) -> list[str]:
    """The first ``n`` sample keys of ``source`` (a few: the first may have been skipped)."""
    keys: list[str] = []
    for item in source.items():
        if isinstance(item, LineRun):
            keys += [f"{item.stem}/{int(k):09d}" for k in item.numbers[: n - len(keys)]]
        else:
            keys.append(item.key)
        if len(keys) >= n:
            break
    return keys


def _old_first_key(out: Store, old: Manifest) -> str | None:
    if not old.shards:
        return None
    shard = old.shards[0]
    try:
        index = SampleIndex.from_arrow_bytes(
            out.join(shard.index_path).read_bytes(), shard.index_path
        )
    except (ManifestError, StorageError):
        return None
    return index.keys[0] if len(index) else None


def check_resume(out: Store, old: Manifest, source: Source) -> None:
    """Refuse ``--resume`` over ``old``, a finished pack, when it is not of ``source``."""
    new_keys = _first_keys(source)
    old_key = _old_first_key(out, old)
    if old.layout == source.layout and old_key in new_keys:
        return
    new_key = new_keys[0] if new_keys else None
    raise OutputExistsError(
        f"--resume: {out.url!r} holds a finished pack of another source (layout "
        f"{old.layout!r}, {old.num_samples:,} samples, first sample {old_key!r}); "
        f"{source.url!r} gives layout {source.layout!r}, first sample {new_key!r}. --resume "
        "finishes an interrupted pack of the same source: pass --overwrite to replace that "
        "dataset, or pick another OUT"
    )
