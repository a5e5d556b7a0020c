"""Placement rules for packing besides first-fit: best-fit (the planner's) and next-fit (the
collate's way of reading a batch that lists its rows one after another).

NOTE [best-fit rows are listed, not re-derived]
    First-fit restricted to a batch's rows places every segment where the planner did, so a
    first-fit batch may list its segments in placement order (NOTE in
    :func:`~shardloader.batching.packed.pack_rows`).  Best-fit has no such property: a
    segment that went to the tightest row would, re-run over the batch alone, go to an
    earlier, looser one.  A best-fit batch therefore lists its rows one after another, each
    row's first segment first, and :class:`~shardloader.batching.packed.PackCollate` (built
    with ``fit="best"``) reads it with :func:`next_fit_rows`: a row ends where the next
    segment does not fit.  That re-derives exactly the planned rows because segments are
    placed longest first: a row's first segment opened it because it fitted in no row that
    existed then, the rows before it included, and rows only fill up, so it does not fit
    in the row listed before it either; every other segment fits in its own row.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

__all__ = ["best_fit_rows", "next_fit_rows"]

_SHIFT = 40  # a key is room << 40 | row: ordered by room, then by row (the oldest first)
_ROW = (1 << _SHIFT) - 1


def best_fit_rows(lengths: Sequence[int] | np.ndarray, seq_len: int) -> list[list[int]]:
    """Best-fit of items (each ``<= seq_len``, given longest first) into rows of ``seq_len``.

    Each item goes into the row with the least room that still holds it (the oldest such row
    on a tie), else opens a new row; a zero-length item joins the first row, as in
    :func:`~shardloader.batching.packed.pack_rows`.  Returns the rows in creation order, each
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
    split as :func:`~shardloader.batching.packed.pack_rows` splits it: each full piece is a
    row of its own, the remainder starts the next current row.  Returns ``(item, start,
    stop)`` segments per row, in the shape ``pack_rows`` returns.
    """
    rows: list[list[tuple[int, int, int]]] = []
    room = 0
    for item, length in enumerate(np.asarray(lengths, dtype=np.int64).tolist()):
        if length > seq_len:
            full = length // seq_len
            rows.extend([(item, p * seq_len, (p + 1) * seq_len)] for p in range(full))
            room = 0
            if length > full * seq_len:
                rows.append([(item, full * seq_len, length)])
                room = (full + 1) * seq_len - length
            continue
        if rows and length <= room:
            rows[-1].append((item, 0, length))
            room -= length
        else:
            rows.append([(item, 0, length)])
            room = seq_len - length
    return rows
