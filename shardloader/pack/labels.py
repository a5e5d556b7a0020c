"""``pack DIR OUT --labels FILE``: labels that live beside a flat image folder, not in it.

ImageNet's validation set is the model: 50,000 images in one folder, and their labels in a
separate file, either a ``filename,label`` CSV (a header row is optional; a filename may be given
with or without its extension: ``ILSVRC2012_val_00000001.JPEG`` or ``ILSVRC2012_val_00000001``)
or the devkit's list, one label a line in sorted file order.  Each sample gets the field ``cls``:
labels that are all integers stay those integers (the manifest has no ``classes``), names
(``n01440764``) become indexes into the sorted names, which the manifest's ``classes`` keeps, as
class folders have it.

A file without a label, or a label row without a file, is an :class:`InputError` naming them;
under ``--on-error skip`` the samples are left out and both are listed with the files the listing
left out.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from dataclasses import dataclass

from shardloader.errors import InputError, StorageError, UsageError
from shardloader.pack.refs import InputFile
from shardloader.storage.store import Store

__all__ = ["Labelled", "read_labels", "attach_labels"]

_MAX_LABELS_BYTES = 256 << 20  # ImageNet val's CSV is 2 MB; anything this big is no labels file


@dataclass(frozen=True)
class Labelled:
    """What ``--labels`` gives discovery: each key's ``cls`` bytes, the class names (empty when
    the labels are integers), and what was left out, ``(where, why)``."""

    labels: Mapping[str, bytes]
    classes: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...]


def read_labels(store: Store) -> list[tuple[int, str | None, str]]:
    """``(line, filename or None, label)`` rows of a labels file: a CSV of
    ``filename,label`` rows, or a list of labels, one a line (filename ``None``)."""
    try:
        data = store.read_bytes()
    except (OSError, StorageError) as err:
        raise UsageError(f"--labels {store.url}: cannot read it ({err})") from err
    if len(data) > _MAX_LABELS_BYTES:
        raise UsageError(f"--labels {store.url}: {len(data):,} bytes is no labels file")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"--labels {store.url}: not UTF-8 text ({err})") from None
    rows = [
        (n, [cell.strip() for cell in row])
        for n, row in enumerate(csv.reader(io.StringIO(text)), 1)
        if row and any(cell.strip() for cell in row)
    ]
    if not rows:
        raise UsageError(f"--labels {store.url}: no labels in it")
    if all(len(cells) == 1 for _, cells in rows):  # the devkit's list
        return [(n, None, cells[0]) for n, cells in rows]
    for n, cells in rows:
        if len(cells) != 2 or not cells[0] or not cells[1]:
            raise UsageError(
                f"--labels {store.url}: line {n} is {','.join(cells)!r}; give filename,label "
                "rows (a header row is optional) or one label a line in sorted file order"
            )
    return [(n, cells[0], cells[1]) for n, cells in rows]


def attach_labels(
    rows: list[tuple[int, str | None, str]],
    files: tuple[InputFile, ...],
    keys: Mapping[str, str],
    where: str,
    skip: bool,
) -> Labelled:
    """Match ``rows`` to the samples: ``keys`` maps each file (path relative to SRC) to its
    sample key; a row names a file by that path or by its key."""
    order = list(dict.fromkeys(keys[f.rel] for f in files))  # sample keys in sorted file order
    by_key: dict[str, str] = {}
    extra: list[tuple[str, str]] = []
    if rows[0][1] is None:
        if len(rows) != len(order):
            raise InputError(
                f"--labels {where}: {len(rows):,} labels for {len(order):,} files; a list of "
                "labels needs one a line for each file, in sorted file order"
            )
        by_key = {k: label for k, (_, _, label) in zip(order, rows, strict=True)}
    else:
        names = {**{k: k for k in order}, **dict(keys)}
        for i, (n, name, label) in enumerate(rows):
            key = names.get(name) if name is not None else None
            if key is None:
                if i == 0:
                    continue  # a header row (filename,label): it names no file
                extra.append((f"{where} line {n} ({name})", "a label for a file SRC does not have"))
            elif key in by_key and by_key[key] != label:
                raise InputError(
                    f"--labels {where}: line {n} gives {name!r} the label {label!r}, an earlier "
                    f"line {by_key[key]!r}; give each file one label"
                )
            else:
                by_key[key] = label
    missing = [k for k in order if k not in by_key]
    if (missing or extra) and not skip:
        said = []
        if missing:
            have = "file has" if len(missing) == 1 else "files have"
            said.append(f"{len(missing):,} {have} no label (e.g. {missing[0]!r})")
        if extra:
            said.append(
                f"{len(extra):,} label{'s name' if len(extra) != 1 else ' names'} no file "
                f"(e.g. {extra[0][0]})"
            )
        raise InputError(
            f"--labels {where}: {'; '.join(said)}; fix the labels file, or pass --on-error skip "
            "to leave those out (they are listed)"
        )
    gone = set(missing)
    left_out = [(f.rel, f"no label in {where}") for f in files if keys[f.rel] in gone] + extra
    if not by_key:
        raise InputError(f"--labels {where}: no file of SRC has a label in it")
    values = set(by_key.values())  # integers are the labels, else names of classes
    classes = () if all(map(_is_int, values)) else tuple(sorted(values))
    index = {c: i for i, c in enumerate(classes)}
    labels = {k: str(index[v] if classes else int(v)).encode("ascii") for k, v in by_key.items()}
    return Labelled(labels, classes, tuple(left_out))


def _is_int(value: str) -> bool:
    digits = value[1:] if value[:1] in "+-" else value
    return digits.isascii() and digits.isdigit()
