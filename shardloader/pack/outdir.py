"""The output folder: refuse to clobber, clean up only what shardloader itself wrote.

Only files with our own names are ever deleted: temporary files of earlier runs
(``.shard-00000.tar.zst.tmp-<32 hex>``, ``index.json.tmp-<32 hex>``, ...), shards and sidecars
named like the ones this run writes, the skip report, and paths an old manifest listed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from shardloader.errors import ManifestError, OutputExistsError, StorageError, UsageError
from shardloader.format.registry import get_format, known_formats
from shardloader.manifest import MANIFEST_NAME, Manifest
from shardloader.pack.lock import LOCK_NAME
from shardloader.storage.store import Store
from shardloader.storage.uploads import JOURNAL

__all__ = [
    "SKIP_REPORT",
    "list_out",
    "check_writable",
    "old_manifest_paths",
    "remove_stale",
    "remove_temps",
    "shard_pattern",
    "write_skip_report",
    "read_skip_report",
]

log = logging.getLogger(__name__)

SKIP_REPORT = "skipped.jsonl"
_HEX = r"[0-9a-f]{32}"
_STEM = r"(?:part-\d{4}-)?shard-\d{5,}"


def _suffix() -> str:
    """Suffixes of every known format's shards, and of sidecars (asked each time: a format may
    be registered after this module is imported)."""
    found = {s for name in known_formats() for s in get_format(name).suffixes.values()}
    return "(?:" + "|".join(re.escape(s) for s in sorted(found | {".idx.arrow"})) + ")"


def _temp() -> re.Pattern[str]:
    return re.compile(
        rf"^(?:\.{_STEM}{_suffix()}\.tmp-{_HEX}"
        rf"|(?:{re.escape(MANIFEST_NAME)}|{re.escape(SKIP_REPORT)}|{_STEM}\.idx\.arrow)"
        rf"\.tmp-{_HEX})$"
    )


def shard_pattern(part: int | None) -> re.Pattern[str]:
    """Names of shards and sidecars a (part) run writes: ``shard-00001.tar.zst`` etc."""
    stem = r"shard-\d{5,}" if part is None else rf"part-{part:04d}-shard-\d{{5,}}"
    return re.compile(rf"^{stem}{_suffix()}$")


def list_out(store: Store) -> list[str]:
    """Files below ``store`` (relative paths); [] if it does not exist.  The OUT lock (NOTE
    [the OUT lock] in pack/lock.py) is not among them."""
    return [p for p in _list_out(store) if p != LOCK_NAME]


def _list_out(store: Store) -> list[str]:
    if store.is_local:
        path = store.local_path
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"output {store.url!r} exists and is not a folder")
        if not os.path.isdir(path):
            return []
        found = []
        for dirpath, _, filenames in os.walk(path):
            for name in filenames:
                rel = os.path.relpath(os.path.join(dirpath, name), path)
                found.append(rel.replace(os.sep, "/"))
        return sorted(found)
    try:
        return store.list_files()
    except (FileNotFoundError, StorageError):
        return []


def check_writable(
    out: Store,
    existing: Collection[str],
    *,
    overwrite: bool,
    resume: bool = False,
    allowed: Iterable[str] = (),
) -> None:
    """Refuse a non-empty ``out`` unless overwriting or resuming."""
    allowed = (*allowed, JOURNAL)  # records of uploads killed runs left: swept, not data
    blocking = [p for p in existing if not any(p == a or p.startswith(a + "/") for a in allowed)]
    if blocking and not (overwrite or resume):
        more = f" and {len(blocking) - 1} more" if len(blocking) > 1 else ""
        remedy = "pass --overwrite to replace what is there"
        if allowed == (JOURNAL,):
            remedy += ", or --resume to finish an interrupted pack"
        raise OutputExistsError(
            f"output {out.url!r} is not empty (holds {blocking[0]!r}{more}); {remedy}"
        )


def old_manifest_paths(
    out: Store,
) -> set[str]:
    """Shard and sidecar paths listed by an existing manifest in ``out`` (none if unreadable)."""
    store = out.join(MANIFEST_NAME)
    url = store.url
    if not store.exists():
        return set()
    try:
        manifest = Manifest.from_json(store.read_bytes(), url)
    except (ManifestError, StorageError) as err:
        log.warning("%s: ignoring unreadable old manifest (%s)", url, err)
        return set()
    paths = set()
    for s in manifest.shards:
        for p in (s.path, s.index_path):
            if not p.startswith("/") and ".." not in p.split("/") and "://" not in p:
                paths.add(p)
    skip = manifest.extra.get("skip_report")
    if isinstance(skip, str) and "/" not in skip:
        paths.add(skip)
    return paths


def remove_stale(
    store: Store,
    existing: Iterable[str],
    keep: Collection[str],
    pattern: re.Pattern[str] | None,
    old: Collection[str] = (),
) -> list[str]:
    """Delete our temporaries, our shard/sidecar names not in ``keep``, and ``old`` paths."""
    temp = _temp()
    removed = []
    for rel in existing:
        top = "/" not in rel
        ours = top and (
            bool(temp.match(rel))
            or (pattern is not None and bool(pattern.match(rel)))
            or rel == SKIP_REPORT
        )
        if (ours or rel in old) and rel not in keep:
            store.join(rel).remove()
            removed.append(rel)
    if removed:
        log.info("%s: removed %d stale files", store.url, len(removed))
    return removed


def remove_temps(
    store: Store,
    existing: Iterable[str],
) -> None:
    """Delete temporary files that killed runs left behind (never final names)."""
    temp = _temp()
    for rel in existing:
        if "/" not in rel and temp.match(rel):
            store.join(rel).remove()


def write_skip_report(
    out: Store,
    skips: Iterable[Mapping[str, Any]],
) -> None:
    """One JSON object per skipped sample or file, in plan order (reproducible bytes)."""
    lines = [json.dumps(dict(s), sort_keys=True, ensure_ascii=False) + "\n" for s in skips]
    out.join(SKIP_REPORT).write_bytes_atomic("".join(lines).encode())


def read_skip_report(
    store: Store,
) -> list[dict[str, Any]]:
    data = store.read_bytes()
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]
