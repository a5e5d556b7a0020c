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
from collections.abc import Collection, Iterable
from typing import Any

from shardloader.errors import OutputExistsError, StorageError
from shardloader.format.registry import get_format, known_formats
from shardloader.manifest import MANIFEST_NAME, Manifest
from shardloader.pack.lock import LOCK_NAME
from shardloader.pack.replace import finished_manifest
from shardloader.storage.store import Store
from shardloader.storage.uploads import JOURNAL, abort_recorded

__all__ = [
    "SKIP_REPORT",
    "list_out",
    "note_skips",
    "open_out",
    "remove_stale",
    "remove_temps",
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


def list_out(store: Store) -> list[str]:
    """Files below ``store`` (relative paths); [] if it does not exist.  The OUT lock (NOTE
    [the OUT lock] in pack/lock.py) is not among them; taking it refused an OUT that is a file."""
    if not store.is_local:
        try:
            return [p for p in store.list_files() if p != LOCK_NAME]
        except (FileNotFoundError, StorageError):
            return []
    path = store.local_path
    found = []
    for dirpath, _, filenames in os.walk(path):  # nothing when OUT does not exist
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), path).replace(os.sep, "/")
            if rel != LOCK_NAME:
                found.append(rel)
    return sorted(found)


def open_out(
    out: Store, *, overwrite: bool, resume: bool = False, allowed: Iterable[str] = ()
) -> tuple[list[str], set[str]]:
    """What ``out`` holds, once the uploads killed runs left are aborted (NOTE [multipart
    journal] in storage/uploads.py) and their temporary files removed, and with
    ``overwrite`` the paths its old manifest lists.  A non-empty ``out`` (but for ``allowed``
    folders) is refused unless overwriting or resuming."""
    existing = list_out(out)
    if abort_recorded(out, existing):
        existing = list_out(out)
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
    remove_temps(out, existing)
    return existing, _old_manifest_paths(out) if existing and overwrite else set()


def _old_manifest_paths(out: Store) -> set[str]:
    """Shard and sidecar paths listed by an existing manifest in ``out`` (none if unreadable)."""
    manifest = finished_manifest(out)
    if manifest is None:
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


def note_skips(out: Store, skips: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    """Put ``skips`` in plan order, write the skip report when there are any (one JSON object
    a line: reproducible bytes), and say so in the manifest's ``extra``."""
    skips.sort(key=lambda s: s["shard"])
    extra["skipped"] = len(skips)
    if skips:
        lines = [json.dumps(s, sort_keys=True, ensure_ascii=False) + "\n" for s in skips]
        out.join(SKIP_REPORT).write_bytes_atomic("".join(lines).encode())
        extra["skip_report"] = SKIP_REPORT


def remove_stale(
    store: Store,
    existing: Iterable[str],
    manifest: Manifest,
    part: int | None,
    old: Collection[str] = (),
) -> None:
    """Delete the shard and sidecar names a (``part``) run writes that ``manifest`` does not
    list, an unlisted skip report, and ``old`` paths (:func:`open_out` removed the temporaries
    of ``existing``)."""
    stem = r"shard-\d{5,}" if part is None else rf"part-{part:04d}-shard-\d{{5,}}"
    ours = re.compile(rf"^{stem}{_suffix()}$")
    keep = {p for s in manifest.shards for p in (s.path, s.index_path)}
    keep.add(str(manifest.extra.get("skip_report", "")))
    removed = 0
    for rel in existing:
        mine = "/" not in rel and (bool(ours.match(rel)) or rel == SKIP_REPORT)
        if (mine or rel in old) and rel not in keep:
            store.join(rel).remove()
            removed += 1
    if removed:
        log.info("%s: removed %d stale files", store.url, removed)


def remove_temps(store: Store, existing: Iterable[str]) -> None:
    """Delete temporary files that killed runs left behind (never final names)."""
    temp = re.compile(
        rf"^(?:\.{_STEM}{_suffix()}\.tmp-{_HEX}"
        rf"|(?:{re.escape(MANIFEST_NAME)}|{re.escape(SKIP_REPORT)}|{_STEM}\.idx\.arrow)"
        rf"\.tmp-{_HEX})$"
    )
    for rel in existing:
        if "/" not in rel and temp.match(rel):
            store.join(rel).remove()
