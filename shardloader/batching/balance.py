"""Compute-balanced steps: which packed rows each data-parallel rank gets (pure, numpy only).

Rows of ``seq_len`` tokens hold the same number of tokens but not the same work: under
variable-length attention a row costs about ``sum(L**2) + c * sum(L)`` over its segments
(attention grows with the square of each segment's length, everything else with its tokens;
``c`` is about 6 x the model width for a transformer's linear layers, 0 for attention alone).
A step waits for its slowest rank, so :class:`~shardloader.batching.packed.PackedBatches`
with ``balance="attention"`` plans each step's ``ranks`` batches together, window by window
(:func:`pack_window_balanced`).

NOTE [balanced steps]
    One window's segments are packed into rows exactly as without balance (first-fit or
    best-fit decreasing, :mod:`shardloader.batching.fit`).  The window's rows, ordered by cost
    (most expensive first), are cut into steps of ``ranks * rows_per_batch`` rows, so a step's
    rows cost about the same; inside a step they are dealt onto ``ranks`` batches of exactly
    ``rows_per_batch`` rows (longest processing time first with a count cap, then pairwise
    swaps between the dearest and the cheapest batch while they lower the dearest).  Every
    batch still lists rows of one window's packing in creation order, so the collate
    re-derives exactly its rows (NOTE [best-fit rows are listed, not re-derived]: any subset
    of one packing's rows, listed so, re-derives itself).  Rows that do not fill a step are
    carried into the next window; the last window's short step is dealt onto as many batches
    as its rows fill.  Batches leave here in steps: the planner shuffles whole steps (the
    short one stays last), so batch ``i`` of a partition, which goes to rank ``i mod ranks``
    (NOTE [rank and worker split] in :mod:`shardloader.plan.split`), meets the batches it was
    balanced with.  No segment is read twice and none moves between windows' packings.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shardloader.batching.fit import listing, unplaced, window_rows

__all__ = [
    "BALANCE_POLICIES",
    "segment_cost",
    "batch_costs",
    "assign_capped",
    "pack_window_balanced",
    "shuffled_steps",
    "step_imbalance",
]

BALANCE_POLICIES = (None, "attention")
_SWAPS = 64  # swap rounds per step: each lowers the dearest batch, a step of rows settles fast


def segment_cost(lengths: np.ndarray, c: float) -> np.ndarray:
    """Cost of segments of these token counts: ``L**2 + c * L`` (float64)."""
    lens = np.asarray(lengths, np.float64)
    return lens * lens + float(c) * lens


def batch_costs(batches: Sequence[np.ndarray], c: float) -> np.ndarray:
    """Cost of each ``[k, 3]`` segment batch: the sum of its segments' costs."""
    return np.fromiter(
        (float(segment_cost(b[:, 2] - b[:, 1], c).sum()) if len(b) else 0.0 for b in batches),
        np.float64,
        len(batches),
    )


def assign_capped(costs: np.ndarray, bins: int, cap: int) -> np.ndarray:
    """The bin (of ``bins``) of each item, each bin holding at most ``cap`` items, so that the
    largest bin total is small: longest processing time first among bins with room, then
    swaps (and moves into bins with room) between the largest and the smallest bins while
    they lower the largest.  Deterministic: ties go to the lower bin."""
    cost = np.asarray(costs, np.float64)
    n = cost.size
    if n > bins * cap:
        raise ValueError(f"{n} items do not fit {bins} bins of {cap}")
    where = np.empty(n, np.int64)
    loads = np.zeros(bins, np.float64)
    counts = np.zeros(bins, np.int64)
    for i in np.argsort(-cost, kind="stable").tolist():
        room = np.flatnonzero(counts < cap)
        b = int(room[np.argmin(loads[room])])
        where[i] = b
        loads[b] += cost[i]
        counts[b] += 1
    for _ in range(_SWAPS):
        hi = int(np.argmax(loads))
        if not _improve(cost, where, loads, counts, hi, cap):
            break
    return where


def _improve(
    cost: np.ndarray, where: np.ndarray, loads: np.ndarray, counts: np.ndarray, hi: int, cap: int
) -> bool:
    """One swap or move out of bin ``hi`` (the largest) that lowers it without making another
    bin as large; False when there is none."""
    mine = np.flatnonzero(where == hi)
    for lo in np.argsort(loads, kind="stable").tolist():
        gap = loads[hi] - loads[lo]
        if lo == hi or gap <= 0:
            break
        theirs = np.flatnonzero(where == lo)
        # a swap moves delta = cost[x] - cost[y] from hi to lo; it helps when 0 < delta < gap,
        # and most when delta is nearest gap / 2
        delta = cost[mine][:, None] - np.concatenate([cost[theirs], [0.0]])[None, :]
        if counts[lo] >= cap:
            delta[:, -1] = np.nan  # no room: a move is not allowed
        ok = (delta > 0) & (delta < gap)
        if not ok.any():
            continue
        score = np.where(ok, np.abs(gap - 2 * delta), np.inf)
        x, y = np.unravel_index(int(np.argmin(score)), score.shape)
        d = float(delta[x, y])
        where[mine[x]] = lo
        if y < theirs.size:
            where[theirs[y]] = hi
        else:
            counts[lo] += 1
            counts[hi] -= 1
        loads[hi] -= d
        loads[lo] += d
        return True
    return False


def pack_window_balanced(
    segs: np.ndarray,
    seq_len: int,
    rows_per_batch: int,
    ranks: int,
    fit: str,
    c: float,
    last: bool,
    keep_tail: bool,
) -> tuple[list[np.ndarray], np.ndarray]:
    """One window's balanced steps (module NOTE) and the segments carried to the next."""
    segs, rows = window_rows(segs, seq_len, fit)
    step = ranks * rows_per_batch
    full = len(rows) // step * step
    if last:  # the short step: as many batches as its rows fill (and, keeping the tail, one more)
        fill = (len(rows) - full) // rows_per_batch * rows_per_batch
        short = len(rows) - full if keep_tail else fill
    else:
        short = 0
    kept = rows[: full + short]
    lens = segs[:, 2] - segs[:, 1]
    seg_cost = segment_cost(lens, c)
    cost = np.fromiter((float(seg_cost[row].sum()) for row in kept), np.float64, len(kept))
    by_cost = np.argsort(-cost[:full], kind="stable")
    steps = [np.sort(by_cost[s : s + step]) for s in range(0, full, step)]  # creation order
    if short:
        steps.append(np.arange(full, full + short))
    out: list[np.ndarray] = []
    for chosen in steps:  # each dealt onto balanced batches
        batches = -(-chosen.size // rows_per_batch)
        where = assign_capped(cost[chosen], batches, rows_per_batch)
        out += [listing(segs, [kept[r] for r in chosen[where == b]], fit) for b in range(batches)]
    return out, unplaced(segs, kept) if not last else segs[:0]


def shuffled_steps(
    batches: list[np.ndarray], ranks: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """``batches`` with whole steps of ``ranks`` shuffled; a short last step stays last."""
    whole = len(batches) // ranks
    steps = [batches[i * ranks : (i + 1) * ranks] for i in range(whole)]
    out = [b for i in rng.permutation(whole) for b in steps[i]]
    return out + batches[whole * ranks :]


def step_imbalance(costs: np.ndarray, ranks: int) -> np.ndarray:
    """Per step of ``ranks`` consecutive batch costs (a short last step counts its own
    batches): the largest rank cost over the mean (1.0: perfectly balanced; a step that
    costs nothing counts as balanced)."""
    cost = np.asarray(costs, np.float64)
    out = []
    for s in range(0, cost.size, ranks):
        part = cost[s : s + ranks]
        mean = float(part.mean())
        out.append(float(part.max()) / mean if mean > 0 else 1.0)
    return np.asarray(out, np.float64)
