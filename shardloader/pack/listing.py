"""Listing a source: its data files, sorted, and what was left out of them, and why.

Sizes come from ``stat``/``find``; nothing is read.  Hidden names (a leading dot) and the files
operating systems and archivers leave in folders (``Thumbs.db``, ``desktop.ini``,
``__MACOSX/``) are left out and reported, never dropped silently; symlinked folders are
followed, with loop protection.

File and folder names that are not UTF-8 (Linux allows any bytes but ``/`` and NUL) are listed
under a reversible percent-escape (:func:`shardloader.format.keys.escape_name`: ``b"caf\\xe9.jpg"``
is ``caf%E9.jpg``), so their sample keys, messages and reports are text; the file itself is
opened by its real name.
"""

from __future__ import annotations

import logging
import os
import re

from shardloader.errors import StorageError, UsageError
from shardloader.format.keys import escape_name
from shardloader.pack.layouts.base import Inputs
from shardloader.pack.refs import InputFile
from shardloader.storage.store import Store, as_store, join

__all__ = ["SYSTEM_FILES", "SYSTEM_FOLDERS", "below", "scan_inputs"]

log = logging.getLogger(__name__)

# What operating systems, file managers and archivers leave in folders: never data.  Matched
# case-insensitively on the name alone; hidden names (a leading dot: .DS_Store, ._x, .git/)
# are left out too.  Both are reported (Inputs.ignored), never dropped silently.
SYSTEM_FILES = frozenset({"thumbs.db", "ehthumbs.db", "ehthumbs_vista.db", "desktop.ini"})
SYSTEM_FOLDERS = frozenset({"__macosx", "$recycle.bin", "system volume information"})


def _left_out(name: str, is_dir: bool) -> str | None:
    if name.startswith("."):
        return "hidden"
    if name.lower() in (SYSTEM_FOLDERS if is_dir else SYSTEM_FILES):
        return "system file" if not is_dir else "system folder"
    return None


def below(child: Store, parent: Store, *, real: bool = False) -> str | None:
    """``child``'s path relative to ``parent`` ("" when they are one) when it lies within
    ``parent``, else None; ``real``: local symlinks resolved first.  What keeps OUT out of SRC,
    a manifest's paths inside its folder, and a labels file out of the inputs."""
    if child.is_local and parent.is_local:
        norm = os.path.realpath if real else os.path.abspath
        c, p, sep = norm(child.local_path), norm(parent.local_path), os.sep
    else:
        c, p, sep = child.url.rstrip("/"), parent.url.rstrip("/"), "/"
    if c == p:
        return ""
    base = p if p.endswith(sep) else p + sep
    return c[len(base) :].replace(os.sep, "/") if c.startswith(base) else None


def scan_inputs(src: str | Store) -> Inputs:
    """Every data file below ``src`` (a URL, or a Store with its options and retry policy), or
    ``src`` itself if it is a file, sorted; hidden and system files are left out and listed.

    Symlinked folders are followed, as symlinked files are; one that leads back to a folder it
    sits in (a loop) is left out and listed.  A file that cannot be stat'ed (a dangling link)
    is listed with size 0, so the error surfaces where the file is read, under the pack's
    ``--on-error`` policy.
    """
    store = as_store(src)
    if store.is_local:
        root = os.path.abspath(store.local_path)
        if os.path.isfile(root) or (os.path.exists(root) and not os.path.isdir(root)):
            return Inputs(store, (InputFile(os.path.basename(root), root, os.stat(root).st_size),))
        if not os.path.isdir(root):
            raise UsageError(f"source {store.url!r} does not exist")
        files: list[InputFile] = []
        ignored: list[tuple[str, str]] = []
        _walk(root, "", (_identity(root),), files, ignored)
        listed = Inputs(store, tuple(sorted(files, key=lambda f: f.rel)), tuple(sorted(ignored)))
    else:
        listed = _list_remote(store)
    return _without_side_files(_without_saved_side(listed))


_TARS = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.zstd")
_SIDE_FILES = (
    (".parquet", "img2dataset metadata table"),
    ("_stats.json", "img2dataset download stats"),
)


# ``datasets.Dataset.save_to_disk``: Arrow stream files ``data-00000-of-00002.arrow`` beside
# its ``state.json`` and ``dataset_info.json``; a ``DatasetDict``'s splits are such folders
# below a ``dataset_dict.json``.
_SAVED_DATA = re.compile(r"^data-\d{5}-of-\d{5}\.arrow$")
_SAVED_SIDE = ("state.json", "dataset_info.json")


def _without_side_files(listing: Inputs) -> Inputs:
    """Leave out the files img2dataset writes beside each of its shards:
    ``00000.parquet`` (one row per URL tried) and ``00000_stats.json`` next to a folder
    ``00000/`` of pairs (``000000000.jpg``, ``.txt``, ``.json``) or a tar ``00000.tar``.  They
    describe the shard, they are no sample of it; only beside such a folder or tar are they
    recognised."""
    if not any(f.rel.endswith(suffix) for f in listing.files for suffix, _ in _SIDE_FILES):
        return listing  # the common case: nothing to look for
    folders = {f.rel.rsplit("/", 1)[0] for f in listing.files if "/" in f.rel}
    tars = {f.rel[: -len(t)] for f in listing.files for t in _TARS if f.rel.endswith(t)}
    side = [
        (f.rel, what)
        for f in listing.files
        for suffix, what in _SIDE_FILES
        if f.rel.endswith(suffix) and ((shard := f.rel[: -len(suffix)]) in folders or shard in tars)
    ]
    return listing.without(side)


def _without_saved_side(listing: Inputs) -> Inputs:
    """Leave out ``state.json`` and ``dataset_info.json`` of a ``save_to_disk`` folder (its
    features ride in the Arrow files' schema, and :mod:`.layouts.tables` reads the info file
    when they do not); a ``DatasetDict`` is refused naming its splits, one of which to pack.
    Known by names alone: nothing is read."""
    names: dict[str, set[str]] = {}
    for f in listing.files:
        folder, _, name = f.rel.rpartition("/")
        names.setdefault(folder, set()).add(name)
    saved = {
        folder
        for folder, there in names.items()
        if all(side in there for side in _SAVED_SIDE) and any(map(_SAVED_DATA.match, there))
    }
    if not saved:
        return listing
    for folder, there in names.items():
        splits = sorted(s.rpartition("/")[2] for s in saved if s.rpartition("/")[0] == folder)
        if "dataset_dict.json" in there and splits:
            where = join(listing.url, folder) if folder else listing.url
            raise UsageError(
                f"{where}: a datasets DatasetDict (save_to_disk) of splits {', '.join(splits)}; "
                "pack one split at a time: shardloader pack "
                f"{join(where, 'train' if 'train' in splits else splits[0])} OUT"
            )
    side = [
        (f.rel, "datasets save_to_disk metadata")
        for f in listing.files
        if (parts := f.rel.rpartition("/"))[0] in saved and parts[2] in _SAVED_SIDE
    ]
    return listing.without(side)


def _identity(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _walk(
    path: str,
    rel: str,
    ancestors: tuple[tuple[int, int], ...],
    files: list[InputFile],
    ignored: list[tuple[str, str]],
) -> None:
    """Depth-first over ``path`` (``rel`` below SRC), following symlinked folders unless one
    is among its own ``ancestors`` (device, inode): the walk of a loop would never end."""
    try:
        entries = list(os.scandir(path))
    except OSError as err:
        log.warning("%s: cannot list (%s); left out", path, err.strerror)
        ignored.append((rel + "/", f"cannot list: {err.strerror}"))
        return
    for entry in entries:
        name = escape_name(entry.name)  # a name that is not UTF-8: percent-escaped, see keys.py
        child = f"{rel}/{name}" if rel else name
        try:
            is_dir = entry.is_dir()  # follows symlinks
        except OSError:
            is_dir = False
        why = _left_out(entry.name, is_dir)
        if why is not None:
            ignored.append((child + "/" if is_dir else child, why))
            continue
        if is_dir:
            try:
                ident = _identity(entry.path)
            except OSError as err:
                ignored.append((child + "/", f"cannot list: {err.strerror}"))
                continue
            if ident in ancestors:
                log.warning(
                    "%s: a symlink loop (leads back to a folder it is in); left out", entry.path
                )
                ignored.append((child + "/", "symlink loop: leads back to a folder it is in"))
                continue
            _walk(entry.path, child, (*ancestors, ident), files, ignored)
            continue
        try:
            size = os.stat(entry.path).st_size
        except OSError as err:
            # Listed anyway (size 0): reading it fails and, like any unreadable file, fails
            # the pack naming it, or under --on-error skip is reported and skipped.
            log.warning("%s: cannot stat (%s)", entry.path, err.strerror)
            size = 0
        files.append(InputFile(child, entry.path, size))


def _list_remote(store: Store) -> Inputs:
    fs, path = store.filesystem()
    path = path.rstrip("/")
    src = store.url
    try:
        if fs.isfile(path):
            return Inputs(store, (InputFile(path.rsplit("/", 1)[-1], src, int(fs.size(path))),))
        found = fs.find(path, detail=True)
    except OSError as err:
        raise StorageError(f"cannot list {src!r}: {err}") from err
    out = []
    ignored: dict[str, str] = {}
    for full, info in found.items():
        if info.get("type", "file") != "file":
            continue
        rel = full[len(path) + 1 :]
        if not rel:
            continue
        parts = rel.split("/")
        why = next(
            (
                (i, w)
                for i, part in enumerate(parts)
                if (w := _left_out(part, i < len(parts) - 1)) is not None
            ),
            None,
        )
        if why is not None:  # a folder is reported once, not file by file
            i, reason = why
            ignored.setdefault(
                "/".join(parts[: i + 1]) + ("/" if i < len(parts) - 1 else ""), reason
            )
            continue
        out.append(InputFile(rel, join(src, rel), int(info.get("size") or 0)))
    return Inputs(store, tuple(sorted(out, key=lambda f: f.rel)), tuple(sorted(ignored.items())))
