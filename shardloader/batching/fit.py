"""Placement rules for packing: first-fit (:func:`pack_rows`, the rule planner and collate
both run), best-fit (the planner's option) and next-fit (the collate's way of reading a batch
that lists its rows one after another), and how one window of the planner's segments becomes
batches of rows (:func:`pack_window`).  :mod:`shardloader.batching.packed` holds the planner
and the collate that use them.

NOTE [best-fit rows are listed, not re-derived]
    First-fit restricted to a batch's rows places every segment where the planner did, so a
    first-fit batch may list its segments in placement order (NOTE in :func:`pack_rows`).
    Best-fit has no such property: a segment that went to the tightest row would, re-run over
    the batch alone, go to an earlier, looser one.  A best-fit batch therefore lists its rows
    one after another, each row's first segment first, and
    :class:`~shardloader.batching.packed.PackCollate` (built with ``fit="best"``) reads it
    with :func:`next_fit_rows`: a row ends where the next segment does not fit.  That
    re-derives exactly the planned rows because segments are placed longest first: a row's
    first segment opened it because it fitted in no row that existed then, the rows before it
    included, and rows only fill up, so it does not fit in the row listed before it either;
    every other segment fits in its own row.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

__all__ = [
    "pack_rows",
    "Segment",
    "best_fit_rows",
    "next_fit_rows",
    "window_rows",
    "listing",
    "unplaced",
    "pack_window",
]

Segment = tuple[int, int, int]  # (item position in the batch, token start, token stop)

_SHIFT = 40  # a key is room << 40 | row: ordered by room, then by row (the oldest first)
_ROW = (1 << _SHIFT) - 1


def pack_rows(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[Segment]]:
    """First-fit of items, in the given order, into rows of ``seq_len`` tokens.

    An item of length ``<= seq_len`` goes whole into the first row (in creation order) with
    room, else into a new row.  A longer one is split: each full ``seq_len`` piece fills a new
    row, and its remainder starts another new row that later items may share.  Returns the
    rows in creation order, each a list of ``(item, start, stop)`` segments.

    NOTE: this is *the* packing rule.  :class:`~shardloader.batching.packed.PackedBatches` runs
    it over a window of segments (none longer than ``seq_len``, :func:`pack_window`) and
    :class:`~shardloader.batching.packed.PackCollate` re-runs it over one batch's segments in
    batch order; first-fit restricted to a closed subset of rows, visited in the same relative
    order, places every item in the same row, so both agree (tested).  Only rows with room are
    scanned (a zero-length item goes to the first row of all, as first-fit says), so a window
    of many full pieces stays linear.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    rows: list[list[Segment]] = []
    open_row: list[int] = []  # rows with room left, in creation order
    open_room = np.empty(max(int(lens.size), 1), np.int64)  # their free tokens (a prefix)
    for item, length in enumerate(lens.tolist()):
        if length > seq_len:  # a row per piece; the remainder's has room for later items
            rows.extend([(item, a, min(a + seq_len, length))] for a in range(0, length, seq_len))
            if length % seq_len:
                open_room[len(open_row)] = -length % seq_len
                open_row.append(len(rows) - 1)
            continue
        if length == 0 and rows:
            rows[0].append((item, 0, 0))
            continue
        n_open = len(open_row)
        if n_open:
            fits = open_room[:n_open] >= length
            k = int(fits.argmax())
            if fits[k]:
                rows[open_row[k]].append((item, 0, length))
                left = int(open_room[k]) - length
                open_room[k] = left
                if not left:  # full: never a candidate again
                    open_room[k : n_open - 1] = open_room[k + 1 : n_open]
                    del open_row[k]
                continue
        if length < seq_len:
            open_room[n_open] = seq_len - length
            open_row.append(len(rows))
        rows.append([(item, 0, length)])
    return rows


def best_fit_rows(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[int]]:
    """Best-fit of items (each ``<= seq_len``, given longest first) into rows of ``seq_len``.

    Each item goes into the row with the least room that still holds it (the oldest such row
    on a tie), else opens a new row; a zero-length item joins the first row, as in
    :func:`pack_rows`.  Returns the rows in creation order, each
    the items it holds in placement order (its first item opened it).  Rows with room are
    kept in a sorted list, so a window of ``n`` items costs ``O(n log n)`` plus list moves.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    rows: list[list[int]] = []
    keys: list[int] = []  # room << _SHIFT | row, for rows with room left, sorted
    for item, length in enumerate(lens.tolist()):
        if length == 0 and rows:
            rows[0].append(item)
            continue
        at = bisect.bisect_left(keys, length << _SHIFT)
        if at < len(keys):
            key = keys.pop(at)
            row, room = key & _ROW, (key >> _SHIFT) - length
            rows[row].append(item)
        else:
            row, room = len(rows), seq_len - length
            rows.append([item])
        if room > 0:
            bisect.insort(keys, room << _SHIFT | row)
    return rows


def next_fit_rows(
    lengths: Sequence[int] | np.ndarray, seq_len: int
) -> list[list[tuple[int, int, int]]]:
    """Rows of items listed one row after another: an item joins the current row when it fits,
    else starts a new one (NOTE [best-fit rows are listed, not re-derived]).

    An item longer than ``seq_len`` (only when the collate is used on whole documents) is
    split as :func:`pack_rows` splits it: each full piece is a
    row of its own, the remainder starts the next current row.  Returns ``(item, start,
    stop)`` segments per row, in the shape ``pack_rows`` returns.
    """
    rows: list[list[tuple[int, int, int]]] = []
    room = 0
    for item, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if length > seq_len:  # a row per piece, the remainder's the current one
            rows.extend([(item, a, min(a + seq_len, length))] for a in range(0, length, seq_len))
            room = -length % seq_len
            continue
        if rows and length <= room:
            rows[-1].append((item, 0, length))
            room -= length
        else:
            rows.append([(item, 0, length)])
            room = seq_len - length
    return rows


def window_rows(segs: np.ndarray, seq_len: int, fit: str) -> tuple[np.ndarray, list[list[int]]]:
    """One window's ``[n, 3]`` segments sorted longest first (stable), and the rows of
    ``seq_len`` tokens ``fit`` (``"first"`` or ``"best"``) packs them into, in creation order,
    each its items in placement order; best-fit keeps first-fit's rows where they are fewer."""
    segs = segs[np.argsort(segs[:, 1] - segs[:, 2], kind="stable")]
    lens = segs[:, 2] - segs[:, 1]
    first = [[item for item, _, _ in row] for row in pack_rows(lens, seq_len)]
    if fit == "best":
        best = best_fit_rows(lens, seq_len)
        return segs, best if len(best) <= len(first) else first
    return segs, first


def listing(segs: np.ndarray, rows: list[list[int]], fit: str) -> np.ndarray:
    """A batch of these rows (creation order), listed so the collate re-derives them: in
    placement order for first-fit, row after row for best-fit (NOTE [best-fit rows are
    listed, not re-derived])."""
    items = np.fromiter((i for row in rows for i in row), np.int64)
    return segs[np.sort(items) if fit == "first" else items]


def unplaced(segs: np.ndarray, rows: list[list[int]]) -> np.ndarray:
    """The segments none of ``rows`` holds (carried into the next window)."""
    left = np.ones(len(segs), bool)
    left[np.fromiter((i for row in rows for i in row), np.int64)] = False
    return segs[left]


def pack_window(
    segs: np.ndarray, seq_len: int, rows_per_batch: int, fit: str, flush: bool
) -> tuple[list[np.ndarray], np.ndarray]:
    """Pack one window of ``[n, 3]`` segments into rows of ``seq_len`` tokens
    (:func:`window_rows`); return its complete batches of ``rows_per_batch`` rows (with
    ``flush`` also a short last one) and the segments left."""
    segs, rows = window_rows(segs, seq_len, fit)
    r = rows_per_batch
    emit = -(-len(rows) // r) if flush else len(rows) // r
    out = [listing(segs, rows[b * r : (b + 1) * r], fit) for b in range(emit)]
    return out, unplaced(segs, rows[: emit * r])
